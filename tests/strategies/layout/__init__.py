"""The parameter layout and its staging (src/shmtrain/strategies/layout/): host staging,
the GPU data flow on the CPU, staged hooks, the initial weights."""

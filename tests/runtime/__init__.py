"""The runtime (src/shmtrain/runtime/): configuration, runs and their folders, data,
launch, training, outputs, jobs across hosts."""

"""The simulator (src/shmtrain/sim/)."""

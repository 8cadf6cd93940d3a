"""The allreduces (src/shmtrain/fabric/allreduce/): shared-memory, the private-tensor
pipeline and its plan, the schedules and their autotune."""

"""The fabric (src/shmtrain/fabric/): shared memory, the allreduces, compression, the
memory server, trust."""

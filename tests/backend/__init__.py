"""The ``shm`` torch.distributed backend (src/shmtrain/backend/): DDP scripts on it, its
failures, and PyTorch's own distributed suite on it."""

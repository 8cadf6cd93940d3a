"""Shared segments (src/shmtrain/fabric/shm/)."""

"""Reproductions of the shmcaffe paper (see shmtrain.reproduce.core)."""

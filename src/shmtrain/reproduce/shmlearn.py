"""Reproductions of the shmlearn paper (see shmtrain.reproduce.core)."""

"""Reproductions of the swcaffe paper (see shmtrain.reproduce.core)."""

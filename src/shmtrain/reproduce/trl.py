"""Reproductions of the trl paper (see shmtrain.reproduce.core)."""

"""Reproductions of the caffegpi paper (see shmtrain.reproduce.core)."""

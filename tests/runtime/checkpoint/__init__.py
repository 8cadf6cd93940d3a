"""Checkpoints, ``--resume``, stops that save and restarts
(src/shmtrain/runtime/checkpoint/)."""

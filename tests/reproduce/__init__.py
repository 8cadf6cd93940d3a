"""``shmtrain reproduce`` (src/shmtrain/reproduce/)."""

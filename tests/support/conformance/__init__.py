"""PyTorch's own distributed test suite as a conformance test of the ``shm`` backend
(``upstream_spawn.py`` runs it, ``compare.py`` compares shm with gloo)."""

"""Reproductions of the papers' experiments (SHM-Learn-Dist: NEURON, HP-SEARCH)."""

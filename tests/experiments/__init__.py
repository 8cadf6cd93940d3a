"""``shmtrain experiment`` (src/shmtrain/experiments/): NEURON and HP-SEARCH."""

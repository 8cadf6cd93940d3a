"""``shmtrain bench`` (src/shmtrain/bench/): each benchmark run end to end on tiny sizes,
its rows and tables."""

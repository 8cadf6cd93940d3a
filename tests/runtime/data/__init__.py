"""Data (src/shmtrain/runtime/data/): ``--data`` sources and kinds, image folders, huge
data sets, inputs checked to the last value."""

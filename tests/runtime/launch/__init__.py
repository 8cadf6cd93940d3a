"""Starting and ending workers (src/shmtrain/runtime/launch/): the zygote, preflight
checks, failures, what a worker leaves, ``shmtrain run``."""

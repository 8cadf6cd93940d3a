"""The command line (src/shmtrain/cli.py) and ``shmtrain torchrun`` (fork_torchrun.py,
fork_worker.py)."""

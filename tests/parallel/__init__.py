"""A DDP loop on shmtrain: the communication hook (src/shmtrain/parallel/comm_hook.py) and the DDP-style
wrapper (parallel/ddp_style.py)."""

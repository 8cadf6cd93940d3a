"""A DDP loop on shmtrain: the communication hook (src/shmtrain/ddp.py) and the DDP-style
wrapper (ddp_style.py)."""

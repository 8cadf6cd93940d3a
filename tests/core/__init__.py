"""src/shmtrain's modules below every part (layer 0 of docs/architecture.md): memory.py."""

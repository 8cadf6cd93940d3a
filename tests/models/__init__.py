"""Models of src/shmtrain/models/: REALIGN."""

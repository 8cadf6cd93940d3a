"""The compressed exchange's codec (src/shmtrain/fabric/compress/)."""

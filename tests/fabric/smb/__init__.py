"""The shared memory buffer service and the memory server (src/shmtrain/fabric/smb/): API,
remote, compressed, reconnects, attacks."""

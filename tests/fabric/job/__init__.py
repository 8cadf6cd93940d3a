"""Who a process is and how it reaches its peers (src/shmtrain/fabric/job/)."""

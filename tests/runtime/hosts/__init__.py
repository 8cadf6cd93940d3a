"""Jobs across hosts on this machine (torchrun launches:
src/shmtrain/runtime/run/torchrun.py, fabric/job/): two hosts against one, asynchronous
strategies, a lost host, network namespaces."""

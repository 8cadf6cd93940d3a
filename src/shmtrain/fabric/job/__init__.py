"""Who this process is in its job, and how it reaches its peers.

- ``context``: the worker's context, built once from the environment (the job's store,
  its host group, the leaders' gloo group across hosts);
- ``netif``: which interface gloo uses across hosts, and clear start-up failures;
- ``subgroup``: one group of a host's workers, shaped like a host;
- ``nccl_group``: NCCL among the job's GPUs (the DDP baseline's transport).
"""

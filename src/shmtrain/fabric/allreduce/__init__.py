"""The allreduce inside a host and across hosts.

- ``pipeline``: private tensors reduced through cache-sized blocks (the drop-in path);
- ``plan`` and ``machine_model``: which algorithm it runs, from a measured model of the
  machine;
- ``shared``: the allreduce of tensors that live in shared memory (and across hosts);
- ``buckets``: bucket by bucket while backward runs;
- ``collectives``: the topology-aware algorithms (swCaffe), their schedules and autotuning.
"""

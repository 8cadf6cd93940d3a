"""Shared memory on one host: the primitives every exchange is built from.

- ``segment``: named POSIX segments as zero-copy tensors (made 0600, attached only if
  this user alone can open them);
- ``futex``: sleeping until a word changes (no spinning);
- ``control``: the host's control block (sequence words, liveness, abort, progress);
- ``host``: the workers of one host (collective allocation, channels, barriers);
- ``stitch``: one contiguous tensor over pages of other segments;
- ``affinity``: a worker's share of the cores.
"""

"""The papers' special exchanges, each over one host's shared memory or its leaders.

- ``star``: the parameter server's gather, average and broadcast;
- ``onesided`` and ``tree_window``: CaffeGPI's one-sided writes and tree reduction;
- ``critical`` and ``accumulator``: per-slot critical counters and TRL's shared gradient
  accumulator;
- ``combiner``: per-layer sums across hosts by the leaders while backward goes on.
"""

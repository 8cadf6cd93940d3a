"""The DDP face: one's own training loop on shmtrain's strategies.

``data_parallel`` (:class:`DataParallel` and ``make_config``: DistributedDataParallel's
contract), ``ddp_style`` (a plain DDP loop where ``optimizer.step()`` is the step),
``comm_hook`` (DDP's own gradient buckets averaged through shared memory).
"""

"""``shmtrain bench hosts``: time to accuracy across two hosts joined by a shaped link.

``command`` (the command and its rounds), ``net`` (the namespaced hosts), ``settings`` (the
written-down comparisons), ``models``, ``ddp`` (PyTorch DDP's baseline), ``rows``.
"""

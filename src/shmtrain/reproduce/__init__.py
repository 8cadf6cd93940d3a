"""``shmtrain reproduce``: the papers' headline results, each re-run by one command.

Each reproduction lives in the module named for its paper (``shmcaffe.py``,
``caffegpi.py``, ``trl.py``, ``swcaffe.py``, ``shmlearn.py``) and registers itself with
:func:`shmtrain.reproduce.core.reproduction`; :mod:`shmtrain.reproduce.core` writes
``NAME.md``, ``NAME.json`` and ``NAME.png`` from the :class:`~shmtrain.reproduce.core.Report`
it returns.
"""

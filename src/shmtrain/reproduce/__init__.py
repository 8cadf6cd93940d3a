"""``shmtrain reproduce``: the papers' headline results, each re-run by one command.

Each reproduction lives in the module named for its paper (``caffegpi.py``, ``trl.py``,
``shmlearn.py``) or, for the larger papers, in a package of that name with one module per
table or figure (``shmcaffe/``: ``table2.py``, ``tables5_6.py``, ``fig7.py`` and
``common.py``; ``swcaffe/``: ``fig10_11.py`` with ``scaling.py`` and ``calibration.py``;
importing the package imports its modules). It registers itself with
:func:`shmtrain.reproduce.core.reproduction`; :mod:`shmtrain.reproduce.core` writes
``NAME.md``, ``NAME.json`` and ``NAME.png`` from the :class:`~shmtrain.reproduce.core.Report`
it returns.
"""

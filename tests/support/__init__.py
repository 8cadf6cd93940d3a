"""What the tests share and pytest never collects: helpers, worker targets, data sets,
models and scripts.

A test module imports from here (``from support.runs import SMALL``), never from another
test module (``tests/project/test_layout.py`` checks it). ``tests/conftest.py`` puts the
tests folder on ``sys.path`` and ``PYTHONPATH``, so workers import these modules too: a
launch names ``"support.resume:resume_worker"``, a run ``--data support.data_sets:blobs``.
"""

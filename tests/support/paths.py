"""Where things are: the repository's root, the tests folder, this support package (as
imported: the paths a traceback of a module here names)."""

from __future__ import annotations

from pathlib import Path

#: the support package (tests/support)
SUPPORT = Path(__file__).absolute().parent
#: the tests folder, which conftest.py puts on sys.path and PYTHONPATH
TESTS = SUPPORT.parent
#: the repository's root (src/, docs/, examples/)
ROOT = TESTS.parent

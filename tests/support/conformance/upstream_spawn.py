"""PyTorch's own distributed test suite, run on the ``shm`` backend or on gloo.

Upstream's ``test/distributed/test_distributed_spawn.py`` sets ``BACKEND``, ``WORLD_SIZE``
and ``TEMP_DIR`` and subclasses ``DistributedTest._DistTestBase`` with ``TestDistBackend``
(a ``MultiProcessTestCase`` that spawns one process per rank). This module builds the same
class, ``TestDistBackendWithSpawn``, from the torch installed here.

**How shm runs tests gated to gloo.** Upstream decides what to run from the ``BACKEND``
label (``skip_if_no_gloo``, ``BACKEND == "gloo"``, ``backend_feature["ddp"]``...), so
``BACKEND`` stays ``gloo`` and, with ``--impl shm``, every group the label creates (the
default group, ``new_group``, ``new_subgroups``...) is built by the shm backend instead:
``_new_process_group_helper`` is wrapped in every rank process (this module runs again in
each spawned child) to build it as ``shm`` and then label it ``gloo`` in torch.distributed's
tables, so ``dist.get_backend()`` reads ``gloo`` while the group's CPU backend is a
:class:`shmtrain.backend.ShmBackend` (the c10d group's type stays CUSTOM: C++ that trusts a
group *typed* gloo to hold a ProcessGroupGloo, as DDP's logger does, never sees the label).
The backend's profiler events are named ``gloo:all_reduce`` there, as upstream looks them
up by the label. Each rank
appends, when it exits, its test's name, its rank, the shm groups it created, the
tensors it reduced through shared memory and its calls per op through shared memory and
to gloo (``shm:broadcast=3 gloo:send=1``) to ``$SHMTRAIN_CONFORMANCE_COUNTS`` (proof that
the shared-memory path ran).

Upstream checks the exit code of rank 0 only; a test counts as passed here only if every
rank exited 0 (on either backend: a crash of another rank fails it).

Usage (``tests/backend/test_conformance.py`` runs it)::

    python tests/support/conformance/upstream_spawn.py --impl shm --world-size 2 \\
        --out results.json [--tests NAME ...] [--match REGEX]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import unittest

#: the families the backend answers for (collectives, DDP on the CPU, process groups, join), by name
FAMILIES = (r"all_reduce|allreduce|reduce|broadcast|all_gather|allgather|gather|scatter|barrier|ddp"
            r"|DistributedDataParallel|join|process_group|new_group|subgroup|destroy|_group")
#: tests that need a GPU or NCCL (skipped by upstream on this CPU-only run: not spawned)
NOT_CPU = r"cuda|nccl|gpu|_stream"
#: seconds a test may run before upstream's harness kills its ranks (upstream: 300-500)
TEST_TIMEOUT_S = int(os.environ.get("SHMTRAIN_CONFORMANCE_TEST_TIMEOUT", "150"))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=["shm", "gloo"], required=True,
                        help="what builds the groups labelled gloo")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--out", required=True, help="JSON file of the outcomes")
    parser.add_argument("--tests", nargs="*", help="upstream test names (default: the families)")
    parser.add_argument("--match", help=f"regex of test names (default: {FAMILIES})")
    parser.add_argument("--start", choices=["spawn", "fork"], default="spawn",
                        help="how ranks start: spawn, as upstream (each rank imports torch and the suite: "
                             "~4 s a test on 2 cores), or fork (the same test code, ranks forked from the "
                             "runner, which has built no group: several times faster)")
    return parser.parse_args()


if __name__ == "__main__":  # before torch's test modules read the environment; the spawned
    ARGS = _parse()  # ranks (``__mp_main__``) inherit it
    os.environ["SHMTRAIN_CONFORMANCE_IMPL"] = ARGS.impl
    os.environ["SHMTRAIN_CONFORMANCE_START"] = ARGS.start
    os.environ["WORLD_SIZE"] = str(ARGS.world_size)
os.environ["BACKEND"] = "gloo"
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())
os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(TEST_TIMEOUT_S)
IMPL = os.environ.get("SHMTRAIN_CONFORMANCE_IMPL", "gloo")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402
from torch.testing._internal import common_distributed  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

from shmtrain.backend import register  # noqa: E402

register(dist)
for name in list(common_distributed.TIMEOUT_OVERRIDE):  # upstream's longer limits, capped
    common_distributed.TIMEOUT_OVERRIDE[name] = min(common_distributed.TIMEOUT_OVERRIDE[name], TEST_TIMEOUT_S)


def _shm_labelled_gloo(helper):
    """``_new_process_group_helper`` that builds a group asked of gloo on shm, then labels it
    gloo in torch.distributed's tables (``get_backend``, ``get_backend_config``): the c10d
    group itself is a shm one (BackendType CUSTOM), so C++ code that trusts a group named
    gloo to hold a ProcessGroupGloo (DDP's logger casts it) does not see the label."""

    def build(group_size, group_rank, global_ranks, backend, store, group_name, *args, **kwargs):
        relabel = str(backend) == "gloo"
        pg, pg_store = helper(group_size, group_rank, global_ranks, "shm" if relabel else backend, store,
                              group_name, *args, **kwargs)
        if relabel and isinstance(pg, dist.ProcessGroup):
            world = c10d._world
            world.pg_map[pg] = ("gloo", world.pg_map[pg][1])
            world.pg_backend_config[pg] = str(c10d.BackendConfig(dist.Backend("gloo")))
        return pg, pg_store

    return build


if IMPL == "shm":  # every "gloo" group of this process is built by the shm backend
    from shmtrain.backend import ShmBackend

    c10d._new_process_group_helper = _shm_labelled_gloo(c10d._new_process_group_helper)
    # upstream looks its profiler events up as dist.get_backend() + ":all_reduce"
    ShmBackend.profile_name = "gloo"
elif IMPL != "gloo":
    raise SystemExit(f"SHMTRAIN_CONFORMANCE_IMPL={IMPL!r}: 'shm' or 'gloo'")


def _record(test_name: str, rank: int) -> None:
    """Append this rank's shared-memory counts to ``$SHMTRAIN_CONFORMANCE_COUNTS``."""
    path = os.environ.get("SHMTRAIN_CONFORMANCE_COUNTS")
    if not path:
        return
    from shmtrain.backend import ShmBackend

    ops = [f"{how}:{op}={n}" for how, counts in (("shm", ShmBackend.through_shm), ("gloo", ShmBackend.through_gloo))
           for op, n in sorted(counts.items())]
    with open(path, "a") as f:
        f.write(" ".join([test_name, str(rank), str(ShmBackend.groups), str(ShmBackend.reductions), *ops]) + "\n")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """Upstream's spawn wrapper (test_distributed_spawn.py), with every rank's exit code
    checked and the shared-memory counts recorded."""

    def setUp(self) -> None:
        super().setUp()
        if os.environ.get("SHMTRAIN_CONFORMANCE_START") == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs) -> None:
        try:
            super()._run(rank, test_name, file_name, pipe, **kwargs)
        finally:
            _record(test_name, rank)

    def _check_return_codes(self, fn, elapsed_time) -> None:
        super()._check_return_codes(fn, elapsed_time)  # raises SkipTest for upstream's skips
        if fn in self.skip_return_code_checks:
            return
        codes = [p.exitcode for p in self.processes]
        if any(code != 0 for code in codes):
            raise AssertionError(f"rank exit codes {codes}: every rank must exit 0")


def selected(names: list[str] | None, match: str | None) -> list[str]:
    """Test names of the wrapper: ``names`` as given, else those matching ``match``
    (default :data:`FAMILIES`) that are not GPU tests, in upstream's order."""
    every = unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn)
    if names:
        missing = sorted(set(names) - set(every))
        if missing:
            raise SystemExit(f"no such upstream tests: {missing}")
        return [n for n in every if n in names]
    pattern = re.compile(match or FAMILIES)
    return [n for n in every if pattern.search(n) and not re.search(NOT_CPU, n, re.I)]


class _Collect(unittest.TextTestResult):
    """Each test's outcome (pass, fail, error, skip), its seconds and first error line."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict] = {}
        self._start = 0.0

    def startTest(self, test) -> None:  # noqa: N802 - unittest's name
        self._start = time.monotonic()
        super().startTest(test)

    def _note(self, test, outcome: str, detail: str = "") -> None:
        lines = [line.strip() for line in detail.strip().splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "exit code" in line]
        self.outcomes[test._testMethodName] = {"outcome": outcome, "seconds": round(time.monotonic() - self._start, 1),
                                              "detail": (errors or lines or [""])[-1][:500]}

    def addSuccess(self, test) -> None:  # noqa: N802
        super().addSuccess(test)
        self._note(test, "pass")

    def addFailure(self, test, err) -> None:  # noqa: N802
        super().addFailure(test, err)
        self._note(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test, err) -> None:  # noqa: N802
        super().addError(test, err)
        self._note(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason) -> None:  # noqa: N802
        super().addSkip(test, reason)
        self._note(test, "skip", reason)


def main(args: argparse.Namespace) -> None:
    names = selected(args.tests, args.match)
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=_Collect)
    result = runner.run(suite)
    with open(args.out, "w") as f:
        json.dump({"impl": args.impl, "world_size": args.world_size, "torch": torch.__version__,
                   "outcomes": result.outcomes}, f, indent=1)


if __name__ == "__main__":
    main(ARGS)

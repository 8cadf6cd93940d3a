"""The "shm" torch.distributed backend: ``import shmtrain`` registers it,
an unchanged DDP script runs on it, and its weights equal DDP's over gloo."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import at_once
from support.paths import SUPPORT
from support.torchrun import FORK, TORCHRUN, env, free_port

pytestmark = pytest.mark.timeout(180)
SCRIPT = str(SUPPORT / "ddp_backend_script.py")


def _run(backend: str, out: Path, nodes: int = 1, per_node: int = 2, launcher: list[str] = TORCHRUN,
         **extra: str) -> None:
    port = free_port()
    procs = [subprocess.Popen(launcher + ["--nnodes", str(nodes), "--node-rank", str(n), "--nproc-per-node",
                                          str(per_node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                                          SCRIPT, backend, str(out)],
                              env={**env(), **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(nodes)]
    outputs = [p.communicate(timeout=150)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs


def _close(a: Path, b: Path) -> float:
    x, y = torch.load(a), torch.load(b)
    return max(float((x[k] - y[k]).norm() / x[k].norm()) for k in x)


@pytest.mark.parametrize("per_node", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ddp_on_the_shm_backend_equals_ddp_on_gloo(tmp_path: Path, per_node: int) -> None:
    _run("gloo", tmp_path / "gloo.pt", per_node=per_node)
    # on the reduction thread (where a host has cores to spare) and on the caller's thread
    _run("cpu:shm", tmp_path / "thread.pt", per_node=per_node, SHMTRAIN_PG_THREAD="1")
    # the script unchanged under shmtrain torchrun too (its workers forked, shmtrain imported before)
    _run("cpu:shm", tmp_path / "inline.pt", per_node=per_node, launcher=FORK, SHMTRAIN_PG_THREAD="0")
    assert _close(tmp_path / "gloo.pt", tmp_path / "thread.pt") < 1e-5
    assert _close(tmp_path / "gloo.pt", tmp_path / "inline.pt") < 1e-5


@pytest.mark.slow  # ~36 s: two torchrun hosts; DDP on the backend equals gloo by default above
def test_two_hosts_reduce_hierarchically(tmp_path: Path) -> None:
    _run("gloo", tmp_path / "gloo.pt", per_node=4)
    _run("shm", tmp_path / "shm.pt", nodes=2, per_node=2)  # host sums, then gloo among leaders
    assert _close(tmp_path / "gloo.pt", tmp_path / "shm.pt") < 1e-5


ORDERS = ["import shmtrain; import torch.distributed as dist",
          "import torch.distributed as dist; import shmtrain",
          "import shmtrain; import torch; from torch import distributed as dist"]


def test_import_shmtrain_registers_the_backend_in_either_order() -> None:
    """Each order in a fresh interpreter, the three at once (each is an import of torch)."""
    done = at_once({order: ([sys.executable, "-c", f"{order}\nprint('shm' in dist.Backend.backend_list)"], None)
                    for order in ORDERS})
    for order, result in done.items():
        assert result.stdout.strip() == "True", (order, result.stderr)


def test_import_shmtrain_alone_does_not_import_torch() -> None:
    code = "import sys, shmtrain; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# -- failures: every surviving rank raises, naming the peer or the mismatch -----------
FAILURE_SCRIPT = str(SUPPORT / "backend_failure_script.py")


def _scenario(name: str, timeout: float = 5.0, thread: bool = False,
              world: int = 2) -> tuple[dict[int, dict], list[int]]:
    """Run ``backend_failure_script.py`` as ``world`` ranks (more than 2: hosts of 2); each
    reporting rank's result and the return codes. ``sigkill``: rank 1 is killed while rank
    0 waits for it."""
    port = str(free_port())
    extra = {"SHMTRAIN_PG_THREAD": "1" if thread else "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": str(world)}
    procs = [subprocess.Popen([sys.executable, FAILURE_SCRIPT, name, str(r), port, str(timeout), str(world)],
                              env={**env(), **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        if name == "sigkill":
            for line in procs[1].stdout:
                if line.startswith("READY"):
                    break
            time.sleep(1.0)  # rank 0 is waiting for rank 1 by now
            procs[1].send_signal(signal.SIGKILL)
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = {}
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
                results[result["rank"]] = result
    assert 0 in results, outputs
    return results, [p.returncode for p in procs]


def _failed_for_good(result: dict) -> None:
    """A later call on the failed group raises (the shared-memory path and gloo's), naming
    the earlier failure; it never returns the input."""
    for later in (result["later"], result["later_gloo"]):
        assert later["raised"] == "ShmBackendError", later
        assert "failed earlier and cannot continue" in later["text"] and "destroy" in later["text"].lower()


@pytest.mark.parametrize("scenario,where", [("raise", "the pipeline"), ("raise_small", "the call ring")])
def test_a_failing_reduction_fails_the_work_on_every_rank(scenario: str, where: str) -> None:
    """Rank 1's reduction raises (a large tensor's pipeline, a small one's call ring)."""
    results, codes = _scenario(scenario)
    for rank, result in results.items():
        first = result["first"]
        assert first["wait"]["raised"] == "ShmBackendError", first  # wait() raises
        assert f"injected fault in {where}" in first["wait"]["text"]
        assert first["future"]["raised"] and "ShmBackendError" in first["future"]["text"]  # so does the future
        assert first["left"] == rank + 1.0  # unreduced, and said so
        _failed_for_good(result)
    assert "rank 1" in results[0]["first"]["wait"]["text"]  # the survivor names the rank that failed
    assert codes == [0, 0]


@pytest.mark.parametrize("how,thread", [("sys_exit", False), ("os_exit", False), ("sigkill", False),
                                        ("sigkill", True)])
def test_a_peer_that_dies_makes_the_survivor_raise(how: str, thread: bool) -> None:
    timeout = 10.0
    results, codes = _scenario(how, timeout=timeout, thread=thread)
    first = results[0]["first"]
    assert first["raised"] == "ShmBackendError" and first["runtime_error"], first
    assert "rank 1 (pid" in first["text"] and "died" in first["text"], first["text"]
    assert first["seconds"] < timeout / 2  # found dead, not waited out
    assert results[0]["inline"] is not thread
    _failed_for_good(results[0])
    assert codes[0] == 0


def test_a_peer_that_never_calls_times_the_survivor_out() -> None:
    timeout = 2.5  # rank 1 sleeps timeout + 3 s: it calls only once rank 0 has given up
    results, codes = _scenario("never_calls", timeout=timeout)
    first = results[0]["first"]
    assert first["raised"] == "ShmBackendError", first
    assert "rank 1 (pid" in first["text"] and f"did not call all_reduce #2 within {timeout:g} s" in first["text"]
    assert timeout - 0.5 <= first["seconds"] <= timeout + 3
    _failed_for_good(results[0])
    late = results[1]["first"]  # the late rank is told at once that its peer gave up on it
    assert late["raised"] == "ShmBackendError" and "gave up on this rank" in late["text"] and late["seconds"] < 1
    _failed_for_good(results[1])
    assert codes == [0, 0]


@pytest.mark.parametrize("thread,other", [(False, 10), (True, 10), (False, 200_000)])
def test_mismatched_sizes_raise_on_every_rank(thread: bool, other: int) -> None:
    """Rank 0's tensor against rank 1's ``other`` elements: 1000 (on the caller's thread)
    and 10, both small (their data travels with the headers); 1000 and one too large for
    the call ring (its header goes alone); with a reduction thread, rank 0's 100000 there
    and rank 1's 10 on its caller's thread."""
    results, codes = _scenario("mismatch" if other == 10 else "mismatch_large", thread=thread)
    assert set(results) == {0, 1}
    mine = 100_000 if thread else 1000
    for rank, result in results.items():
        first = result["first"]
        text = first["wait"]["text"]
        assert first["wait"]["raised"] == "ShmBackendError", first
        assert f"rank 0: {mine} x float32 SUM," in text and f"rank 1: {other} x float32 SUM)" in text, text
        assert first["left"] == rank + 1.0  # nothing reduced: the sizes were compared first
        assert result["own_work"] == {"is_completed": True, "is_success": False, "exception": "ShmBackendError"}
        _failed_for_good(result)
    assert codes == [0, 0]


def test_mismatched_sizes_across_hosts_raise_on_every_rank() -> None:
    """Two hosts of 2 that each agree inside: the leaders see the mismatch (gloo) and tell
    their host's other rank at once, which would otherwise wait out the timeout."""
    timeout = 20.0
    results, codes = _scenario("mismatch_across_hosts", timeout=timeout, world=4)
    assert set(results) == {0, 1, 2, 3}
    for rank, result in results.items():
        first = result["first"]
        text = first["wait"]["text"]
        assert first["wait"]["raised"] == "ShmBackendError", first
        assert "the host of rank 0: 1000 x float32 SUM, the host of rank 2: 10 x float32 SUM" in text, text
        if rank % 2:  # told by its host's leader
            assert f"rank {rank - 1} (pid" in text and "failed" in text, text
        assert first["wait"]["seconds"] < timeout / 2, first  # told, not timed out
        assert first["left"] == rank + 1.0
        _failed_for_good(result)
    assert codes == [0, 0, 0, 0]


def test_ddp_gets_an_exception_when_a_bucket_fails() -> None:
    results, codes = _scenario("ddp_peer_exit", timeout=10.0)
    result = results[0]
    assert result["bucket_reductions"] >= 2  # DDP's buckets went through shared memory
    first = result["first"]
    assert first["raised"] and first["runtime_error"], first  # backward raised: no crash, no silent step
    assert "ShmBackendError" in first["text"] and "rank 1 (pid" in first["text"] and "died" in first["text"]
    assert codes[0] == 0


def test_a_tensor_that_requires_grad_or_is_strided_is_reduced() -> None:
    results, codes = _scenario("requires_grad")
    for result in results.values():
        assert result["first"] == {"is_success": True, "left": 3.0, "grad_fn": False}
        assert result["strided"] == [3.0, 3.0]  # a contiguous copy reduced and copied back
        assert result["later"]["value"] == 3.0
    assert codes == [0, 0]

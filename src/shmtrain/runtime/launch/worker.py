"""Entry point of one worker process: ``python -m shmtrain.runtime.launch.worker module:function``.

Joins the job from the environment, runs the target as ``fn(ctx, payload)`` (the payload
read from the launcher's private folder, ``runtime/launch/job_dir.py``), and puts its
return value there. On any error it marks the failure in the host's control block
first, so peers raise at once (naming this rank) instead of waiting, then puts one line
with its cause in the same folder (``error-<rank>``: the launcher's report) and the
full traceback on its stderr (``logs/rank-<r>.log`` under ``shmtrain train``).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import traceback

from shmtrain.runtime.launch.job_dir import JobDir

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        sys.exit(1)


def _terminate(signum, frame):  # noqa: ARG001
    raise SystemExit(128 + signum)


def _plain_errors() -> tuple[type[BaseException], ...]:
    """shmtrain's own errors whose message alone names the cause: a peer's failure, a
    checkpoint file, a diverged loss (one line; a traceback would say nothing more)."""
    from shmtrain.fabric.shm.control import PeerFailure, PeerTimeout
    from shmtrain.runtime.checkpoint.files import CheckpointError
    from shmtrain.runtime.train.finite import TrainingDiverged

    return PeerFailure, PeerTimeout, CheckpointError, TrainingDiverged


def _says_it_all(exc: BaseException) -> bool:
    """An error whose message alone names the cause (no type name needed)."""
    from shmtrain.runtime.files import OutputError

    return isinstance(exc, (*_plain_errors(), OutputError, ValueError)) and bool(str(exc))


#: paths of code that is not the user's: torch's and shmtrain's own
_NOT_USERS = (os.sep + "torch" + os.sep, os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep)


def _users(location: str) -> bool:
    return not any(part in location for part in _NOT_USERS)


def where(exc: BaseException) -> tuple[str | None, bool]:
    """(``file:line`` of the last frame of ``exc``'s traceback in the user's code, else
    its last frame; whether the error was raised there, in the user's code). A loader
    process's error carries it as ``where`` (``runtime/data/loader.py``: its traceback
    is text)."""
    locations = getattr(exc, "where", None) or [
        f"{f.filename}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)]
    if isinstance(locations, str):
        locations = [locations]
    if not locations:
        return None, False
    theirs = [loc for loc in locations if _users(loc)]
    return (theirs or locations)[-1], _users(locations[-1])


def _report(job, rank: int, exc: BaseException) -> None:
    """One line for the launcher: the cause (with the last frame of an error that is not
    shmtrain's own one-line kind), and the peer waited for when it timed out."""
    from shmtrain.fabric.shm.control import PeerTimeout

    cause = str(exc) if _says_it_all(exc) else f"{type(exc).__name__}: {exc}"
    location, raised_by_user = where(exc)
    if location and (raised_by_user or not _says_it_all(exc)):
        cause += f" (at {location}; the traceback is in this rank's log)"
    from shmtrain.runtime.train.finite import TrainingDiverged

    record = {"cause": " ".join(cause.split()), "peer": getattr(exc, "peer", None),
              "server": getattr(exc, "server", None),
              # a restart would meet it again: the launcher does not restart
              "diverged": isinstance(exc, TrainingDiverged),
              # gloo's own timeouts are RuntimeErrors that say so
              "timeout": isinstance(exc, PeerTimeout | TimeoutError) or "timed out" in cause.lower()}
    try:
        job.put_error(rank, record)
    except OSError:  # the folder is gone (the launcher ended): it reads the log instead
        pass


def _fail_from_threads(job, ctx, rank: str) -> None:
    """A call to the memory server found stuck by its watch thread (``fabric/smb/stuck.py``)
    fails this worker as an error raised here would: marked, reported, said, exit 1."""
    from shmtrain.fabric.smb import stuck

    def fail(exc: BaseException) -> None:
        ctx.fail(1)
        _report(job, ctx.rank, exc)
        print(f"shmtrain: worker rank {rank}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)

    stuck.set_fatal(fail)


def resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _join(timeout: float):
    """This worker's context: the job joined (``shmtrain train``), or, for a user's script
    (``shmtrain run``: ``SHMTRAIN_SCRIPT``), the launcher's store and control block only:
    the script joins the job itself (``init_process_group``, ``DataParallel``)."""
    if os.environ.get("SHMTRAIN_SCRIPT"):
        from shmtrain.runtime.launch.script_worker import ScriptContext

        return ScriptContext.from_env(timeout)
    from shmtrain.fabric.job import context

    return context.from_env(timeout)


def main() -> int:
    _die_with_parent()
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    target = sys.argv[1]
    rank = os.environ.get("RANK", "?")
    threads = int(os.environ.get("SHMTRAIN_THREADS", "1"))
    ctx = None
    job = JobDir.from_env()
    try:
        from shmtrain.memory import keep_freed_memory

        keep_freed_memory()
        import torch

        torch.set_num_threads(threads)
        ctx = _join(float(os.environ.get("SHMTRAIN_TIMEOUT", "120")))
        _fail_from_threads(job, ctx, rank)
        payload = job.payload()
        result = resolve(target)(ctx, payload)
        job.put_result(ctx.rank, result)
        ctx.shutdown()  # every peer done before any gloo pair is torn down
        return 0
    except KeyboardInterrupt:
        if ctx is not None:
            ctx.fail(130)
        return 130
    except SystemExit as exc:
        if ctx is not None:
            ctx.fail(int(exc.code or 1))
        return int(exc.code or 1)
    except BaseException as exc:  # noqa: BLE001 - report, mark, exit non-zero
        if ctx is not None:
            ctx.fail(1)
            _report(job, ctx.rank, exc)
        # anything but shmtrain's own one-line errors (a bad image deep in the data, a full
        # disk) keeps its traceback in the log
        if isinstance(exc, _plain_errors()):
            print(f"shmtrain: worker rank {rank}: {exc}", file=sys.stderr)
        else:
            print(f"shmtrain: worker rank {rank} failed:", file=sys.stderr)
            traceback.print_exc()
        return 1
    finally:
        if ctx is not None:
            try:
                ctx.close()
            except Exception:  # noqa: BLE001
                pass


if __name__ == "__main__":
    sys.exit(main())

"""Checks made by the launcher before any worker starts (one clear line, exit status 2).

Everything that can be known without a worker is checked here, so a mistyped run fails
in a second instead of after N workers have imported torch: the data source (shape,
class count, a sample of its files readable), the batch size against the training set,
the ``--out`` path, the worker count against the cores, and the memory the run needs
against what is free in RAM and in /dev/shm (admission control). ``--force`` lets a run
past the last two, which are estimates. Every message names the option, the value, the
rule and a fix.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.data.kinds import DataFacts
from shmtrain.runtime.data.tensors import held_out

#: workers per core beyond which a run is refused without --force
WORKERS_PER_CORE = 8


def check_data(config: TrainConfig) -> DataFacts:
    """The data source exists, has the right shape and classes, and a sample is readable
    (each data kind's ``Config.facts``: digits and synthetic are not loaded; a folder or
    module:callable is opened as the workers will; a task that reads its own items,
    ``runtime/tasks/data.py``, opens them with its rules)."""
    from shmtrain.runtime.tasks.data import task_facts

    if (facts := task_facts(config, DataFacts)) is not None:  # a task's own items (runtime/tasks/)
        return facts
    return config.data_config.facts()


def check_batch(config: TrainConfig, facts: DataFacts, workers: int) -> None:
    """One global step (batch x workers) must fit in the training set."""
    step = config.batch_size * workers
    if step > facts.train_samples:
        raise ValueError(
            f"--batch-size {config.batch_size}: with {workers} workers one step takes {step} "
            f"samples, but the training set of --data {config.data} holds {facts.train_samples}; "
            f"use --batch-size {max(1, facts.train_samples // workers)} or less"
        )


def check_out(out: Path) -> None:
    """``--out`` is a folder that exists or can be made, and is writable."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is an existing file, not a folder; give a folder path")
    parent = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not parent.is_dir():
        raise ValueError(f"--out {str(out)!r}: {str(parent)!r} is not a folder; give a folder path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {str(out)!r}: {str(parent)!r} is not writable by this user; "
                         "choose a folder you can write")


def check_workers(config: TrainConfig) -> None:
    """A mistyped worker count must not start thousands of processes."""
    cores = os.cpu_count() or 1
    cap = WORKERS_PER_CORE * cores
    if config.workers > cap and not config.force:
        raise ValueError(
            f"--workers {config.workers}: more than {WORKERS_PER_CORE} workers per core "
            f"({cores} cores here, so at most {cap}) only time-share; use --workers {cores}, "
            "or add --force to start them anyway"
        )


def estimate_bytes(config: TrainConfig, facts: DataFacts, workers: int) -> tuple[int, int]:
    """(private bytes for all workers, shared-memory bytes) the run needs, estimated.

    Per worker: weights, gradients, momentum (3 copies of the parameters), the data set
    when it is held in memory (digits, synthetic), and the activations of one batch, measured by one forward pass at batch
    2 and scaled to the batch (x2: what autograd saves, plus the gradients of the
    activations while backward runs). Shared memory:
    two gradient slot sets per worker (the allreduce's, the largest any strategy uses)."""
    import torch

    from shmtrain.models import build_model

    model = build_model(config.model, facts.input_shape, facts.num_classes, config.model_args)
    params = sum(p.numel() for p in model.parameters()) * 4
    sizes: list[int] = []

    def record(_module, _inputs, output) -> None:
        if isinstance(output, torch.Tensor):
            sizes.append(output.numel() * output.element_size())

    hooks = [m.register_forward_hook(record) for m in model.modules() if not list(m.children())]
    with torch.no_grad():
        facts.probe(model) if facts.probe is not None else model(torch.zeros((2, *facts.input_shape)))
    for hook in hooks:
        hook.remove()
    activations = sum(sizes) * config.batch_size // 2 * 2
    data = (facts.train_samples + held_out(facts.train_samples)) * 4 if facts.in_memory else 0
    for dim in facts.input_shape:  # decoded per batch (folders, module:callable): batches only
        data *= dim
    private = workers * (3 * params + activations + data)
    shared = workers * 2 * params
    return private, shared


def available_bytes() -> tuple[int, int]:
    """(RAM available, /dev/shm free) in bytes."""
    available = 0
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    shm = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").exists() else available
    return available, shm


def check_memory(config: TrainConfig, facts: DataFacts, workers: int) -> None:
    """Admission control: refuse a run whose estimate exceeds what is free, unless --force."""
    if config.force:
        return
    private, shared = estimate_bytes(config, facts, workers)
    available, shm = available_bytes()
    gib = 1 << 30
    if private + shared > available:
        raise ValueError(
            f"--model {config.model} --batch-size {config.batch_size} --workers {workers}: the run "
            f"needs about {(private + shared) / gib:.1f} GiB of memory (weights, gradients, "
            f"momentum, data and activations per worker, plus shared buffers) but "
            f"{available / gib:.1f} GiB is available; use a smaller --batch-size or fewer "
            "--workers, or add --force to try anyway"
        )
    if shared > shm:
        raise ValueError(
            f"--model {config.model} --workers {workers}: the shared buffers need about "
            f"{shared / gib:.1f} GiB in /dev/shm but {shm / gib:.1f} GiB is free there; use "
            "fewer --workers, free /dev/shm, or add --force to try anyway"
        )


def preflight(config: TrainConfig, out: Path, workers: int | None = None) -> DataFacts:
    """Every launcher-side check, in the order a user fixes them; returns the data facts."""
    workers = config.workers if workers is None else workers
    check_workers(config)
    check_out(out)
    facts = check_data(config)
    check_batch(config, facts, workers)
    check_memory(config, facts, workers)
    return facts

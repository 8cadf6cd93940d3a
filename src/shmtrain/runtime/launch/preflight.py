"""Checks made by the launcher before any worker starts (one clear line, exit status 2).

Everything that can be known without a worker is checked here, so a mistyped run fails
in a second instead of after N workers have imported torch: the data source (shape,
class count, a sample of its files readable, no link to a folder in a folder of images,
no ``train``/``val`` split folders taken for classes), the batch size against the
training set, the model's outputs against the data's classes (one forward pass on a zero
batch, which the memory estimate uses too), the ``--out`` path, the worker count against
the cores, and the memory the run needs against what is free in RAM (or under this process's cgroup
memory limit, when that is lower) and in /dev/shm (admission control). ``--force`` lets a run
past the last two, which are estimates. Every message names the option, the value, the
rule and a fix.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from shmtrain.runtime.config import TrainConfig
from shmtrain.runtime.data.sources import DataFacts, resident_bytes
from shmtrain.runtime.data.tensors import EAGER_LIMIT, held_out

#: workers per core beyond which a run is refused without --force
WORKERS_PER_CORE = 8


def check_data(config: TrainConfig) -> DataFacts:
    """The data source exists, has the right shape and classes, and a sample is readable
    (each data kind's ``Config.facts``: digits and synthetic are not loaded; a folder or
    module:callable is opened as the workers will; a task that reads its own items,
    ``runtime/tasks/data.py``, opens them with its rules). Data opened here is measured:
    what it cost the launcher, every worker pays too (``DataFacts.open_bytes``)."""
    from shmtrain.runtime.tasks.data import task_facts

    before = resident_bytes()
    facts = task_facts(config, DataFacts)  # a task's own items (runtime/tasks/)
    if facts is None:
        return config.data_config.facts()  # the kind measures what opening it costs
    return replace(facts, open_bytes=max(0, resident_bytes() - before))


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


@dataclass(frozen=True)
class ModelProbe:
    """What one forward pass of the model on a zero batch of 2 tells the launcher."""

    #: bytes of the parameters (float32)
    param_bytes: int
    #: bytes of every leaf module's output for that batch of 2
    activation_bytes: int
    #: the size of the output's last dimension (the class scores), None when it is not a 2-D tensor
    outputs: int | None


def probe_model(config: TrainConfig, facts: DataFacts) -> ModelProbe:
    """Build the model once, as the workers will, and run it on a zero batch of 2."""
    import torch

    from shmtrain.models import build_model

    model = build_model(config.model, facts.input_shape, facts.num_classes, config.model_args)
    sizes: list[int] = []

    def record(_module, _inputs, output) -> None:
        if isinstance(output, torch.Tensor):
            sizes.append(output.numel() * output.element_size())

    hooks = [m.register_forward_hook(record) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():  # a task's own items where it has them (runtime/tasks/data.py)
            out = facts.probe(model) if facts.probe is not None else model(torch.zeros((2, *facts.input_shape)))
    finally:
        for hook in hooks:
            hook.remove()
    out = getattr(out, "logits", out)
    if isinstance(out, tuple | list) and out:
        out = out[0]
    outputs = int(out.shape[-1]) if isinstance(out, torch.Tensor) and out.dim() == 2 else None
    return ModelProbe(sum(p.numel() for p in model.parameters()) * 4, sum(sizes), outputs)


def check_model_outputs(config: TrainConfig, facts: DataFacts, probe: ModelProbe) -> None:
    """The model scores as many classes as the data has: fewer leave labels it cannot
    predict (the loss fails in a worker), more train scores no label ever asks for."""
    if probe.outputs is None or probe.outputs == facts.num_classes:
        return
    how = "too few" if probe.outputs < facts.num_classes else "too many"
    raise ValueError(
        f"--model {config.model}: it gives {probe.outputs} outputs per sample, but --data {config.data} has "
        f"{facts.num_classes} classes ({how}); make its last layer give {facts.num_classes} (a model "
        "callable that takes num_classes gets the data's count)"
    )


def estimate_bytes(config: TrainConfig, facts: DataFacts, workers: int,
                   probe: ModelProbe | None = None) -> tuple[int, int]:
    """(private bytes for all workers, shared-memory bytes) the run needs, estimated.

    Per worker: weights, gradients, momentum (3 copies of the parameters), the data set
    when it is held in memory (digits, synthetic), what opening the data cost the launcher
    (:attr:`DataFacts.open_bytes`, once more for the launcher itself), the sharding
    permutation (at most ``EAGER_LIMIT`` x 8 bytes), and the activations of one batch, measured by one forward pass at
    batch
    2 and scaled to the batch (x2: what autograd saves, plus the gradients of the
    activations while backward runs). Shared memory:
    two gradient slot sets per worker (the allreduce's, the largest any strategy uses)."""
    probe = probe or probe_model(config, facts)
    params = probe.param_bytes
    activations = probe.activation_bytes * config.batch_size // 2 * 2
    data = (facts.train_samples + held_out(facts.train_samples)) * 4 if facts.in_memory else 0
    for dim in facts.input_shape:  # decoded per batch (folders, module:callable): batches only
        data *= dim
    order = min(facts.train_samples, EAGER_LIMIT) * 8  # each worker's epoch permutation
    # the launcher holds the opened data while the workers run, and each worker opens it too
    private = workers * (3 * params + activations + data + order + facts.open_bytes) + facts.open_bytes
    shared = workers * 2 * params
    return private, shared


#: where the cgroup file systems are mounted, and this process's cgroups
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
#: a cgroup limit at or above this is no limit (the kernel's "max" of cgroup v1)
NO_LIMIT = 1 << 60


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return NO_LIMIT if text == "max" else int(text) if text.isdigit() else None


def cgroup_memory() -> tuple[int, int, str] | None:
    """This process's cgroup memory limit: ``(limit, in use, the file that sets it)``, the
    lowest of its cgroup and the cgroups above it (v2: ``memory.max``; v1: the hierarchical
    limit in ``memory.stat``); None when no limit applies or none can be read."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    found: tuple[int, int, str] | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: every folder from this one up to the root
            folder = CGROUP_ROOT / path.lstrip("/")
            if not folder.is_dir():
                folder = CGROUP_ROOT  # a namespace whose root is this cgroup
            used = _read_int(folder / "memory.current")
            while True:
                limit = _read_int(folder / "memory.max")
                if limit is not None and limit < NO_LIMIT and (found is None or limit < found[0]):
                    found = (limit, used or 0, str(folder / "memory.max"))
                if folder == CGROUP_ROOT or CGROUP_ROOT not in folder.parents:
                    break
                folder = folder.parent
        elif "memory" in controllers.split(","):  # cgroup v1
            base = CGROUP_ROOT / "memory"
            folder = base / path.lstrip("/")
            folder = folder if folder.is_dir() else base
            limit = None
            try:
                for row in (folder / "memory.stat").read_text().splitlines():
                    if row.startswith("hierarchical_memory_limit "):
                        limit = int(row.split()[1])
            except (OSError, ValueError):
                limit = _read_int(folder / "memory.limit_in_bytes")
            if limit is not None and limit < NO_LIMIT and (found is None or limit < found[0]):
                found = (limit, _read_int(folder / "memory.usage_in_bytes") or 0,
                         str(folder / "memory.limit_in_bytes"))
    return found


def available_bytes() -> tuple[int, int, str]:
    """(RAM available, /dev/shm free) in bytes, and where the first figure comes from: the
    host's MemAvailable, or a cgroup memory limit less what the cgroup uses when that is
    lower (a container's limit: the OOM killer enforces it, MemAvailable does not show it)."""
    available = 0
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    source = "available (MemAvailable in /proc/meminfo)"
    limit = cgroup_memory()
    if limit is not None and limit[0] - limit[1] < available:
        available = max(0, limit[0] - limit[1])
        source = (f"left under this process's cgroup memory limit ({size_text(limit[0])} in {limit[2]}, "
                  f"{size_text(limit[1])} in use; the OOM killer enforces it)")
    shm = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").exists() else available
    return available, shm, source


def size_text(n: int) -> str:
    """``n`` bytes in the unit that shows it (``1.0 MiB``, ``3.2 GiB``, ``512 KiB``)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def check_memory(config: TrainConfig, facts: DataFacts, workers: int, probe: ModelProbe | None = None) -> None:
    """Admission control: refuse a run whose estimate exceeds what is free, unless --force."""
    if config.force:
        return
    private, shared = estimate_bytes(config, facts, workers, probe)
    available, shm, source = available_bytes()
    if private + shared > available:
        raise ValueError(
            f"--model {config.model} --batch-size {config.batch_size} --workers {workers}: the run "
            f"needs about {size_text(private + shared)} of memory (weights, gradients, "
            f"momentum, data and activations per worker, plus shared buffers) but "
            f"{size_text(available)} is {source}; use a smaller --batch-size or fewer "
            "--workers, or add --force to try anyway"
        )
    if shared > shm:
        raise ValueError(
            f"--model {config.model} --workers {workers}: the shared buffers need about "
            f"{size_text(shared)} in /dev/shm but {size_text(shm)} is free there; use "
            "fewer --workers, free /dev/shm (df -h /dev/shm; a container's is set by docker run "
            "--shm-size), or add --force to try anyway"
        )


def preflight(config: TrainConfig, out: Path, workers: int | None = None) -> DataFacts:
    """Every launcher-side check, in the order a user fixes them; returns the data facts."""
    workers = config.workers if workers is None else workers
    check_workers(config)
    check_out(out)
    facts = check_data(config)
    check_batch(config, facts, workers)
    probe = probe_model(config, facts)  # once, for both checks
    check_model_outputs(config, facts, probe)
    check_memory(config, facts, workers, probe)
    return facts

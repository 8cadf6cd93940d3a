"""``shmtrain evaluate RUN_OR_MODEL [--data ...]``: a trained model's held-out metrics.

``RUN_OR_MODEL`` is a run folder (its ``model.pt``), a model file of one (``model.pt``,
``best.pt``, ``model-rank0.pt``: the run folder is the file's folder), or a checkpoint
(``RUN_DIR/checkpoints/step-<N>``, rank 0's model weights). The run's ``config.toml``
says the model, the task and the data; ``--data`` (with ``--data-args``) evaluates on
other data, read by the same task and split the same way (``--val-fraction``). The task
(``runtime/tasks/``) computes the metrics over the split ``--split`` names (``held-out``,
the default, or ``train``), in batches on the CPU, the model in ``eval()`` mode. They are
printed and written as JSON (``--out``, default ``RUN_DIR/evaluation.json``).

The run folder and every file read from it must be trusted (this user's, or listed in
``SHMTRAIN_TRUSTED``: :mod:`shmtrain.runtime.trusted_files`): its ``config.toml`` names
the model, which may be a ``module:callable`` that is imported and called. Weights load
with ``torch.load(weights_only=True)`` (tensors and containers, never unpickled objects).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

EVAL_BATCH = 256


def locate(target: str) -> tuple[Path, Path, Path, str]:
    """(run folder, folder of the config.toml, the weights' file or checkpoint, its kind:
    ``file`` or ``checkpoint``) of ``target``."""
    from shmtrain.runtime import trusted_files

    path = Path(target)
    if path.is_file() and path.name == "latest" and path.parent.name == "checkpoints":
        trusted_files.check_folder(path.parent.parent)
        pointer = trusted_files.read_bytes(path, "run file").decode(errors="replace").strip()
        path = path.parent / pointer  # checkpoints/latest names the newest
    if path.is_file():
        return path.parent, path.parent, path, "file"
    if (path / "meta.json").is_file():  # a checkpoint: checkpoints/step-<N>
        return path.parent.parent, path, path, "checkpoint"
    if (path / "model.pt").is_file():
        return path, path, path / "model.pt", "file"
    if (path / "config.toml").is_file():
        raise ValueError(f"shmtrain evaluate {target}: the run folder has no model.pt (the run did not finish); "
                         f"evaluate one of its checkpoints instead, e.g. shmtrain evaluate "
                         f"{path / 'checkpoints' / 'latest'}")
    raise ValueError(f"shmtrain evaluate {target}: not a run folder of shmtrain train (no model.pt and "
                     "config.toml), a model file of one, or a checkpoint folder; give e.g. runs/my-run")


def _weights(target: Path, kind: str) -> dict[str, Any]:
    import torch

    from shmtrain.runtime.checkpoint import files

    if kind == "checkpoint":
        world = files.read_meta(target)["world"]
        return files.load_rank(target, 0, world)["model"]
    from shmtrain.runtime import trusted_files

    try:
        f = trusted_files.open_file(target, "model file")
    except OSError as exc:
        raise ValueError(f"shmtrain evaluate {target}: cannot be read ({exc.strerror or exc})") from None
    with f:
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any loading error: name the file
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"shmtrain evaluate {target}: cannot be loaded as a model state_dict with "
                             f"torch.load(weights_only=True) ({reason})") from None


def evaluate(target: str, overrides: dict[str, Any], split: str = "held-out") -> dict[str, Any]:
    """The task's metrics of the model ``target`` names (module docstring)."""
    from shmtrain.models import build_model
    from shmtrain.runtime import trusted_files
    from shmtrain.runtime.config import read_toml, resolve
    from shmtrain.runtime.data.loader import HeldOut
    from shmtrain.runtime.tasks import task_of
    from shmtrain.runtime.tasks.data import open_run_data

    run, config_dir, weights, kind = locate(target)
    trusted_files.check_folder(run)
    toml = config_dir / "config.toml"
    if not toml.is_file():
        raise ValueError(f"shmtrain evaluate {target}: {toml} is missing; give a model file inside the run "
                         "folder that wrote it")
    values = read_toml(str(toml), "run file")
    if overrides.get("data") is not None and overrides["data"] != values.get("data"):
        for key in ("data_args", "val_fraction", "val_data"):  # the run's own data's options
            values.pop(key, None)
    values.update({k: v for k, v in overrides.items() if v is not None})
    values.update(workers=1, out=str(run), tensorboard=False)
    config = resolve(values)
    task = task_of(config)
    source = open_run_data(config, task)
    model = build_model(config.model, source.input_shape, source.num_classes, config.model_args)
    state = _weights(weights, kind)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"shmtrain evaluate {target}: the weights do not fit --model {config.model} on this "
                         f"data ({str(exc).splitlines()[0]}); evaluate with the run's own --data") from None
    start = time.perf_counter()
    if split == "train":
        from torch.utils.data import DataLoader

        batches: Any = DataLoader(source.train, batch_size=EVAL_BATCH)
        samples = source.train_samples
    else:
        batches, samples = HeldOut(source, 0), source.val_samples
    try:
        metrics = task.evaluate(model, batches)
    finally:
        if isinstance(batches, HeldOut):
            batches.close()
    return {"model": str(weights), "run": str(run), "task": task.name, "metric": task.primary,
            "data": config.data, "split": split, "samples": samples, "metrics": metrics,
            task.primary: metrics[task.primary], "seconds": round(time.perf_counter() - start, 3)}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``shmtrain evaluate``."""
    p = sub.add_parser(
        "evaluate", help="a trained model's held-out metrics (run folder, model file or checkpoint)",
        description="Evaluate a model shmtrain train wrote on held-out data: the task's metrics (accuracy, "
                    "rmse, perplexity, and the loss), printed and written as JSON.",
        epilog="examples:\n  shmtrain evaluate runs/my-run\n  shmtrain evaluate runs/my-run/best.pt\n"
               "  shmtrain evaluate runs/my-run/checkpoints/latest --data mypkg.data:other_set\n\n"
               "The run folder and its files are read only when you (or root) own them and not every user\n"
               "can write them: its config.toml names the model, which may be module:callable code that is\n"
               "imported and called. To evaluate another user's run, list it in SHMTRAIN_TRUSTED (paths\n"
               "separated by ':', each trusting what lies under it), e.g.\n"
               "  SHMTRAIN_TRUSTED=/home/alice/runs/a shmtrain evaluate /home/alice/runs/a\n"
               "Weights load with torch.load(weights_only=True): tensors and numbers, never pickled objects.\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="RUN_OR_MODEL",
                   help="a run folder (its model.pt), a .pt model file in one, or a checkpoint folder")
    p.add_argument("--data", help="evaluate on this data instead of the run's (as shmtrain train's --data)")
    p.add_argument("--data-args", help="keyword arguments of --data module:callable (as shmtrain train's)")
    p.add_argument("--val-fraction", type=float, help="the held-out share of --data (as shmtrain train's)")
    p.add_argument("--split", choices=("held-out", "train"), default="held-out",
                   help="which part of the data (default held-out)")
    p.add_argument("--out", metavar="FILE", help="the JSON file (default RUN_DIR/evaluation.json)")
    p.set_defaults(handler=_evaluate)


def _evaluate(args: argparse.Namespace) -> int:
    overrides = {"data": args.data, "data_args": args.data_args, "val_fraction": args.val_fraction}
    result = evaluate(args.target, overrides, args.split)
    out = Path(args.out) if args.out else Path(result["run"]) / "evaluation.json"
    from shmtrain.runtime.files import write_output

    write_output(out, (json.dumps(result, indent=2) + "\n").encode())
    metric = result["metric"]
    value = result[metric]
    shown = f"{value * 100:.2f}%" if metric == "accuracy" else f"{value:.4g}"
    others = ", ".join(f"{k} {v:.4g}" for k, v in result["metrics"].items() if k != metric)
    print(f"{result['model']}: {metric} {shown} ({others}) on {result['samples']} {result['split']} samples of "
          f"{result['data']} (--task {result['task']}); {out}")
    return 0

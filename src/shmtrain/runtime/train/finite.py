"""Non-finite numbers: JSON that stays JSON, and a run that says when it diverged.

``json.dumps`` writes ``NaN`` and ``Infinity``, which no JSON parser accepts, so every
metrics row and ``summary.json`` go through :func:`json_text`: a non-finite float is
written as ``null`` and the object that held it gets a ``"non_finite"`` list naming the
keys (``"loss"``, ``"time.compute"``) and what they held. A non-finite training loss
ends the run instead (:class:`TrainingDiverged`, exit status 1), naming the rank and
the iteration; so does a checkpoint whose weights, optimizer state or strategy state hold
a non-finite number (:func:`first_non_finite`, before it is written: a checkpoint that
would only diverge again is never committed, ``runtime/checkpoint/checkpointer.py``).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

#: the key that lists the values written as null, with what they were
FLAG = "non_finite"


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite; the message names the rank, the
    iteration and the fix."""


def _clean(value: Any, path: str, found: dict[str, str]) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        found[path] = repr(value)  # 'nan', 'inf', '-inf'
        return None
    if isinstance(value, dict):
        return {k: _clean(v, f"{path}.{k}" if path else str(k), found) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v, f"{path}[{i}]", found) for i, v in enumerate(value)]
    return value


def finite(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with every non-finite float (at any depth) replaced by None, and the
    :data:`FLAG` key listing them (absent when there were none)."""
    found: dict[str, str] = {}
    cleaned = _clean(obj, "", found)
    if found:
        cleaned[FLAG] = found
    return cleaned


def json_text(obj: dict[str, Any], **dumps: Any) -> str:
    """Valid JSON for ``obj`` (see :func:`finite`); never ``NaN`` or ``Infinity``."""
    return json.dumps(finite(obj), allow_nan=False, **dumps)


def check_loss(value: float, iteration: int, rank: int, lr: float | None, amp: str | None = None,
               first: bool = False) -> None:
    """Raise :class:`TrainingDiverged` when the training loss of ``iteration`` is not finite.

    The cause it names: under ``--amp fp16`` (``amp``), float16's range (a forward pass or
    loss past 65504 is inf there while the float32 weights are fine); at the run's first
    iteration (``first``: no update has been made), the data or the model's output; else
    the weights, which the updates have driven past any number."""
    if math.isfinite(value):
        return
    rate = f" (now {lr:g})" if lr is not None else ""
    said = f"the training diverged: rank {rank}'s loss at iteration {iteration} is {value!r}; its metrics row has " \
           "\"loss\": null; "
    if amp == "fp16":
        raise TrainingDiverged(
            said + "under --amp fp16 the forward pass and the loss run in float16, which holds numbers up to "
            "65504 only: this batch's activations or loss went past it (the float32 weights need not be "
            f"broken{', no update has been made yet' if first else ''}); use --amp bf16 (float32's range in "
            "16 bits), leave --amp out, or scale the model's inputs or outputs down")
    if first:
        raise TrainingDiverged(
            said + "no update has been made yet, so the weights are as initialised: the model's output or the "
            "loss on this batch is not a number; check the data for NaN or inf and the model's initialisation "
            "and loss, then start again with another --out")
    raise TrainingDiverged(
        said + "the weights are no longer numbers, so the run stops "
        f"here: lower --lr{rate}, or add --warmup-iterations or --grad-clip, and start again "
        "with another --out"
    )


def first_non_finite(state: Any, path: str = "") -> str | None:
    """The first place (``model.fc.weight``, ``optimizer.state.0.momentum_buffer``) in
    ``state`` where a floating tensor or float holds NaN or an infinity; None when all are
    finite."""
    if isinstance(state, torch.Tensor):
        if state.is_floating_point() or state.is_complex():
            return None if bool(torch.isfinite(state).all()) else path
        return None
    if isinstance(state, float):
        return None if math.isfinite(state) else path
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, list | tuple):
        items = enumerate(state)
    else:
        return None
    for key, value in items:
        found = first_non_finite(value, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def check_state(state: dict[str, Any], iteration: int, rank: int, last_finite: str | None) -> None:
    """Raise :class:`TrainingDiverged` when the weights, optimizer or strategy state of a
    checkpoint about to be written (``Trainer.state_dict``) is not finite."""
    for part in ("model", "optimizer", "strategy"):
        where = first_non_finite(state.get(part), part)
        if where is not None:
            kept = f"the last finite checkpoint is {last_finite}" if last_finite else "no finite checkpoint exists"
            raise TrainingDiverged(
                f"the training diverged: rank {rank}'s state after iteration {iteration} is not finite "
                f"({where} holds NaN or inf, with a finite loss: a gradient went NaN), so checkpoint "
                f"step-{iteration} is not written; {kept}; lower --lr, or add --warmup-iterations or "
                "--grad-clip, and start again with another --out")

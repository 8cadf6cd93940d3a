"""This process's random number generators' states, as values a checkpoint can hold.

A checkpoint is loaded with ``torch.load(weights_only=True)``, which rebuilds tensors,
numbers, strings, lists, tuples and dicts and nothing else (so loading one never runs
code it names). torch's RNG states are tensors already, Python's ``random.getstate()``
is a tuple of integers; numpy's legacy state is a tuple holding an ``ndarray`` of 624
``uint32`` words, which only unpickling rebuilds, so its words are kept as an ``int64``
tensor here and turned back into the ``uint32`` array when restored (every word, the
position and the cached Gaussian as they were: a resumed run draws the same numbers).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """The torch (and, once CUDA is in use, every GPU's), numpy and Python RNG states."""
    kind, words, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "words": torch.from_numpy(words.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": random.getstate(),
    }
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put the states of :func:`capture` back (the GPUs: as many as both have)."""
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    words = saved["words"].numpy().astype(np.uint32)
    np.random.set_state((saved["kind"], words, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        for index, rng in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(rng, index)

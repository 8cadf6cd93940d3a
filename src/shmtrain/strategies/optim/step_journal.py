"""The root's state after each step, kept where the root's death does not take it: what a
worker replaced in place continues from when one rank alone holds the optimizer.

In CaffeGPI (Kühn, Keuper and Pfreundt, "GPI-2 based distributed training", Fig. 4) the
root updates each layer as soon as its reduced gradient is complete, during backward, with
the only optimizer state of the job; the other ranks only copy the new weights. A death in
the middle of a step therefore leaves a root whose layers are partly of the next step, and
a dead root takes the optimizer state with it. The journal keeps the state as it stood
after a whole step: the root writes its weights and its optimizer state (every tensor of
``optimizer.state``, and its plain values) once all of a step's layers are updated and
*before* it announces the last of them, so any rank that completed step ``t`` finds the
state after ``t`` here. Two slots, step ``t`` in ``t % 2``: slot ``t`` is overwritten by
step ``t + 2``, whose updates need every rank's gradient of ``t + 2``, so no rank is
still short of step ``t + 1`` by then.

A slot is a private file of the run's launch folder (mode 0600 in a 0700 folder; read
back with the owner check of :func:`shmtrain.fabric.trust.read_private`): the step's
number (``-1`` while a write is under way, so a write the death cut short is never
read), the length of a JSON header (names, dtypes, shapes, offsets; plain values), the
header, then the tensors' bytes. JSON and raw bytes only: nothing in it can run code.
"""

from __future__ import annotations

import json
import os
import struct
import weakref
from pathlib import Path
from typing import Any

import torch

from shmtrain.fabric.trust import check_fd, read_private

SLOTS = 2
_HEAD = struct.Struct("<qq")  # the step, the header's length
_PLAIN = (int, float, bool, str, type(None))


def slot_path(folder: Path, slot: int, prefix: str = "step-journal") -> Path:
    return folder / f"{prefix}-{slot}"


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


class StepJournal:
    """The root's writer (module docstring): ``names`` are the parameters' names in the
    module's ``state_dict``, in the order of ``params``."""

    def __init__(self, folder: Path, names: list[str], params: list[torch.Tensor],
                 optimizer: torch.optim.Optimizer | None, prefix: str = "step-journal") -> None:
        self.names, self.params, self.optimizer = names, params, optimizer
        #: the last step written (None: none yet)
        self.tag: int | None = None
        self.fds = []
        # this launch's files; a previous generation's slots stay readable: the state after
        # step t is the same in every generation (the ranks are replicas), and a root killed
        # before it wrote again leaves the survivors its predecessor's
        for slot in range(SLOTS):
            fd = os.open(slot_path(folder, slot, prefix), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            check_fd(fd, f"the step journal {slot}", "it is not the one this run wrote", private=True)
            self.fds.append(fd)
        self._closer = weakref.finalize(self, _close, self.fds)  # a session dropped without finish

    def write(self, step: int) -> bool:
        """The state after ``step`` (weights and optimizer state, as they stand) into slot
        ``step % 2``; False (the slot left empty) for an optimizer state that is neither a
        tensor nor a plain value."""
        state: list[tuple[int, str, Any]] = []
        index = 0
        for group in self.optimizer.param_groups if self.optimizer is not None else []:
            for p in group["params"]:
                for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                    if not isinstance(value, (torch.Tensor, *_PLAIN)):
                        os.pwrite(self.fds[step % SLOTS], _HEAD.pack(-1, 0), 0)
                        self.tag = None
                        return False
                    state.append((index, key, value))
                index += 1
        return self.write_entries(step, list(zip(self.names, self.params, strict=True)), state)

    def write_entries(self, step: int, named: list[tuple[str, torch.Tensor]],
                      state: list[tuple[int, str, Any]] = ()) -> bool:
        """Tensors by name (and ``(index, key, value)`` of an optimizer's state) as the
        state after ``step``, into slot ``step % 2``."""
        fd = self.fds[step % SLOTS]
        os.pwrite(fd, _HEAD.pack(-1, 0), 0)
        chunks: list[memoryview] = []
        offset = 0

        def put(tensor: torch.Tensor) -> list[Any]:
            nonlocal offset
            view = _bytes(tensor)
            chunks.append(view)
            entry = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, view.nbytes]
            offset += view.nbytes
            return entry

        params = [[name, *put(t)] for name, t in named]
        entries = [[index, key, "tensor", *put(value)] if isinstance(value, torch.Tensor) else
                   [index, key, "plain", value] for index, key, value in state]
        header = json.dumps({"params": params, "state": entries}).encode()
        os.pwritev(fd, [header, *chunks], _HEAD.size)
        os.pwrite(fd, _HEAD.pack(step, len(header)), 0)  # whole: readable from now on
        self.tag = step
        return True

    def close(self) -> None:
        self._closer()


def _close(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def read(folder: Path, step: int, prefix: str = "step-journal"
         ) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, Any]]] | None:
    """The journal's state after ``step``: the weights by name and the optimizer's
    ``state`` (as in its ``state_dict``), or None where no whole slot holds that step."""
    path = slot_path(folder, step % SLOTS, prefix)
    if not path.exists():
        return None
    data = read_private(path, "the step journal")
    if len(data) < _HEAD.size:
        return None
    tag, length = _HEAD.unpack_from(data)
    if tag != step:
        return None
    header = json.loads(data[_HEAD.size:_HEAD.size + length])
    base = _HEAD.size + length

    def get(dtype: str, shape: list[int], offset: int, nbytes: int) -> torch.Tensor:
        kind = getattr(torch, dtype, None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"the step journal names {dtype!r}, not a dtype")
        raw = bytearray(data[base + offset:base + offset + nbytes])
        return torch.frombuffer(raw, dtype=torch.uint8).view(kind).reshape(shape) if nbytes else \
            torch.empty(shape, dtype=kind)

    weights = {name: get(*entry) for name, *entry in header["params"]}
    state: dict[int, dict[str, Any]] = {}
    for index, key, kind, *rest in header["state"]:
        state.setdefault(int(index), {})[key] = get(*rest) if kind == "tensor" else rest[0]
    return weights, state


class JournaledSteps:
    """A strategy whose root alone steps the optimizer (gpi's root, ps_grad's server) and
    whose survivors of a death therefore go on from the root's journal: the root calls
    :meth:`journal_step` once a step's update is whole and before any rank can complete
    that step; every survivor's kept state takes its weights and optimizer state from the
    slot of its own last step (``Strategy.prepare_recovery``, ``Strategy.recovery_state``).
    Needs the strategy's ``model``, ``params``, ``optimizer`` and ``iteration``, and
    :meth:`journals`."""

    _journal_folder: Path | None = None
    _journal: StepJournal | None = None

    def journals(self) -> bool:
        """Whether this rank writes the journal (the root, on one host, CPU parameters)."""
        raise NotImplementedError

    def prepare_recovery(self, folder: Path) -> None:
        self._journal_folder = folder
        if self._journal is None and self.journals():
            names = {id(p): name for name, p in self.model.named_parameters()}
            self._journal = StepJournal(folder, [names[id(p)] for p in self.params], self.params, self.optimizer)
            self._journal.write(self.iteration)

    def journal_step(self) -> None:
        """The root: this step's update is whole; the state after it into the journal."""
        if self._journal is not None:
            self._journal.write(self.iteration + 1)

    def recovery_state(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """This rank's kept ``state`` with the weights and optimizer state after its last
        whole step, from the root's journal (a root part-way through a step may hold part
        of the next one, and the other ranks' weights may too); None where the journal
        lacks that step."""
        if self._journal_folder is None:
            return None
        found = read(self._journal_folder, int(state["train"]["iteration"]))
        if found is None:
            return None
        weights, optimizer_state = found
        state["model"] = {**state["model"], **weights}
        state["optimizer"] = {**state["optimizer"], "state": optimizer_state}
        return state

    def close_journal(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

"""``--data module:callable``: a data set the user brings (docs/data.md).

The spec names a callable in an importable module (the current directory is importable,
as for ``--model``, ``models/user.py``), called with ``--data-args`` (``'k=v; k=v'``,
Python literals). It returns a map-style :class:`torch.utils.data.Dataset` (``__getitem__``
and ``__len__``), whose share ``--val-fraction`` (0.2, a permutation with seed 0, computed
per index: ``runtime/data/permutation.py``, so nothing per item is allocated) is held out,
or a ``(train, val)`` pair of them. Each item is ``(x, label)``: ``x`` a floating-point
tensor, every item of the same shape; ``label`` an ``int`` (or a 0-d integer tensor) in
``0 .. classes - 1``.

What the run needs is read from the data:

- the input shape: ``x`` of the first training item;
- the number of classes: a ``classes`` attribute (the class names, label = position, as
  torchvision's data sets have; a dict name -> label is taken as it is), else a
  ``num_classes`` attribute, looked up on the data set and on the data set it wraps
  (``.dataset``, as :class:`~torch.utils.data.Subset` has); else the largest label + 1 of
  every training item, when there are at most :data:`SCAN_LIMIT`; else refused, with the
  fix (add ``classes`` or ``num_classes``);
- the class map saved to ``RUN_DIR/classes.json``: ``class_to_idx`` or ``classes`` when
  there are names, ``{"0": 0, "1": 1, ...}`` otherwise.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shmtrain.models.user import resolve_callable
from shmtrain.runtime.data.permutation import PermutedRange
from shmtrain.runtime.data.tensors import held_out
from shmtrain.typed_options import parse_kwargs

#: training items read to find the number of classes when the data set does not say it
SCAN_LIMIT = 4096


def _is_dataset(value: Any) -> bool:
    return hasattr(value, "__getitem__") and hasattr(value, "__len__") and not isinstance(value, str | bytes)


def call_data(spec: str, args: str) -> Any:
    """What ``spec`` returns when called with ``--data-args``."""
    factory = resolve_callable(spec, "--data")
    kwargs = parse_kwargs(args, "--data-args")
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise ValueError(f"--data {spec!r} with --data-args {args!r}: {exc}; give the arguments it "
                         "takes") from None
    except ValueError:  # no signature to check (a builtin): the call says
        pass
    return factory(**kwargs)


def split_user_data(spec: str, result: Any, val_fraction: float | None) -> tuple[Any, Any]:
    """(train, val) of what ``spec`` returned: a pair, or one Dataset split by ``val_fraction``."""
    if isinstance(result, torch.utils.data.IterableDataset):
        raise ValueError(f"--data {spec!r} returned an IterableDataset, which cannot be sharded by index; "
                         "return a map-style Dataset (__getitem__ and __len__)")
    if isinstance(result, tuple | list) and len(result) == 2 and all(_is_dataset(d) for d in result):
        if val_fraction is not None:
            raise ValueError(f"--val-fraction {val_fraction} with --data {spec!r}: it returned a (train, val) "
                             "pair, nothing is split off; leave --val-fraction out, or return one Dataset")
        train, val = result
    elif _is_dataset(result) and not isinstance(result, tuple | list):
        if len(result) < 2:
            raise ValueError(f"--data {spec!r} returned a Dataset of {len(result)} item(s); at least 2 are "
                             "needed (one to train on, one held out)")
        size = len(result)
        test = held_out(size, val_fraction or 0.2)  # a permutation computed per index: O(1) memory
        train = torch.utils.data.Subset(result, PermutedRange(size, 0, test, size))
        val = torch.utils.data.Subset(result, PermutedRange(size, 0, 0, test))
        for attr in ("classes", "class_to_idx", "num_classes"):  # the Subsets keep what it says
            if hasattr(result, attr):
                setattr(train, attr, getattr(result, attr))
    else:
        raise ValueError(f"--data {spec!r} returned a {type(result).__name__}, not a torch.utils.data.Dataset "
                         "or a (train, val) pair of them; return e.g. a TensorDataset")
    for name, part in (("training", train), ("validation", val)):
        if len(part) == 0:
            raise ValueError(f"--data {spec!r}: the {name} set is empty; give it items")
    return train, val


def check_item(spec: str, item: Any, which: str) -> tuple[int, ...]:
    """The shape of ``x`` of ``item``; ValueError unless it is ``(float tensor, int label)``."""
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise ValueError(f"--data {spec!r}: {which} is a {type(item).__name__}, not an (x, label) pair; "
                         "__getitem__ must return (tensor, int)")
    x, y = item
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        kind = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise ValueError(f"--data {spec!r}: x of {which} is {kind}, not a floating-point tensor with at least "
                         "one dimension; return e.g. torch.as_tensor(x, dtype=torch.float32)")
    label_ok = isinstance(y, int | np.integer) and not isinstance(y, bool)
    label_ok = label_ok or (isinstance(y, torch.Tensor) and y.dim() == 0 and not y.is_floating_point()
                            and y.dtype != torch.bool)
    if not label_ok:
        raise ValueError(f"--data {spec!r}: the label of {which} is {y!r} ({type(y).__name__}), not an integer "
                         "class index; return (x, int(label))")
    return tuple(x.shape)


def _declared(dataset: Any) -> Any:
    """``classes`` or ``num_classes`` of ``dataset`` or of one it wraps (``.dataset``)."""
    seen = 0
    while dataset is not None and seen < 8:
        for attr in ("class_to_idx", "classes", "num_classes"):
            value = getattr(dataset, attr, None)
            if value is not None and not callable(value):
                return value
        dataset, seen = getattr(dataset, "dataset", None), seen + 1
    return None


def class_map(spec: str, train: Any) -> dict[str, int]:
    """Class name -> label, from what ``train`` declares or a scan (module docstring)."""
    declared = _declared(train)
    if isinstance(declared, Mapping):
        return {str(k): int(v) for k, v in declared.items()}
    if isinstance(declared, Sequence) and not isinstance(declared, str) and len(declared) > 0:
        return {str(name): index for index, name in enumerate(declared)}
    if isinstance(declared, int | np.integer) and not isinstance(declared, bool) and declared > 0:
        return {str(i): i for i in range(int(declared))}
    if declared is not None:
        raise ValueError(f"--data {spec!r}: its classes/num_classes attribute is {declared!r}; give the class "
                         "names (a list) or their number (a positive int)")
    if len(train) > SCAN_LIMIT:
        raise ValueError(f"--data {spec!r}: the number of classes is not known: the data set has no classes or "
                         f"num_classes attribute, and its {len(train)} items are more than the {SCAN_LIMIT} "
                         "shmtrain reads to find the largest label; set dataset.classes = [names] or "
                         "dataset.num_classes = N")
    labels = [int(train[i][1]) for i in range(len(train))]
    if min(labels) < 0:
        raise ValueError(f"--data {spec!r}: label {min(labels)} is negative; labels are 0 .. classes - 1")
    return {str(i): i for i in range(max(labels) + 1)}

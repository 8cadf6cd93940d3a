"""Section ``model and data`` of :class:`shmtrain.runtime.config.TrainConfig`: the network
and what it trains on (issue 30, item 1; docs/data.md).

The data options that apply to one kind of data only default to None and are settled
here, once, for the kind ``--data`` names, so ``config.toml`` records what the run used
(a folder's true input shape, synthetic data's sample count) and an option that the kind
would ignore is refused instead:

=========================  ==========================================================
``--data``                 options it takes (others are refused, naming the fix)
=========================  ==========================================================
``digits``                 ``--val-fraction``
``synthetic``              ``--input-shape`` (3x64x64), ``--samples`` (1024), ``--val-fraction``
a folder of images         ``--image-size`` or ``--input-shape 3xHxW`` (32), ``--transform``
                           (standard), ``--val-data`` or ``--val-fraction``,
                           ``--loader-workers`` (2), ``--skip-bad-files``
``module:callable``        ``--data-args``, ``--val-fraction`` (a single Dataset), ``--loader-workers`` (2)
=========================  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shmtrain.models import model_names
from shmtrain.models.user import is_user_spec, resolve_callable
from shmtrain.runtime.data.tensors import parse_shape
from shmtrain.runtime.options import need as _need
from shmtrain.runtime.options import option
from shmtrain.typed_options import parse_kwargs

#: the held-out share when no separate validation set is given
VAL_FRACTION = 0.2
#: ``--image-size`` of a folder when neither it nor ``--input-shape`` is given
IMAGE_SIZE = 32
SYNTHETIC_SHAPE, SYNTHETIC_SAMPLES = "3x64x64", 1024
#: DataLoader worker processes per training worker for decoded data (folders, module:callable)
LOADER_WORKERS = 2
Transform = Literal["none", "normalize", "standard"]


def data_kind(data: str) -> str:
    """``digits``, ``synthetic``, ``callable`` (module:callable) or ``folder``."""
    if data in ("digits", "synthetic"):
        return data
    return "callable" if is_user_spec(data) else "folder"


@dataclass(kw_only=True)
class DataOptions:
    """Section ``model and data``: the network and what it trains on (a mixin, see
    :class:`shmtrain.runtime.config.JobOptions`)."""

    __slots__ = ()

    model: str = option("smallcnn", "the network: a built-in name, or module:callable, your own (a class or "
                        "function returning an nn.Module; docs/own_model.md)", "data", names=model_names)
    model_args: str = option("", "keyword arguments of --model module:callable, as k=v separated by ';' "
                             "(Python literals), e.g. --model-args 'width=64; depth=3'", "data", metavar="K=V;...")
    data: str = option("digits", "digits, synthetic, a folder with one sub-folder of images per class, or "
                       "module:callable returning a torch Dataset or a (train, val) pair (docs/data.md)", "data")
    data_args: str = option("", "keyword arguments of --data module:callable, as k=v separated by ';' "
                            "(Python literals), e.g. --data-args 'root=\"data\"; size=32'", "data", metavar="K=V;...")
    val_data: str | None = option(None, "a folder of held-out images with the same class sub-folders, for a "
                                  "folder --data", "data", default_text="a share of --data, --val-fraction",
                                  example="path/to/val", metavar="DIR")
    val_fraction: float | None = option(
        None, "the share of the data held out for evaluation when no separate validation set is given "
        "(a permutation with seed 0, the same for every --seed)", "data", default_text=str(VAL_FRACTION),
        example=VAL_FRACTION, metavar="F")
    transform: Transform | None = option(
        None, "image-folder transforms: none (resize, values in [0, 1]); normalize (resize, then "
        "ImageNet mean/std); standard (training: random resized crop and horizontal flip; evaluation: "
        "resize and center crop; both normalized)", "data", default_text="standard for a folder")
    loader_workers: int | None = option(
        None, "DataLoader processes per training worker decoding a folder or module:callable data "
        "(0: in the training process, in its data phase)", "data",
        default_text=f"{LOADER_WORKERS} for a folder or module:callable", example=LOADER_WORKERS, metavar="N")
    input_shape: str | None = option(None, "CxHxW of synthetic data, or 3xHxW a folder's images are "
                                     "brought to", "data", default_text=f"{SYNTHETIC_SHAPE} for synthetic",
                                     example=SYNTHETIC_SHAPE)
    samples: int | None = option(None, "synthetic samples", "data", default_text=str(SYNTHETIC_SAMPLES),
                                 example=SYNTHETIC_SAMPLES)
    image_size: int | None = option(None, "side a folder's images are brought to (or --input-shape 3xHxW)",
                                    "data", default_text=str(IMAGE_SIZE), example=IMAGE_SIZE)
    prefetch: int = option(10, "batches kept ready ahead of the training step", "data")
    class_split: int = option(0, "deal the classes into N groups (class c to group c mod N); host k's workers "
                              "train only on group k mod N (a label-skewed shard per host; "
                              "runtime/data/class_split.py); 0: no split", "data", metavar="N")
    skip_bad_files: bool = option(False, "a folder --data: skip images that cannot be read (each named "
                                  "in rank 0's log, counted in summary.json) instead of failing",
                                  "data", action="store_true", default_text="fail, naming the file")

    def _check_data(self) -> None:
        _need(self.class_split >= 0, "class-split", self.class_split, "a number of class groups",
              "use e.g. --class-split 2, or 0 for no split")
        _need(self.prefetch >= 1, "prefetch", self.prefetch, "at least 1 batch must be prefetched", "use e.g. --prefetch 10")
        _need(self.samples is None or self.samples >= 2, "samples", self.samples,
              "synthetic data needs at least 2 samples", "use e.g. --samples 1024")
        _need(self.image_size is None or self.image_size >= 1, "image-size", self.image_size, "must be positive",
              "use e.g. --image-size 32")
        _need(self.loader_workers is None or self.loader_workers >= 0, "loader-workers", self.loader_workers,
              "must not be negative", "use e.g. --loader-workers 2, or 0 to decode in the training process")
        _need(self.val_fraction is None or 0 < self.val_fraction < 1, "val-fraction", self.val_fraction,
              "the held-out share must be in (0, 1)", "use e.g. --val-fraction 0.2")
        self._check_model()
        kind = data_kind(self.data)
        self._refuse_unused(kind)
        if kind == "synthetic":
            self.input_shape = self.input_shape or SYNTHETIC_SHAPE
            parse_shape(self.input_shape)
            self.samples = self.samples or SYNTHETIC_SAMPLES
        elif kind == "digits" and self.input_shape is not None and parse_shape(self.input_shape) != (1, 8, 8):
            raise ValueError(f"--input-shape {self.input_shape!r} with --data digits: the digits are 1x8x8; "
                             "leave --input-shape out, or use --data synthetic")
        elif kind == "callable":
            resolve_callable(self.data, "--data")  # importable here, so not only in the workers
            parse_kwargs(self.data_args, "--data-args")
        elif kind == "folder":
            self._settle_folder()
        if kind in ("folder", "callable") and self.loader_workers is None:
            self.loader_workers = LOADER_WORKERS
        if kind in ("digits", "synthetic", "folder") and self.val_data is None:
            self.val_fraction = self.val_fraction or VAL_FRACTION

    def _check_model(self) -> None:
        if is_user_spec(self.model):
            resolve_callable(self.model)  # importable here, so not only in the workers
            parse_kwargs(self.model_args, "--model-args")
        elif self.model not in model_names():
            raise ValueError(f"--model {self.model!r} is unknown; choose one of: {', '.join(model_names())}, "
                             "or module:callable for your own")
        elif self.model_args:
            raise ValueError(f"--model-args {self.model_args!r} with --model {self.model}: a built-in model takes "
                             "no arguments; leave --model-args out, or give --model module:callable")

    def _refuse_unused(self, kind: str) -> None:
        """An option the kind of ``--data`` would ignore is refused (module table)."""
        takes = {"digits": {"val_fraction"}, "synthetic": {"input_shape", "samples", "val_fraction"},
                 "folder": {"image_size", "input_shape", "transform", "val_data", "val_fraction",
                            "loader_workers", "skip_bad_files"},
                 "callable": {"data_args", "val_fraction", "loader_workers"}}[kind]
        if kind == "digits":
            takes = takes | {"input_shape"}  # 1x8x8 only, checked by the caller
        given = {"data_args": self.data_args != "", "val_data": self.val_data is not None,
                 "transform": self.transform is not None, "loader_workers": self.loader_workers is not None,
                 "input_shape": self.input_shape is not None, "samples": self.samples is not None,
                 "image_size": self.image_size is not None, "skip_bad_files": self.skip_bad_files}
        for name, present in given.items():
            if present and name not in takes:
                flag = "--" + name.replace("_", "-")
                value = getattr(self, name)
                shown = "" if isinstance(value, bool) else f" {value!r}"
                raise ValueError(f"{flag}{shown} with --data {self.data}: it applies to "
                                 f"{_applies_to(name)} only, and would be ignored here; leave {flag} out "
                                 "(docs/data.md)")
        if self.val_data is not None and self.val_fraction is not None:
            raise ValueError(f"--val-fraction {self.val_fraction} with --val-data {self.val_data}: the held-out "
                             "images are that folder, nothing is split off; drop one of them")

    def _settle_folder(self) -> None:
        """A folder: it exists; its image size from --image-size or --input-shape (they
        must agree), recorded as ``input_shape = 3xHxW``; its transform; its val folder."""
        if not Path(self.data).is_dir():
            raise ValueError(f"--data {self.data!r}: not 'digits' or 'synthetic', not module:callable, and no "
                             "such folder; give digits, synthetic, module:callable, or a folder with one "
                             "sub-folder of images per class")
        if self.val_data is not None and not Path(self.val_data).is_dir():
            raise ValueError(f"--val-data {self.val_data!r}: no such folder; give a folder with the same class "
                             "sub-folders as --data")
        side = self.image_size
        if self.input_shape is not None:
            channels, height, width = parse_shape(self.input_shape)
            if channels != 3:
                raise ValueError(f"--input-shape {self.input_shape!r} with a folder --data: images are "
                                 f"decoded to RGB, 3 channels; use --input-shape 3x{height}x{width}")
            if side is not None and (height, width) != (side, side):
                raise ValueError(f"--image-size {side} and --input-shape {self.input_shape!r} disagree: "
                                 f"give one of them, e.g. --image-size {height} or --input-shape 3x{side}x{side}")
        else:
            height = width = side or IMAGE_SIZE
        self.input_shape, self.image_size = f"3x{height}x{width}", None
        self.transform = self.transform or "standard"


def _applies_to(name: str) -> str:
    return {"data_args": "--data module:callable", "val_data": "a folder --data",
            "transform": "a folder --data", "loader_workers": "a folder or module:callable --data",
            "input_shape": "--data synthetic or a folder", "samples": "--data synthetic",
            "image_size": "a folder --data", "skip_bad_files": "a folder --data",
            "val_fraction": "data without a separate validation set"}[name]

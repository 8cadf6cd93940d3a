"""Section ``model and data`` of :class:`shmtrain.runtime.config.TrainConfig`: the network
and what it trains on (docs/data.md).

The data options that apply to one kind of data only default to None and are settled
once, by the kind ``--data`` names (:mod:`shmtrain.runtime.data.kinds`: a class per kind,
whose typed ``Config`` holds the options it takes), so ``config.toml`` records what the
run used (a folder's true input shape, synthetic data's sample count), and an option
that the kind would ignore is refused instead:

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

In-memory kinds (digits, synthetic) are batched by slicing tensors in a thread and take
no ``--loader-workers``: no loader process starts for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shmtrain.models import model_names
from shmtrain.models.user import is_user_spec, resolve_callable
from shmtrain.runtime.data.kinds import configure
from shmtrain.runtime.data.kinds.folder import IMAGE_SIZE, LOADER_WORKERS, VAL_FRACTION
from shmtrain.runtime.data.kinds.synthetic import SAMPLES as SYNTHETIC_SAMPLES
from shmtrain.runtime.data.kinds.synthetic import SHAPE as SYNTHETIC_SHAPE
from shmtrain.runtime.options import need as _need
from shmtrain.runtime.options import option
from shmtrain.typed_options import parse_kwargs

Transform = Literal["none", "normalize", "standard"]


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
    eval_samples: int = option(
        50_000, "held-out items each evaluation uses at most (ImageNet's validation set is 50,000): a "
        "fixed subset spread evenly over a larger held-out split (every k-th item; the same at every "
        "evaluation), so a huge lazy data set's evaluation ends; 0: all of them", "data",
        metavar="N")
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
        _need(self.prefetch >= 1, "prefetch", self.prefetch, "at least 1 batch must be prefetched",
              "use e.g. --prefetch 10")
        _need(self.samples is None or self.samples >= 2, "samples", self.samples,
              "synthetic data needs at least 2 samples", "use e.g. --samples 1024")
        _need(self.image_size is None or self.image_size >= 1, "image-size", self.image_size, "must be positive",
              "use e.g. --image-size 32")
        _need(self.loader_workers is None or self.loader_workers >= 0, "loader-workers", self.loader_workers,
              "must not be negative", "use e.g. --loader-workers 2, or 0 to decode in the training process")
        _need(self.eval_samples >= 0, "eval-samples", self.eval_samples, "must not be negative",
              "use e.g. --eval-samples 10000, or 0 to evaluate the whole held-out split")
        _need(self.val_fraction is None or 0 < self.val_fraction < 1, "val-fraction", self.val_fraction,
              "the held-out share must be in (0, 1)", "use e.g. --val-fraction 0.2")
        self._check_model()
        self.data_config = configure(self)

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

"""The resolved configuration of ``shmtrain train``: one route from defaults, TOML, flags.

Precedence: built-in defaults < ``--config FILE.toml`` < command-line flags. TOML keys
are the flags' names (``batch-size`` or ``batch_size``); the chosen strategy's own
options (its ``Config`` fields, e.g. ``moving-rate``) are accepted the same way.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from shmtrain import strategies
from shmtrain.api import make_config
from shmtrain.models import model_names


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything ``shmtrain train`` needs; validated on construction."""

    strategy: str = "ssgd"
    workers: int = 4
    model: str = "smallcnn"
    data: str = "digits"
    input_shape: str = "3x64x64"
    samples: int = 1024
    image_size: int = 32
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    iterations: int | None = None
    epochs: float | None = None
    seed: int = 0
    threads: int = 1
    prefetch: int = 10
    timeout: float = 120.0
    out: str | None = None
    progress: bool = True
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def need(ok: bool, flag: str, value: Any, rule: str, fix: str) -> None:
            if not ok:
                raise ValueError(f"--{flag} {value!r}: {rule}; {fix}")

        need(self.workers >= 1, "workers", self.workers, "at least 1 worker is needed", "use --workers 1 or more")
        need(self.batch_size >= 1, "batch-size", self.batch_size, "the batch size per worker must be positive", "use e.g. --batch-size 32")
        need(self.lr > 0, "lr", self.lr, "the learning rate must be positive", "use e.g. --lr 0.05")
        need(0 <= self.momentum < 1, "momentum", self.momentum, "momentum must be in [0, 1)", "use e.g. --momentum 0.9")
        need(self.weight_decay >= 0, "weight-decay", self.weight_decay, "weight decay must not be negative", "use 0 to turn it off")
        need(self.threads >= 1, "threads", self.threads, "each worker needs at least 1 thread", "use --threads 1")
        need(self.prefetch >= 1, "prefetch", self.prefetch, "at least 1 batch must be prefetched", "use e.g. --prefetch 10")
        need(self.timeout > 0, "timeout", self.timeout, "the peer timeout must be positive", "use e.g. --timeout 120")
        need(self.samples >= 2, "samples", self.samples, "synthetic data needs at least 2 samples", "use e.g. --samples 1024")
        need(self.image_size >= 1, "image-size", self.image_size, "must be positive", "use e.g. --image-size 32")
        need(self.iterations is None or self.iterations >= 1, "iterations", self.iterations, "must be at least 1", "use e.g. --iterations 100")
        need(self.epochs is None or self.epochs > 0, "epochs", self.epochs, "must be positive", "use e.g. --epochs 5")
        if self.iterations is not None and self.epochs is not None:
            raise ValueError(
                f"--iterations {self.iterations} and --epochs {self.epochs} both given; a run "
                "is measured in one of them: drop one"
            )
        if self.model not in model_names():
            raise ValueError(f"--model {self.model!r} is unknown; choose one of: {', '.join(model_names())}")
        if self.data not in ("digits", "synthetic") and not Path(self.data).is_dir():
            raise ValueError(
                f"--data {self.data!r}: not 'digits' or 'synthetic', and no such folder; "
                "give digits, synthetic, or a folder with one sub-folder of images per class"
            )
        cls = strategies.get(self.strategy)
        if cls.world == "one" and self.workers != 1:
            raise ValueError(
                f"--workers {self.workers}: --strategy {self.strategy} runs in one process; "
                "use --workers 1, or --strategy ssgd for several workers"
            )
        cls.check_world(make_config(self.strategy, self.options), self.workers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


COMMON_KEYS = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "options"]


def strategy_option_names() -> dict[str, list[str]]:
    """Option name -> strategies that take it (from every registered Config)."""
    names: dict[str, list[str]] = {}
    for name, cls in strategies.registry().items():
        for f in dataclasses.fields(cls.Config):
            names.setdefault(f.name, []).append(name)
    return names


def read_toml(path: str) -> dict[str, Any]:
    """Read a config file; keys are flag names (dashes or underscores)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path!r}: no such file")
    try:
        raw = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path!r} is not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    known = set(COMMON_KEYS) | set(strategy_option_names())
    for key, value in raw.items():
        if key == "options" and isinstance(value, dict):
            for sub, subvalue in value.items():
                values[sub.replace("-", "_")] = subvalue
            continue
        name = key.replace("-", "_")
        if name not in known:
            choices = ", ".join(sorted(k.replace("_", "-") for k in known))
            raise ValueError(f"--config {path!r}: key {key!r} does not exist; known keys: {choices}")
        values[name] = value
    return values


def resolve(values: dict[str, Any]) -> TrainConfig:
    """Split flat ``values`` into common keys and strategy options; build the config."""
    common = {k: v for k, v in values.items() if k in COMMON_KEYS}
    options = {k: v for k, v in values.items() if k not in COMMON_KEYS}
    return TrainConfig(**common, options=options)


def to_toml(config: TrainConfig) -> str:
    """The resolved config as TOML (flag names as keys), for ``DIR/config.toml``."""
    lines = []
    items = [(k, getattr(config, k)) for k in COMMON_KEYS] + sorted(config.options.items())
    for key, value in items:
        if value is None:
            continue
        lines.append(f"{key.replace('_', '-')} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'

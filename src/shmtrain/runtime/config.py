"""The resolved configuration of ``shmtrain train``: one route from defaults, TOML, flags.

Precedence: built-in defaults < ``--config FILE.toml`` < command-line flags. TOML keys
are the flags' names (``batch-size`` or ``batch_size``); the chosen strategy's own
options (its ``Config`` fields, e.g. ``moving-rate``) are accepted the same way.

:class:`TrainConfig` is declared in sections (:class:`JobOptions`, ``DataOptions``
in ``runtime/data/options.py``, ``OptimOptions`` in ``runtime/train/optim_options.py``); every field carries
``metadata`` with its ``help`` and its
``section``, and ``shmtrain train``'s flags are generated from those fields (one
argument group per section, the type and the choices from the annotation). The chosen
strategy's options are held typed, built once: ``TrainConfig.strategy_config`` is an
instance of the strategy's ``Config`` dataclass, and the whole object is what the
workers receive.

Every value is checked against its annotation (bool, int, float, str, Optional,
Literal) wherever it comes from: a flag (argparse, by the generated ``type``/``choices``),
a TOML key (:func:`read_toml`) or Python (:func:`resolve`, ``TrainConfig(...)``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from shmtrain import strategies
from shmtrain.fabric.job.context import env_int, under_torchrun
from shmtrain.runtime import trusted_files
from shmtrain.runtime.data.kinds import DataConfig
from shmtrain.runtime.data.options import DataOptions
from shmtrain.runtime.options import SECTIONS as SECTIONS  # re-exported: the sections of --help
from shmtrain.runtime.options import need as _need
from shmtrain.runtime.options import option
from shmtrain.runtime.tasks.base import TaskConfig
from shmtrain.runtime.tasks.options import TaskOptions
from shmtrain.runtime.train.device import cuda_count, resolve_device
from shmtrain.runtime.train.optim_options import OptimOptions
from shmtrain.strategies.base import StrategyConfig, build_config, own_config
from shmtrain.strategies.plan import Plan, plan
from shmtrain.typed_options import coerce, hint_kind, type_rule
from shmtrain.typed_options import example as example_value
from shmtrain.typed_options import hints as type_hints


def _strategy_names() -> list[str]:
    return sorted(strategies.registry())


@dataclass(kw_only=True)
class JobOptions:
    """Section ``job``: which strategy, how many workers, where the run goes.

    The sections are mixins of :class:`TrainConfig` and hold no storage of their own
    (``__slots__ = ()``): build a :class:`TrainConfig`, not a section.
    """

    __slots__ = ()

    strategy: str = option("ssgd", "how workers share parameters", "job", names=_strategy_names)
    workers: int = option(4, "local worker processes (ignored under torchrun)", "job")
    threads: int = option(1, "torch threads per worker", "job")
    out: str | None = option(None, "run folder", "job", default_text="runs/<time>-<strategy>",
                             example="runs/my-run")
    timeout: float = option(120.0, "seconds to wait for a peer before failing", "job")
    progress: bool = option(True, "no progress line", "job", flag="--no-progress",
                            action="store_false", default_text="a progress line on stderr")
    verbose: bool = option(False, "also copy every worker's log (RUN_DIR/logs/rank-<r>.log: warnings, "
                           "full tracebacks) to the terminal", "job", action="store_true",
                           default_text="one line per failure; the logs keep the rest")
    device: str = option("auto", "where workers compute: cpu; cuda (worker r on GPU r mod the GPU "
                         "count); cuda:N (every worker on GPU N, sharing it); auto: cuda where a GPU is "
                         "present, else cpu. The shared buffers stay in host memory (docs/gpu.md)",
                         "job", metavar="{cpu,cuda,cuda:N,auto}")
    force: bool = option(False, "start even when the pre-flight estimates refuse (workers per "
                         "core, memory needed vs free)", "job", action="store_true",
                         default_text="off")
    # checkpoints and restarts (runtime/checkpoint/checkpointer.py; README "Long runs")
    checkpoint_every: int | None = option(
        None, "write RUN_DIR/checkpoints/step-<N>/ every N iterations (0: only at the end and "
        "when stopped)", "job", default_text="every epoch, and at the end", example=100, metavar="N")
    keep_checkpoints: int = option(2, "complete checkpoints kept, the newest (0 keeps every one)", "job",
                                   metavar="K")
    max_restarts: int = option(
        0, "when a worker dies, replace it in place (on CPU: ssgd, --overlap, --sharded-update, gpi, "
        "cpu_acc, ps_grad, diloco --inner host-sync, seasgd, easgd, downpour, hsgd; the others never "
        "exit, and the synchronous ones end with the weights of a run never killed) or restart every "
        "worker from the latest checkpoint, up to R times in all (local launches; under torchrun use "
        "torchrun's own --max-restarts)", "job", metavar="R")

    def _check_job(self) -> None:
        _need(self.workers >= 1, "workers", self.workers, "at least 1 worker is needed", "use --workers 1 or more")
        _need(self.threads >= 1, "threads", self.threads, "each worker needs at least 1 thread", "use --threads 1")
        _need(self.timeout > 0, "timeout", self.timeout, "the peer timeout must be positive", "use e.g. --timeout 120")
        _need(self.checkpoint_every is None or self.checkpoint_every >= 0, "checkpoint-every",
              self.checkpoint_every, "must not be negative", "use e.g. --checkpoint-every 100, or 0 for the end only")
        _need(self.keep_checkpoints >= 0, "keep-checkpoints", self.keep_checkpoints, "must not be negative",
              "use e.g. --keep-checkpoints 2, or 0 to keep every one")
        _need(self.max_restarts >= 0, "max-restarts", self.max_restarts, "must not be negative",
              "use e.g. --max-restarts 3, or 0 to fail at the first death")
        self.device = resolve_device(self.device)


@dataclass(kw_only=True)
class MonitorOptions:
    """Section ``evaluation and monitoring``: held-out evaluation, TensorBoard, timeline
    (a mixin, see :class:`JobOptions`)."""

    __slots__ = ()

    eval_every: int | None = option(
        None, "held-out loss and accuracy on rank 0 every N iterations, a row in "
        "metrics/rank-0.jsonl (0: only the final accuracy)", "monitor",
        default_text="each epoch", example=100)
    tensorboard: bool = option(
        False, "rank 0 writes loss, accuracy, lr and ms per phase to RUN_DIR/tensorboard/ "
        "(tensorboard --logdir RUN_DIR/tensorboard; needs pip install 'shmtrain[tensorboard]')",
        "monitor", default_text="off")
    trace: bool = option(
        False, "write RUN_DIR/trace.json: every rank's phases per iteration on a timeline "
        "(open in ui.perfetto.dev or chrome://tracing)", "monitor", default_text="off")

    keep_best: str | None = option(
        None, "keep the model of the best held-out evaluation as RUN_DIR/best.pt (best.json: its iteration "
        "and metrics); METRIC is one the task reports: loss, accuracy (classification), rmse (regression), "
        "perplexity (language-model)", "monitor", default_text="off", example="loss", metavar="METRIC")
    early_stop: str | None = option(
        None, "stop every worker (with a checkpoint) once METRIC has not improved for PATIENCE held-out "
        "evaluations in a row; the run counts as finished", "monitor", default_text="off",
        example="loss:3", metavar="METRIC:PATIENCE")

    def _check_selection(self, task_name: str, metrics: tuple[str, ...]) -> None:
        """``--keep-best`` and ``--early-stop`` name a metric of the task, and the run evaluates."""
        from shmtrain.runtime.outputs.selection import parse_early_stop

        for flag, text in (("keep-best", self.keep_best), ("early-stop", self.early_stop)):
            if text is None:
                continue
            metric = parse_early_stop(text)[0] if flag == "early-stop" else text
            _need(metric in metrics, flag, text, f"--task {task_name} reports {', '.join(metrics)}",
                  f"name one of them, e.g. --{flag} {metrics[-1]}{':3' if flag == 'early-stop' else ''}")
            _need(self.eval_every != 0, flag, text, "it compares held-out evaluations, and --eval-every 0 "
                  "makes none during the run", "drop --eval-every 0, or give e.g. --eval-every 100")

    def _check_monitor(self) -> None:
        _need(self.eval_every is None or self.eval_every >= 0, "eval-every", self.eval_every,
              "must not be negative", "use e.g. --eval-every 100, or 0 for the final accuracy only")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError(
                "--tensorboard: the tensorboard package is not installed; install the extra with "
                "pip install 'shmtrain[tensorboard]', or leave --tensorboard out"
            )


@dataclass(kw_only=True, slots=True)
class TrainConfig(MonitorOptions, OptimOptions, TaskOptions, DataOptions, JobOptions):
    """Everything ``shmtrain train`` needs; validated on construction.

    Attributes are flat (``config.batch_size``, ``config.workers``); ``strategy_config``
    is the chosen strategy's typed ``Config`` (left out, the strategy's defaults), and
    ``data_config`` the data kind's, built from the flat data options, and ``task_config``
    the task's (built from ``--task`` and ``--task-args``, ``runtime/tasks/``). Build one
    from flat keys (common and strategy options mixed) with :func:`resolve`.
    """

    strategy_config: StrategyConfig = field(default_factory=StrategyConfig)
    task_config: TaskConfig = field(default_factory=TaskConfig)
    #: the data kind's typed ``Config`` (:mod:`shmtrain.runtime.data.kinds`), built from
    #: the flat data options on construction, as ``strategy_config`` is from the strategy's
    data_config: DataConfig = field(init=False, repr=False)
    #: the strategy checked for this job (:func:`shmtrain.strategies.plan.plan`): the
    #: workers build it from this plan and check nothing again
    plan: Plan = field(init=False, repr=False, compare=False)
    #: the options the user gave (flag names with underscores; :func:`resolve` fills it), so
    #: the run's setting may choose the others (``runtime/defaults.py``)
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    #: the defaults the setting chose, each ``{"option", "value", "why"}`` (``runtime/defaults.py``)
    defaults_taken: tuple[dict[str, Any], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        hints = type_hints(TrainConfig)
        for f in train_fields():
            value = getattr(self, f.name)
            _check_flag_value(f, hints[f.name], value)
            setattr(self, f.name, coerce(hints[f.name], value))
        self._check_job()
        self._check_data()
        task = self._check_task(self.data)
        self.task_config = task.config
        self._check_selection(self.task, task.metric_names)
        self._check_optim()
        self._check_monitor()
        cls = strategies.get(self.strategy)
        self.strategy_config = own_config(self.strategy, self.strategy_config)
        config_hints = type_hints(cls.Config)
        for f in dataclasses.fields(cls.Config):
            _check_flag_value(f, config_hints[f.name], getattr(self.strategy_config, f.name))
        self.plan = plan(self.strategy, self.strategy_config, *job_shape(self.workers),
                         optimizer=self.optimizer, grad_clip=self.grad_clip)
        impl = self.plan.strategy
        if self.amp == "fp16":  # the strategy's update must go through a GradScaler
            impl.check_fp16(self.strategy_config)
        self._place(impl, self.plan.label)

    def _place(self, impl: type[strategies.Strategy], label: str) -> None:
        """Settle ``--device`` against what runs where: the strategy's implementation
        answers with its ``devices``; ``--sub-batch`` (the runtime's threads) is CPU-only."""
        cpu_only = [f"--sub-batch {self.sub_batch}"] if self.sub_batch != 1 else []
        if "cuda" not in impl.devices:
            cpu_only.append(label)
        if cpu_only and self.device == "auto":  # auto: a GPU only where the options run there
            self.device = "cpu"
        elif cpu_only and self.device != "cpu":
            raise ValueError(f"--device {self.device} with {cpu_only[0]}: it runs on the CPU only "
                             "(docs/gpu.md); use --device cpu, or drop it")
        if "cpu" not in impl.devices and (self.device == "cpu" or (self.device == "auto" and not cuda_count())):
            found = "--device is cpu" if self.device == "cpu" else "--device auto found no GPU here"
            raise ValueError(f"{label} {impl.device_rule}, but {found}; {impl.device_fix}")

    def to_dict(self) -> dict[str, Any]:
        """Flat: every common key and the strategy's options (the keys of ``config.toml``);
        ``resolve(config.to_dict()) == config``."""
        return {**{k: getattr(self, k) for k in COMMON_KEYS}, **dataclasses.asdict(self.strategy_config)}


def job_shape(workers: int) -> tuple[int, int]:
    """The workers and hosts a run's strategy is checked for: ``--workers`` on one host,
    or the job torchrun started this process in (``WORLD_SIZE`` over ``LOCAL_WORLD_SIZE``
    hosts), which is the job the strategy will run in."""
    if not under_torchrun():
        return workers, 1
    world = env_int("WORLD_SIZE", workers)
    local = env_int("LOCAL_WORLD_SIZE", world)
    return world, max(world // max(local, 1), 1)


def train_fields() -> list[dataclasses.Field]:
    """The fields of :class:`TrainConfig` that are flags and TOML keys (those with a section)."""
    return [f for f in dataclasses.fields(TrainConfig) if "section" in f.metadata]


COMMON_KEYS = [f.name for f in train_fields()]


def strategy_option_names() -> dict[str, list[str]]:
    """Option name -> strategies that take it (from every registered Config)."""
    names: dict[str, list[str]] = {}
    for name, cls in strategies.registry().items():
        for f in dataclasses.fields(cls.Config):
            names.setdefault(f.name, []).append(name)
    return names


def read_toml(path: str, what: str = "--config") -> dict[str, Any]:
    """Read a config file; keys are flag names (dashes or underscores).

    Each value's type is checked against the annotation of its field (a strategy option
    against every strategy that takes it); an ``[options]`` table of strategy options is
    accepted too. Returns flat keys with underscores, ready for :func:`resolve`.

    The file is read only when it is trusted (:mod:`shmtrain.runtime.trusted_files`: this
    user's, or listed in ``SHMTRAIN_TRUSTED``), since its ``module:callable`` values are
    imported and called; ``what`` names it in the refusal.
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file")
    data = trusted_files.read_bytes(file, what)
    try:
        raw = tomllib.loads(data.decode())
    except UnicodeDecodeError as exc:
        raise ValueError(f"--config {path} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); "
                         "TOML files are UTF-8: give the TOML file of the run's options") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path} is not valid TOML: {exc}") from None
    specs = _key_specs()
    option_names = set(strategy_option_names())
    values: dict[str, Any] = {}

    def take(key: str, value: Any, allowed: set[str]) -> None:
        name = key.replace("-", "_")
        if name not in allowed:
            choices = ", ".join(sorted(k.replace("_", "-") for k in allowed))
            raise ValueError(f"--config {path}: key {key!r} does not exist; known keys: {choices}")
        rules = [(rule, f) for f, hint in specs[name] if (rule := type_rule(hint, value)) is not None]
        if len(rules) == len(specs[name]):
            rule, f = rules[0]
            sample = _toml_value(example_value(f, specs[name][0][1]))
            raise ValueError(f"--config {path}: key {key!r} = {value!r} {rule}; e.g. {key} = {sample}")
        values[name] = value

    for key, value in raw.items():
        if key == "options" and isinstance(value, dict):
            for sub, subvalue in value.items():
                take(sub, subvalue, option_names)
        else:
            take(key, value, set(specs))
    return values


def resolve(values: Mapping[str, Any]) -> TrainConfig:
    """Split flat ``values`` into common keys and strategy options; build the config.

    The strategy's ``Config`` is built here, once, from the options (its type-checked
    fields; an option the strategy does not take is an error naming what it takes).
    """
    common = {k: v for k, v in values.items() if k in COMMON_KEYS}
    options = {k: v for k, v in values.items() if k not in COMMON_KEYS}
    strategy = common.get("strategy", TrainConfig.__dataclass_fields__["strategy"].default)
    if not isinstance(strategy, str):
        raise ValueError(f"--strategy {strategy!r}: must be a string; use e.g. --strategy ssgd")
    cls = strategies.get(strategy)
    hints = type_hints(cls.Config)
    for f in dataclasses.fields(cls.Config):
        if f.name in options:
            _check_flag_value(f, hints[f.name], options[f.name])
            options[f.name] = coerce(hints[f.name], options[f.name])
    config = TrainConfig(**common, strategy_config=build_config(strategy, options))
    config.given = frozenset(values)
    return config


def to_toml(config: TrainConfig) -> str:
    """The resolved config as TOML (flag names as keys), for ``DIR/config.toml``.

    Common keys first, then every option of the strategy's typed config; a ``None``
    value (TOML has no null) is written as a comment saying what it means (the flag's
    default text, e.g. ``# checkpoint-every: every epoch, and at the end``), so every
    default is in the file; data options the kind of ``--data`` does not take are left out.
    """
    lines = []
    options = sorted(dataclasses.asdict(config.strategy_config).items())
    fields = {f.name: f for f in train_fields()}
    for key in COMMON_KEYS:
        value = getattr(config, key)
        if value is not None:
            lines.append(f"{key.replace('_', '-')} = {_toml_value(value)}")
        elif fields[key].metadata["section"] != "data":  # a data option unset is one the data does not take
            meaning = fields[key].metadata.get("default_text", "not set")
            lines.append(f"# {key.replace('_', '-')}: {meaning} (default)")
    if options:
        lines.append(f"# options of --strategy {config.strategy}")
    unset = {f.name: f for f in dataclasses.fields(config.strategy_config)}
    for key, value in options:
        if value is not None:
            lines.append(f"{key.replace('_', '-')} = {_toml_value(value)}")
        else:
            lines.append(f"# {key.replace('_', '-')}: {_unset_option(config, unset[key])} (default)")
    if config.defaults_taken:
        lines.append("# defaults this run's setting chose (docs/choosing_a_method.md, \"Defaults by setting\"):")
        lines += [f"#   {t['option']} = {_toml_value(t['value'])}: {t['why']}" for t in config.defaults_taken]
    return "\n".join(lines) + "\n"


def _unset_option(config: TrainConfig, f: dataclasses.Field) -> str:
    """What a strategy option left unset (None) means in this run: its ``default_text``, a
    string or a function of the run's optimizer (its class and keywords, e.g. diloco's
    outer step derived from it)."""
    text = f.metadata.get("default_text", "not given") if f.metadata else "not given"
    if callable(text):
        from shmtrain.runtime.train.optimizers import optimizer_class, optimizer_kwargs

        kwargs = optimizer_kwargs(config.optimizer, config.optimizer_args, config.lr, config.momentum,
                                  config.weight_decay)
        text = text(optimizer_class(config.optimizer), kwargs)
    return text


def _key_specs() -> dict[str, list[tuple[dataclasses.Field, Any]]]:
    """TOML key -> the (field, annotation) pairs that may take it (common keys have one;
    a strategy option has one per strategy that takes it)."""
    specs: dict[str, list[tuple[dataclasses.Field, Any]]] = {}
    hints = type_hints(TrainConfig)
    for f in train_fields():
        specs[f.name] = [(f, hints[f.name])]
    for _, cls in sorted(strategies.registry().items()):
        config_hints = type_hints(cls.Config)
        for f in dataclasses.fields(cls.Config):
            specs.setdefault(f.name, []).append((f, config_hints[f.name]))
    return specs


def _check_flag_value(f: dataclasses.Field, hint: Any, value: Any) -> None:
    """Reject a value of the wrong type, in the style of the flag's other errors."""
    rule = type_rule(hint, value)
    if rule is None:
        return
    if "action" in f.metadata:  # a flag such as --no-progress takes no value: name the field
        raise ValueError(f"{f.name} = {value!r}: {rule}; use {f.name} = {example_value(f, hint)!r}")
    flag = "--" + f.name.replace("_", "-")
    if hint_kind(hint)[0] is bool:
        raise ValueError(f"{flag} {value!r}: {rule}; give True or False")
    raise ValueError(f"{flag} {value!r}: {rule}; use e.g. {flag} {example_value(f, hint)}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    # JSON strings are TOML basic strings, but for DEL, which TOML wants escaped
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


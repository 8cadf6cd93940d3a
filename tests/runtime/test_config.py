"""``TrainConfig``: typed fields in sections, typed strategy options, TOML and flags checked
the same way, the round trip through ``config.toml`` (no worker is started here)."""

from __future__ import annotations

import dataclasses
import pickle
import re
import typing
from pathlib import Path

import pytest

from shmtrain import strategies
from shmtrain.cli import build_parser, main
from shmtrain.runtime.config import (
    COMMON_KEYS,
    SECTIONS,
    TrainConfig,
    read_toml,
    resolve,
    to_toml,
    train_fields,
)
from shmtrain.strategies.base import StrategyConfig, build_config


def toml_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def world(name: str) -> int:
    return 1 if strategies.get(name).world == "one" else 2


# -- typed choices --------------------------------------------------------------------
@pytest.mark.parametrize(
    "flag,choice",
    [("--allreduce", "ring"), ("--ps-transport", "gloo"), ("--terminate", "master")],
)
def test_a_bad_choice_is_an_argparse_error_listing_the_choices(flag: str, choice: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", flag, "bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "bogus" in err and "invalid choice" in err and choice in err


def test_choices_are_the_literals_of_the_strategy_configs() -> None:
    from shmtrain.fabric.allreduce.collectives.reducers import CHOICES
    from shmtrain.strategies.elastic.termination import POLICIES
    from shmtrain.strategies.parts import PS_TRANSPORTS

    def literal(cls: type, name: str) -> tuple:
        return typing.get_args(typing.get_type_hints(cls)[name])

    assert literal(strategies.get("ssgd").Config, "allreduce") == (*CHOICES, "nccl")  # nccl: GPUs only
    assert literal(strategies.get("ps_grad").Config, "ps_transport") == PS_TRANSPORTS
    assert literal(strategies.get("seasgd").Config, "terminate") == POLICIES


def test_a_bad_choice_from_python_names_option_value_and_choices() -> None:
    with pytest.raises(ValueError, match=r"--allreduce 'bogus': must be one of: shm, gloo, ring"):
        resolve({"allreduce": "bogus"})
    with pytest.raises(ValueError, match=r"--terminate 'never': must be one of: master, first, average"):
        resolve({"strategy": "seasgd", "workers": 2, "terminate": "never"})


# -- TOML values are checked against the annotations -----------------------------------
@pytest.mark.parametrize(
    "line,message",
    [
        ('workers = "four"', "key 'workers' = 'four' must be an integer; e.g. workers = 4"),
        ('batch-size = 1.5', "key 'batch-size' = 1.5 must be an integer; e.g. batch-size = 32"),
        ('lr = "fast"', "key 'lr' = 'fast' must be a number; e.g. lr = 0.05"),
        ('progress = "yes"', "key 'progress' = 'yes' must be true or false; e.g. progress = true"),
        ("model = 3", 'key \'model\' = 3 must be a string; e.g. model = "smallcnn"'),
        ('iterations = "ten"', "key 'iterations' = 'ten' must be an integer; e.g. iterations = 100"),
        ('allreduce = "bogus"', "key 'allreduce' = 'bogus' must be one of: shm, gloo, ring, rhd, "
                                'tree, topo, hierarchical, auto, nccl; e.g. allreduce = "shm"'),
        ('terminate = "never"', "key 'terminate' = 'never' must be one of: master, first, average; "
                                'e.g. terminate = "average"'),
        ("overlap = 1", "key 'overlap' = 1 must be true or false; e.g. overlap = false"),
        ("update-interval = 1.5", "key 'update-interval' = 1.5 must be an integer; e.g. update-interval = 1"),
        ('[options]\nmoving-rate = "x"', "key 'moving-rate' = 'x' must be a number; e.g. moving-rate = 0.2"),
    ],
)
def test_a_toml_value_of_the_wrong_type_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = toml_file(tmp_path, line + "\n")
    with pytest.raises(ValueError) as exc:
        read_toml(path)
    assert str(exc.value) == f"--config {path}: {message}"


def test_a_toml_type_error_through_the_cli_is_a_message_not_a_traceback(tmp_path: Path, capsys) -> None:
    path = toml_file(tmp_path, 'workers = "four"\n')
    assert main(["train", "--config", path]) == 2
    err = capsys.readouterr().err
    assert f"--config {path}: key 'workers' = 'four' must be an integer; e.g. workers = 4" in err
    assert "Traceback" not in err


def test_an_int_for_a_float_is_fine_and_becomes_a_float(tmp_path: Path) -> None:
    config = resolve(read_toml(toml_file(tmp_path, "lr = 1\nmoving-rate = 1\nstrategy = 'seasgd'\n")))
    assert config.lr == 1.0 and isinstance(config.lr, float)
    assert isinstance(config.strategy_config.moving_rate, float)


def test_an_options_table_and_an_unknown_key(tmp_path: Path) -> None:
    values = read_toml(toml_file(tmp_path, 'strategy = "ssgd"\n[options]\nbucket-mb = 4\n'))
    assert values == {"strategy": "ssgd", "bucket_mb": 4}
    with pytest.raises(ValueError, match="key 'batchsize' does not exist; known keys: .*batch-size"):
        read_toml(toml_file(tmp_path, "batchsize = 4\n"))
    with pytest.raises(ValueError, match="key 'lr' does not exist"):
        read_toml(toml_file(tmp_path, "[options]\nlr = 4\n"))  # [options] holds strategy options


def test_python_values_of_the_wrong_type_are_named() -> None:
    with pytest.raises(ValueError, match=r"^--workers 'four': must be an integer; use e.g. --workers 4$"):
        TrainConfig(workers="four")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^--overlap 'yes': must be true or false"):
        resolve({"overlap": "yes"})


# -- --help and the generated flags ---------------------------------------------------
def train_help() -> str:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["train"].format_help()


def help_entries(text: str) -> dict[str, str]:
    """First flag of each option line in ``--help`` -> its help, whitespace joined."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^  (--?[\w-]+)", line)
        if match:
            current = match.group(1)
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line
        else:
            current = None
    return {flag: " ".join(entry.split()) for flag, entry in entries.items()}


def test_help_lists_every_field_with_its_default() -> None:
    text = train_help()
    entries = help_entries(text)
    for f in train_fields():
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        assert flag in entries, flag
        default = f.metadata.get("default_text", f.default)
        assert f"(default {default})" in entries[flag], (flag, entries[flag])
    assert "(default none)" in entries["--config"]
    for title in SECTIONS.values():
        assert f"\n{title}:\n" in text
    assert "--allreduce {shm,gloo,ring,rhd,tree,topo,hierarchical,auto,nccl}" in text


def test_flags_are_typed_from_the_annotations() -> None:
    args = build_parser().parse_args(
        ["train", "--workers", "3", "--lr", "0.5", "--no-progress", "--iterations", "7",
         "--allreduce", "ring", "--bucket-mb", "2"]
    )
    values = {k: v for k, v in vars(args).items() if k not in ("handler", "command")}
    assert values == {"workers": 3, "lr": 0.5, "progress": False, "iterations": 7,
                      "allreduce": "ring", "bucket_mb": 2.0}
    config = resolve(values)
    assert config.strategy_config == strategies.get("ssgd").Config(allreduce="ring", bucket_mb=2.0)


# -- device ---------------------------------------------------------------------------
def test_device_is_checked_naming_what_was_found(capsys) -> None:
    import torch

    from shmtrain.runtime.train.device import worker_device

    assert TrainConfig().device == "auto"  # each worker resolves it: a GPU where there is one
    assert TrainConfig(device="cpu").device == "cpu"
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert worker_device("auto", 3) == (torch.device("cuda", 3 % found) if found else torch.device("cpu"))
    assert worker_device("cpu", 0) == torch.device("cpu")
    with pytest.raises(ValueError) as exc:
        TrainConfig(device=f"cuda:{max(found, 1)}")
    # what was found, the rule, the fix
    if not found:
        assert str(exc.value).startswith("--device 'cuda:1': this machine has no CUDA device")
        assert str(exc.value).endswith("use --device cpu, or auto (the GPU when there is one)")
        assert main(["train", "--device", "cuda"]) == 2
        assert "use --device cpu, or auto" in capsys.readouterr().err
    else:
        assert f"there are {found} CUDA device(s) here, numbered 0 to {found - 1}" in str(exc.value)
    with pytest.raises(ValueError, match="--device 'cuda:x': the GPU index must be a number"):
        TrainConfig(device="cuda:x")
    with pytest.raises(ValueError, match="--device 'tpu' is not a device; choose cpu, cuda, cuda:N or auto"):
        TrainConfig(device="tpu")


def test_options_the_device_or_fp16_cannot_take_are_refused() -> None:
    with pytest.raises(ValueError,
                       match=r"--allreduce nccl reduces GPU tensors, but --device is cpu; use --device cuda"):
        TrainConfig(device="cpu", strategy_config=build_config("ssgd", {"allreduce": "nccl"}))
    with pytest.raises(ValueError, match=r"--allreduce nccl with --overlap: the NCCL baseline"):
        build_config("ssgd", {"allreduce": "nccl", "overlap": True})
    with pytest.raises(ValueError, match=r"--amp fp16 with --strategy gpi: the root updates layer by layer"):
        TrainConfig(strategy="gpi", amp="fp16")
    with pytest.raises(ValueError, match=r"--amp fp16 with --strategy ssgd: the sharded update"):
        TrainConfig(amp="fp16", strategy_config=build_config("ssgd", {"sharded_update": True}))
    with pytest.raises(ValueError, match=r"--amp 'fp16': the --sub-batch threads run bf16 or float32 only"):
        TrainConfig(amp="fp16", sub_batch=2)
    assert TrainConfig(amp="fp16").amp == "fp16"  # ssgd takes a GradScaler


# -- the typed strategy config ----------------------------------------------------------
@pytest.mark.parametrize("name", sorted(strategies.registry()))
def test_strategy_config_is_the_strategys_own_config(name: str) -> None:
    config = resolve({"strategy": name, "workers": world(name)})
    assert type(config.strategy_config) is strategies.get(name).Config
    assert config.strategy_config == build_config(name, {})
    assert TrainConfig(strategy=name, workers=world(name)).strategy_config == config.strategy_config


def test_a_config_of_another_strategy_is_refused() -> None:
    with pytest.raises(ValueError, match="not the Config of --strategy ssgd"):
        TrainConfig(strategy="ssgd", strategy_config=build_config("ps_grad", {}))


def test_an_option_of_another_strategy_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--moving-rate does not apply to --strategy ssgd \(it takes "):
        resolve({"moving_rate": 0.5})


def test_make_config_is_build_config() -> None:
    from shmtrain.parallel.data_parallel import make_config

    assert make_config is build_config
    assert isinstance(build_config("single", {}), StrategyConfig)


def test_no_strategy_option_shadows_a_common_key() -> None:
    for cls in strategies.registry().values():
        assert not {f.name for f in dataclasses.fields(cls.Config)} & set(COMMON_KEYS), cls


# -- the round trip and the payload ---------------------------------------------------
ROUND_TRIP = [
    {},
    {"strategy": "single", "workers": 1, "iterations": 3, "out": 'runs/a "quoted" \\ path', "lr": 0.5},
    {"strategy": "ssgd", "allreduce": "ring", "overlap": False, "bucket_mb": 4.0, "epochs": 2.5},
    {"strategy": "hsgd", "groups": 2, "moving_rate": 0.5, "terminate": "first", "progress": False},
    {"strategy": "ps_weight", "average_interval": 3, "ps_transport": "gloo", "device": "auto"},
]


@pytest.mark.parametrize("values", ROUND_TRIP)
def test_to_toml_read_toml_resolve_round_trip(tmp_path: Path, values: dict) -> None:
    config = resolve(values)
    again = resolve(read_toml(toml_file(tmp_path, to_toml(config))))
    assert again == config
    assert type(again.strategy_config) is type(config.strategy_config)
    assert resolve(config.to_dict()) == config


def test_to_dict_is_flat_with_the_keys_of_config_toml() -> None:
    config = resolve({"strategy": "seasgd", "update_interval": 2})
    flat = config.to_dict()
    assert list(flat)[: len(COMMON_KEYS)] == COMMON_KEYS
    assert flat["update_interval"] == 2 and flat["strategy"] == "seasgd"
    assert "strategy_config" not in flat and "options" not in flat
    assert {k: flat[k] for k in ("update_interval", "terminate")} == {"update_interval": 2, "terminate": "average"}


def test_the_worker_payload_pickles_typed() -> None:
    config = resolve({"strategy": "ssgd", "allreduce": "tree", "workers": 3})
    again = pickle.loads(pickle.dumps({"config": config, "out": "x"}))["config"]
    assert again == config and type(again.strategy_config) is strategies.get("ssgd").Config


def test_flat_attribute_access_and_no_typos() -> None:
    config = TrainConfig(batch_size=8, workers=2)
    assert (config.batch_size, config.workers, config.seed, config.device) == (8, 2, 0, "auto")
    with pytest.raises(AttributeError):
        config.batchsize = 3  # type: ignore[attr-defined]


def test_config_toml_holds_every_default() -> None:
    """The momentum a run uses is written (0.9 with sgd), and an option left unset is a
    comment saying what it means."""
    from shmtrain.runtime.config import resolve, to_toml

    text = to_toml(resolve({}))
    assert "momentum = 0.9\n" in text and 'task = "classification"\n' in text
    assert "# checkpoint-every: every epoch, and at the end (default)\n" in text
    assert "# grad-clip: no clipping (default)\n" in text
    assert "momentum" not in to_toml(resolve({"optimizer": "adamw"})).replace("# momentum", "")

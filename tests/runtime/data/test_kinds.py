"""Kinds of ``--data`` are classes in one registry (``runtime/data/kinds/``): a new kind is
one class plus one entry of ``KINDS``, and the options it takes are its Config's fields."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from shmtrain.registry import Registry
from shmtrain.runtime.config import resolve
from shmtrain.runtime.data import kinds
from shmtrain.runtime.data.kinds.base import DataConfig, DataFacts, DataKind, config_of
from shmtrain.runtime.data.sources import from_tensors, open_data
from shmtrain.runtime.data.tensors import Dataset
from shmtrain.runtime.launch.preflight import check_data


class Ramp(DataKind):
    """A kind written as a newcomer would: inputs i/n, label i mod 2."""

    label = "--data ramp"

    @dataclass(kw_only=True, slots=True)
    class Config(DataConfig):
        samples: int = 40

        def build(self) -> Any:
            x = torch.arange(self.samples, dtype=torch.float32).reshape(-1, 1, 1, 1) / self.samples
            y = torch.arange(self.samples) % 2
            cut = self.samples // 4
            data = Dataset("ramp", x[cut:], y[cut:], x[:cut], y[:cut], 2, (1, 1, 1))
            return from_tensors(data, {"even": 0, "odd": 1})

    @classmethod
    def matches(cls, data: str) -> bool:
        return data == "ramp"

    @classmethod
    def configure(cls, options: Any) -> DataConfig:
        options.samples = options.samples or 40
        return config_of(cls, options)


@pytest.fixture
def with_ramp(monkeypatch):
    ramp_first = Registry("data kind", "--data")
    for kind in (Ramp, *kinds.KINDS.items().values()):
        ramp_first.add(kind.__name__, kind)
    monkeypatch.setattr(kinds, "KINDS", ramp_first)


def test_a_new_kind_is_one_class_and_one_registry_entry(with_ramp):
    config = resolve({"data": "ramp", "samples": 48, "model": "mlp", "batch_size": 4})
    assert config.data_config == Ramp.Config(data="ramp", samples=48)
    source = open_data(config)
    assert (source.train_samples, source.val_samples, source.num_classes) == (36, 12, 2)
    assert check_data(config) == DataFacts(36, (1, 1, 1), 2, in_memory=True)


def test_an_option_the_kind_does_not_take_is_refused_naming_who_takes_it(with_ramp):
    with pytest.raises(ValueError, match=r"--input-shape '3x8x8' with --data ramp: it applies to "
                                         r".*--data synthetic.* only"):
        resolve({"data": "ramp", "input_shape": "3x8x8"})
    # and the new kind's own option is named where another kind refuses it
    with pytest.raises(ValueError, match=r"--samples 9 with --data digits: it applies to "
                                         r"--data ramp or --data synthetic only"):
        resolve({"data": "digits", "samples": 9})


def test_every_built_in_kind_settles_its_defaults_into_the_flat_options(tmp_path: Path):
    digits = resolve({})
    assert type(digits.data_config) is kinds.Digits.Config and digits.loader_workers is None
    synthetic = resolve({"data": "synthetic"})
    assert (synthetic.input_shape, synthetic.samples) == ("3x64x64", 1024)
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
    folder = resolve({"data": str(tmp_path), "image_size": 16})
    assert (folder.input_shape, folder.image_size, folder.loader_workers, folder.transform) == \
        ("3x16x16", None, 2, "standard")
    assert kinds.kind_of(str(tmp_path)).torchvision and not kinds.kind_of("digits").torchvision


def test_in_memory_kinds_refuse_loader_processes():
    """Digits and synthetic are sliced from tensors in a thread: no loader process starts."""
    with pytest.raises(ValueError, match="--loader-workers 2 with --data digits"):
        resolve({"loader_workers": 2})

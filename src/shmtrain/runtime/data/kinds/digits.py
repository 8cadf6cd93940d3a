"""``--data digits``: scikit-learn's 8x8 handwritten digits (1797 images, 10 classes),
held in memory as tensors (``runtime/data/tensors.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shmtrain.runtime.data.kinds.base import DataConfig, DataKind, config_of
from shmtrain.runtime.data.sources import DataFacts
from shmtrain.runtime.data.tensors import held_out, parse_shape

SAMPLES, SHAPE = 1797, (1, 8, 8)
VAL_FRACTION = 0.2


class Digits(DataKind):
    label = "--data digits"

    @dataclass(kw_only=True, slots=True)
    class Config(DataConfig):
        val_fraction: float = VAL_FRACTION
        #: always 1x8x8; taken so that ``--input-shape 1x8x8`` is accepted
        input_shape: str | None = None

        def build(self) -> Any:
            from shmtrain.runtime.data.sources import from_tensors
            from shmtrain.runtime.data.tensors import load_digits_data

            data = load_digits_data(self.val_fraction)
            return from_tensors(data, {str(d): d for d in range(10)})

        def facts(self) -> DataFacts:
            return DataFacts(SAMPLES - held_out(SAMPLES, self.val_fraction), SHAPE, 10)

    @classmethod
    def matches(cls, data: str) -> bool:
        return data == "digits"

    @classmethod
    def configure(cls, options: Any) -> DataConfig:
        if options.input_shape is not None and parse_shape(options.input_shape) != SHAPE:
            raise ValueError(f"--input-shape {options.input_shape!r} with --data digits: the digits are 1x8x8; "
                             "leave --input-shape out, or use --data synthetic")
        options.val_fraction = options.val_fraction or VAL_FRACTION
        return config_of(cls, options)

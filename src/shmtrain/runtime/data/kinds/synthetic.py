"""``--data synthetic``: random tensors of ``--input-shape`` whose labels a model can
learn (``runtime/data/tensors.py``), held in memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shmtrain.runtime.data.kinds.base import DataConfig, DataKind, config_of
from shmtrain.runtime.data.sources import DataFacts
from shmtrain.runtime.data.tensors import held_out, parse_shape

SHAPE, SAMPLES, VAL_FRACTION = "3x64x64", 1024, 0.2


class Synthetic(DataKind):
    label = "--data synthetic"

    @dataclass(kw_only=True, slots=True)
    class Config(DataConfig):
        input_shape: str = SHAPE
        samples: int = SAMPLES
        val_fraction: float = VAL_FRACTION

        def build(self) -> Any:
            from shmtrain.runtime.data.sources import from_tensors
            from shmtrain.runtime.data.tensors import load_synthetic

            data = load_synthetic(parse_shape(self.input_shape), self.samples, fraction=self.val_fraction)
            return from_tensors(data, {str(i): i for i in range(data.num_classes)})

        def facts(self) -> DataFacts:
            return DataFacts(self.samples - held_out(self.samples, self.val_fraction),
                             parse_shape(self.input_shape), 10)

    @classmethod
    def matches(cls, data: str) -> bool:
        return data == "synthetic"

    @classmethod
    def configure(cls, options: Any) -> DataConfig:
        options.input_shape = options.input_shape or SHAPE
        parse_shape(options.input_shape)
        options.samples = options.samples or SAMPLES
        options.val_fraction = options.val_fraction or VAL_FRACTION
        return config_of(cls, options)

"""``--data module:callable``: a ``torch.utils.data.Dataset`` the user brings, batched by
DataLoader processes (``runtime/data/user_data.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shmtrain.models.user import is_user_spec, resolve_callable
from shmtrain.runtime.data.kinds.base import DataConfig, DataKind, config_of
from shmtrain.typed_options import parse_kwargs

LOADER_WORKERS = 2


class UserData(DataKind):
    label = "--data module:callable"

    @dataclass(kw_only=True, slots=True)
    class Config(DataConfig):
        data_args: str = ""
        #: None: the data set's own (train, val) pair, or 0.2 of a single one
        val_fraction: float | None = None
        loader_workers: int = LOADER_WORKERS

        def build(self) -> Any:
            from shmtrain.runtime.data import user_data
            from shmtrain.runtime.data.sources import DataSource

            spec = self.data
            train, val = user_data.split_user_data(spec, user_data.call_data(spec, self.data_args),
                                                   self.val_fraction)
            shape = user_data.check_item(spec, train[0], "training item 0")
            val_shape = user_data.check_item(spec, val[0], "validation item 0")
            if val_shape != shape:
                raise ValueError(f"--data {spec!r}: validation items have shape {val_shape}, training items "
                                 f"{shape}; give both the same shape")
            classes = user_data.class_map(spec, train)
            return DataSource(spec, train, val, max(classes.values()) + 1, shape, classes)

    @classmethod
    def matches(cls, data: str) -> bool:
        return is_user_spec(data)

    @classmethod
    def configure(cls, options: Any) -> DataConfig:
        resolve_callable(options.data, "--data")  # importable here, so not only in the workers
        parse_kwargs(options.data_args, "--data-args")
        if options.loader_workers is None:
            options.loader_workers = LOADER_WORKERS
        return config_of(cls, options)

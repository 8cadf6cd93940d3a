"""A folder of images, one sub-folder per class: listed by torchvision's ``ImageFolder``
and decoded lazily by DataLoader processes (``runtime/data/image_folder.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from shmtrain.runtime.data.kinds.base import DataConfig, DataKind, config_of
from shmtrain.runtime.data.sources import DataFacts
from shmtrain.runtime.data.tensors import parse_shape

#: ``--image-size`` when neither it nor ``--input-shape`` is given
IMAGE_SIZE = 32
LOADER_WORKERS = 2
VAL_FRACTION = 0.2


class Folder(DataKind):
    label = "a folder --data"
    torchvision = True

    @dataclass(kw_only=True, slots=True)
    class Config(DataConfig):
        input_shape: str = f"3x{IMAGE_SIZE}x{IMAGE_SIZE}"
        transform: Literal["none", "normalize", "standard"] = "standard"
        val_data: str | None = None
        val_fraction: float | None = VAL_FRACTION
        loader_workers: int = LOADER_WORKERS
        skip_bad_files: bool = False
        #: taken as ``--image-size``, settled into ``input_shape``
        image_size: int | None = None

        def build(self) -> Any:
            from shmtrain.runtime.data.image_folder import open_image_folder
            from shmtrain.runtime.data.sources import DataSource

            train, val, classes, skipped = open_image_folder(self.data, self.val_data, self.input_shape,
                                                             self.transform, self.val_fraction,
                                                             self.skip_bad_files)
            return DataSource(Path(self.data).name, train, val, len(classes), parse_shape(self.input_shape),
                              classes, skipped)

        def facts(self) -> DataFacts:
            import torchvision  # noqa: F401 - every worker imports it anyway: not the data's cost

            from shmtrain.runtime.data.image_folder import check_folder

            for flag, folder in (("--data", self.data), ("--val-data", self.val_data)):
                if folder is not None:
                    check_folder(Path(folder), self.skip_bad_files, flag)
            return DataConfig.facts(self)

    @classmethod
    def matches(cls, data: str) -> bool:
        return True  # listed last: whatever no other kind claims is a folder

    @classmethod
    def configure(cls, options: Any) -> DataConfig:
        """It exists; its image size from ``--image-size`` or ``--input-shape`` (they
        must agree), recorded as ``input_shape = 3xHxW``; its transform; its val folder."""
        if not Path(options.data).is_dir():
            raise ValueError(f"--data {options.data!r}: not 'digits' or 'synthetic', not module:callable, "
                             "and no such folder; give digits, synthetic, module:callable, or a folder with "
                             "one sub-folder of images per class")
        if options.val_data is not None and not Path(options.val_data).is_dir():
            raise ValueError(f"--val-data {options.val_data!r}: no such folder; give a folder with the same "
                             "class sub-folders as --data")
        side = options.image_size
        if options.input_shape is not None:
            channels, height, width = parse_shape(options.input_shape)
            if channels != 3:
                raise ValueError(f"--input-shape {options.input_shape!r} with a folder --data: images are "
                                 f"decoded to RGB, 3 channels; use --input-shape 3x{height}x{width}")
            if side is not None and (height, width) != (side, side):
                raise ValueError(f"--image-size {side} and --input-shape {options.input_shape!r} disagree: "
                                 f"give one of them, e.g. --image-size {height} or --input-shape "
                                 f"3x{side}x{side}")
        else:
            height = width = side or IMAGE_SIZE
        options.input_shape, options.image_size = f"3x{height}x{width}", None
        options.transform = options.transform or "standard"
        if options.loader_workers is None:
            options.loader_workers = LOADER_WORKERS
        if options.val_data is None:
            options.val_fraction = options.val_fraction or VAL_FRACTION
        return config_of(cls, options)

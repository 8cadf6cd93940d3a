"""A folder of images, ``--data DIR`` (docs/data.md).

The folder holds one sub-folder per class (``DIR/<class>/...``, any depth below it);
:class:`torchvision.datasets.ImageFolder` lists the files (a link to a folder anywhere
below ``DIR`` is refused with its path, :func:`refuse_links`: none is followed) (labels: the class folders in
sorted order) and nothing is decoded until a batch asks for it: each item is read by
:func:`load_image` (every PIL mode scaled by its own value range, ``runtime/data/images.py``)
in a DataLoader worker process (``runtime/data/loader.py``), then transformed.

Transforms (``--transform``), to ``H x W`` from ``--image-size`` / ``--input-shape``:

============  ==============================================  ===============================
name          training                                         evaluation
============  ==============================================  ===============================
none          resize to H x W, values in [0, 1]                the same
normalize     resize, then (x - mean) / std                    the same
standard      random resized crop (scale 0.08-1, ratio 3/4-4/3) resize the short side to
              to H x W, horizontal flip (p 0.5), normalize     min(H, W) / 0.875, center crop,
                                                               normalize
============  ==============================================  ===============================

mean and std are ImageNet's (:data:`MEAN`, :data:`STD`), as torchvision's models expect.
The random choices of sample ``i`` in epoch ``e`` are drawn from a generator seeded by
(``--seed``, e, i) (``runtime/data/loader.py``), so they are the same with any number of
loader workers and after a resume.

Held out: ``--val-data DIR2`` (the same class folders), or else a share ``--val-fraction``
(0.2) of ``DIR``: a permutation with seed 0 (the same for every ``--seed``), its first
``floor(N * F)`` files (at least 1), seen with the evaluation transform.
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from shmtrain.runtime.data.tensors import IMAGE_SUFFIXES, held_out, parse_shape

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def load_image(path: str) -> torch.Tensor:
    """One file as a float tensor ``(3, H, W)`` in [0, 1] (``runtime/data/images.py``); a
    ValueError naming the file and the fix when it cannot be decoded."""
    from PIL import Image, UnidentifiedImageError

    from shmtrain.runtime.data.images import image_to_tensor

    try:
        with Image.open(path) as img:
            return image_to_tensor(img)
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise ValueError(f"--data: image {str(path)!r} cannot be read ({exc.__class__.__name__}: "
                         f"{exc}); remove or replace the file, or pass --skip-bad-files") from None


def transforms(name: str, size: tuple[int, int]) -> tuple[Any, Any]:
    """(training, evaluation) transforms of ``--transform name`` to ``size`` (H, W)."""
    from torchvision.transforms import v2

    resize = v2.Resize(size, antialias=True)
    if name == "none":
        return resize, resize
    normalize = v2.Normalize(MEAN, STD)
    if name == "normalize":
        both = v2.Compose([resize, normalize])
        return both, both
    train = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), normalize])
    evaluation = v2.Compose([v2.Resize(round(min(size) / 0.875), antialias=True), v2.CenterCrop(size), normalize])
    return train, evaluation


class _ValidFile:
    """ImageFolder's ``is_valid_file``: an image suffix; with ``check``, also a header
    that PIL can open and verify (an unreadable file is named in a warning and kept in
    ``skipped``)."""

    def __init__(self, check: bool) -> None:
        self.check = check
        self.skipped: list[str] = []

    def __call__(self, path: str) -> bool:
        if Path(path).suffix.lower() not in IMAGE_SUFFIXES:
            return False
        if not self.check:
            return True
        from PIL import Image

        try:
            with Image.open(path) as img:
                img.verify()
        except Exception as exc:  # noqa: BLE001 - any failure to read is a bad file here
            warnings.warn(f"skipped (--skip-bad-files): --data: image {path!r} cannot be read "
                          f"({exc.__class__.__name__}: {exc})", stacklevel=2)
            self.skipped.append(path)
            return False
        return True


def refuse_links(root: str | Path, flag: str = "--data") -> None:
    """ValueError naming the first link to a folder under ``root`` (``root`` itself may be
    one): a walk never follows a link, which can lead out of the tree or back into it (a
    loop such as ``ln -s .. train/b/loop`` lists every image again, under the wrong class,
    until the path is too long). Links to files are read as files: they cannot loop."""
    for top, dirs, _ in os.walk(root, followlinks=False):
        for name in sorted(dirs):
            link = Path(top) / name
            if link.is_symlink():
                raise ValueError(f"{flag} {str(root)!r}: {str(link)!r} is a link to a folder "
                                 f"({os.readlink(link)!r}); folders behind links are not walked (one can "
                                 "lead out of the tree or back into it, and list images twice or "
                                 "endlessly); copy or move that folder in instead, or remove the link")


#: sub-folder names of a data set's splits, which are not classes
SPLIT_NAMES = ("train", "training", "val", "valid", "validation", "test", "testing")


def refuse_split_folders(root: str | Path, flag: str = "--data") -> None:
    """ValueError when ``root``'s sub-folders are a data set's splits (``train`` with
    ``val``, ``valid`` or ``test``), not its classes: the run would learn "which split"."""
    try:
        names = sorted(d.name for d in Path(root).iterdir() if d.is_dir())
    except OSError:
        return  # the folder's own check names what is wrong with it
    if len(names) < 2 or not all(n.lower() in SPLIT_NAMES for n in names) or \
            not any(n.lower() in ("train", "training") for n in names):
        return
    train = next(n for n in names if n.lower() in ("train", "training"))
    held = next((n for n in names if n.lower() in ("val", "valid", "validation")), None)
    held = held or next(n for n in names if n != train)
    base = str(root).rstrip("/")
    raise ValueError(f"{flag} {str(root)!r}: its sub-folders {names} are the data set's splits, not its "
                     f"classes (each sub-folder of --data is one class); give the splits apart: "
                     f"--data {base}/{train} --val-data {base}/{held}")


def _image_folder_class() -> Any:
    """torchvision's ImageFolder whose walk refuses links to folders (:func:`refuse_links`)."""
    from torchvision.datasets import ImageFolder
    from torchvision.datasets import folder as tv_folder

    class LinkFreeImageFolder(ImageFolder):
        @staticmethod
        def make_dataset(directory: Any, class_to_idx: dict[str, int], extensions: Any = None,
                         is_valid_file: Any = None, allow_empty: bool = False) -> list[tuple[str, int]]:
            refuse_links(directory)  # then torchvision's walk meets no link to follow
            return tv_folder.make_dataset(directory, class_to_idx, extensions, is_valid_file, allow_empty)

    return LinkFreeImageFolder


def _folder(path: str, flag: str, valid: _ValidFile, transform: Any) -> Any:
    refuse_split_folders(path, flag)
    refuse_links(path, flag)
    try:
        return _image_folder_class()(path, transform=transform, loader=load_image, is_valid_file=valid)
    except (FileNotFoundError, OSError) as exc:
        raise ValueError(f"{flag} {path!r}: {exc}; put each class's images in its own sub-folder") from None


def open_image_folder(path: str, val_path: str | None, input_shape: str, transform: str, val_fraction: float | None,
                      skip_bad_files: bool) -> tuple[Any, Any, dict[str, int], list[str]]:
    """(train, val, class map, skipped files) of a folder ``--data`` (module docstring)."""
    _, height, width = parse_shape(input_shape)
    train_tf, eval_tf = transforms(transform, (height, width))
    valid = _ValidFile(skip_bad_files)
    train = _folder(path, "--data", valid, train_tf)
    if len(train.classes) < 2:
        raise ValueError(f"--data {path!r}: needs one sub-folder per class, at least 2; found {len(train.classes)}")
    if val_path is not None:
        val = _folder(val_path, "--val-data", valid, eval_tf)
        if val.class_to_idx != train.class_to_idx:
            raise ValueError(f"--val-data {val_path!r}: its class folders {val.classes} are not those of --data "
                             f"{path!r} {train.classes}; give both the same class sub-folders")
        return train, val, dict(train.class_to_idx), valid.skipped
    if len(train) < 2:
        raise ValueError(f"--data {path!r}: found {len(train)} images; at least 2 are needed")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).tolist()
    test = held_out(len(train), val_fraction or 0.2)
    evaluation = copy.copy(train)  # the same file list, the evaluation transform
    evaluation.transform = eval_tf
    subset = torch.utils.data.Subset
    return subset(train, order[test:]), subset(evaluation, order[:test]), dict(train.class_to_idx), valid.skipped


#: image files per class opened by the readability check
SAMPLE_PER_CLASS = 3


def check_folder(path: Path, skip_bad_files: bool = False, flag: str = "--data") -> None:
    """Class sub-folders (at least 2), each with an image, the first few readable."""
    where = f"{flag} {str(path)!r}"
    if not path.is_dir():
        raise ValueError(f"{where}: no such folder; give digits, synthetic, or a folder with one "
                         "sub-folder of images per class")
    refuse_split_folders(path, flag)
    refuse_links(path, flag)  # before any walk: a link loop would never end
    classes = sorted(d for d in path.iterdir() if d.is_dir())
    if len(classes) < 2:
        raise ValueError(f"{where}: a folder of images needs one sub-folder per class, at least 2; "
                         f"found {len(classes)}; put each class's images in its own sub-folder")
    for folder in classes:
        files = sorted(f for f in folder.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"{where}: class folder {folder.name!r} holds no image "
                             f"({', '.join(sorted(IMAGE_SUFFIXES))}); add images or remove the folder")
        if not skip_bad_files:  # with it, the workers skip and count them
            for file in files[:SAMPLE_PER_CLASS]:
                check_image(file)


def check_image(file: Path) -> None:
    """Open and decode one image; a clear error naming the file if it cannot be read."""
    from shmtrain.runtime.data.tensors import read_image

    read_image(file, 8)

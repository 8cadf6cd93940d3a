"""Folders of images for ``--data FOLDER``: one sub-folder per class of small PNGs."""

from __future__ import annotations

from pathlib import Path


def image_folder(root: Path, classes: int = 2, per_class: int = 2, bad: bool = False,
                 empty_class: bool = False) -> Path:
    """Make ``root`` with ``classes`` folders ``class<c>`` of ``per_class`` 8x8 RGB PNGs
    each (``bad``: class0's first file is not a PNG; ``empty_class``: one folder more,
    with no image); ``root``."""
    from PIL import Image

    root.mkdir()
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir()
        for i in range(per_class):
            Image.new("RGB", (8, 8), (40 * c, 10 * i, 0)).save(folder / f"{i}.png")
    if bad:
        (root / "class0" / "0.png").write_bytes(b"not a png at all")
    if empty_class:
        (root / "empty").mkdir()
    return root

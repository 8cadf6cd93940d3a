"""A small learnable folder of images for ``shmtrain train --data DIR`` (docs/data.md).

Each class is a shape (a filled square, a disc, a horizontal bar, a vertical bar, a
cross, a triangle, ...) in a random colour, size and position on a noisy background,
saved as PNG under ``OUT/train/<class>/`` and ``OUT/val/<class>/``::

    python examples/make_image_folder.py data/shapes --classes 4 --per-class 60 --size 32
    shmtrain train --model examples.mynet:Net --data data/shapes/train --val-data data/shapes/val \\
        --image-size 32 --transform normalize --optimizer adamw --lr 3e-3 --grad-clip 1.0 \\
        --accumulate 2 --batch-size 16 --workers 2 --epochs 10

The images are drawn with numpy from ``--seed``: the same arguments give the same files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

SHAPES = ("square", "disc", "hbar", "vbar", "cross", "triangle", "ring", "diagonal")


def _mask(shape: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """A boolean ``size x size`` mask of one shape at a random place and scale."""
    r = rng.uniform(0.2, 0.35) * size
    cy, cx = rng.uniform(r, size - r, 2)
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    dy, dx = yy - cy, xx - cx
    thin = max(1.0, r / 3)
    masks = {
        "square": (abs(dy) < r) & (abs(dx) < r),
        "disc": dy**2 + dx**2 < r**2,
        "hbar": (abs(dy) < thin) & (abs(dx) < r * 1.4),
        "vbar": (abs(dx) < thin) & (abs(dy) < r * 1.4),
        "cross": ((abs(dy) < thin) | (abs(dx) < thin)) & (abs(dy) < r) & (abs(dx) < r),
        "triangle": (dy < r) & (dy > -r) & (abs(dx) < (dy + r) / 2),
        "ring": (dy**2 + dx**2 < r**2) & (dy**2 + dx**2 > (r - thin) ** 2),
        "diagonal": (abs(dy - dx) < thin) & (abs(dy) < r),
    }
    return masks[shape]


def draw(shape: str, size: int, rng: np.random.Generator) -> Image.Image:
    """One RGB image of ``shape``."""
    background = rng.uniform(0, 0.35, 3)
    image = background + rng.normal(0, 0.05, (size, size, 3))
    colour = rng.uniform(0.55, 1.0, 3)
    image[_mask(shape, size, rng)] = colour
    return Image.fromarray((np.clip(image, 0, 1) * 255).astype(np.uint8), "RGB")


def make(out: Path, classes: int = 4, per_class: int = 60, size: int = 32, val_share: float = 0.25,
         seed: int = 0) -> tuple[int, int]:
    """Write ``out/train`` and ``out/val``; returns (training images, validation images)."""
    if not 2 <= classes <= len(SHAPES):
        raise ValueError(f"--classes {classes}: choose 2 to {len(SHAPES)} ({', '.join(SHAPES)})")
    rng = np.random.default_rng(seed)
    val_count = max(1, round(per_class * val_share))
    counts = [0, 0]
    for shape in SHAPES[:classes]:
        for split, n in (("train", per_class), ("val", val_count)):
            folder = out / split / shape
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                draw(shape, size, rng).save(folder / f"{i:05d}.png")
            counts[split == "val"] += n
    return counts[0], counts[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder to write train/ and val/ into")
    p.add_argument("--classes", type=int, default=4, help=f"2 to {len(SHAPES)} (default 4)")
    p.add_argument("--per-class", type=int, default=60, help="training images per class (default 60)")
    p.add_argument("--size", type=int, default=32, help="image side in pixels (default 32)")
    p.add_argument("--val-share", type=float, default=0.25, help="validation images per class, as a share of "
                   "--per-class (default 0.25)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    train, val = make(args.out, args.classes, args.per_class, args.size, args.val_share, args.seed)
    print(f"{args.out}/train: {train} images, {args.out}/val: {val} images, {args.classes} classes, "
          f"{args.size}x{args.size} PNG")


if __name__ == "__main__":
    main()

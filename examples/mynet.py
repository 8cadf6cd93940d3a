"""A model of one's own for ``shmtrain train --model examples.mynet:Net``.

Run from the repository's root (the current directory is importable)::

    shmtrain train --model examples.mynet:Net --model-args 'width=32' --optimizer adamw \
        --lr 3e-3 --grad-clip 1.0 --accumulate 2 --iterations 200

shmtrain passes ``input_shape`` (C, H, W) and ``num_classes`` from the data because the
constructor takes them; ``width`` comes from ``--model-args``.
"""

from __future__ import annotations

from torch import nn


class Net(nn.Module):
    """Two convolutions with batch norm, global average pooling, one linear layer."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, width: int = 32) -> None:
        super().__init__()
        channels = input_shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        return self.head(self.features(x))

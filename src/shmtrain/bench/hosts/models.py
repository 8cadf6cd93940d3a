"""The ResNet-scale model of ``shmtrain bench hosts``' second setting.

``--model shmtrain.bench.hosts.models:resnet18_upscaled`` on ``--data digits``: each
8x8 grey digit is upscaled (bilinear) to 32x32 and repeated over 3 channels inside the
model, then torchvision's ResNet-18 (no pre-trained weights, 10 classes) reads it:
11.2 M parameters, 44.7 MB of float32 gradients per iteration, for little computation
per sample at 32x32 (the link, not the cores, is what a 1 Gbit job waits for).

``resnet18_gn_upscaled`` is the same network with GroupNorm (32 groups) in place of
BatchNorm, the setting's model. BatchNorm's running statistics are state outside the
parameters that no two methods treat alike (DDP broadcasts rank 0's before each forward;
shmtrain's strategies average parameters, and each worker keeps its own statistics), and
under ``--class-split`` rank 0's statistics are those of host a's classes alone: the
evaluation of the job's model would then measure how the statistics were kept rather than
how the parameters were communicated. GroupNorm has no running statistics (and the same
parameters, 11.2 M).
"""

from __future__ import annotations

from torch import nn
from torch.nn import functional


class Upscaled(nn.Module):
    """``net`` on the inputs upscaled to ``side`` x ``side`` and repeated to 3 channels."""

    def __init__(self, net: nn.Module, side: int = 32) -> None:
        super().__init__()
        self.net, self.side = net, side

    def forward(self, x):  # noqa: D102 - see the class
        x = functional.interpolate(x, size=(self.side, self.side), mode="bilinear", align_corners=False)
        return self.net(x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x)


def resnet18_upscaled(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 for ``num_classes`` on inputs upscaled to 3x32x32."""
    import torchvision

    return Upscaled(torchvision.models.resnet18(weights=None, num_classes=num_classes))


def resnet18_gn_upscaled(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 with GroupNorm(32) for BatchNorm, on inputs upscaled to 3x32x32."""
    import torchvision

    return Upscaled(torchvision.models.resnet18(weights=None, num_classes=num_classes,
                                                norm_layer=lambda channels: nn.GroupNorm(32, channels)))

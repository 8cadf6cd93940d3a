"""Models by name. A builder takes ``(input_shape, num_classes)`` and returns an nn.Module.

Built-ins: ``smallcnn`` (the default, for 8x8 digits and other small images), ``mlp``,
``wide_mlp`` (layers of very different sizes). torchvision's ``alexnet``, ``googlenet``,
``resnet18``, ``resnet50`` and ``vgg16`` are built with random weights (nothing is
downloaded).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import nn

from shmtrain.registry import Registry

Builder = Callable[[tuple[int, ...], int], nn.Module]
#: every built-in model's builder by name
MODELS: Registry[Builder] = Registry("model", "--model", hint=", or module:callable for your own")


def register_model(name: str, builder: Builder) -> None:
    """Make ``builder`` selectable as ``--model name``; names are unique."""
    MODELS.add(name, builder)


def model_names() -> list[str]:
    return sorted(MODELS.names())


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, args: str = "") -> nn.Module:
    """Build model ``name`` for inputs of ``input_shape`` (C, H, W) and ``num_classes``;
    ``name`` may be ``module:callable`` (the user's own, called with ``args``:
    :mod:`shmtrain.models.user`)."""
    from shmtrain.models.user import build_user_model, is_user_spec

    if is_user_spec(name):
        return build_user_model(name, args, tuple(input_shape), num_classes)
    if args:
        raise ValueError(f"--model-args {args!r} with --model {name}: a built-in model takes no arguments; "
                         "leave --model-args out, or give --model module:callable")
    return MODELS.get(name)(tuple(input_shape), num_classes)


def small_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Two 3x3 convolutions, one 2x2 pooling, two fully connected layers (no batch norm,
    so data-parallel runs can equal single-process runs exactly)."""
    channels, height, width = input_shape
    flat = 64 * (height // 2) * (width // 2)
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(flat, 128), nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Flatten, one hidden layer of 64 units."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 64), nn.ReLU(), nn.Linear(64, num_classes))


def wide_mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Layers of very different sizes (a 1M-parameter layer beside a 10-parameter one)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(input_shape), 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 8), nn.ReLU(), nn.Linear(8, num_classes),
    )


def _torchvision(name: str, min_side: int) -> Builder:
    def build(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        import torchvision

        channels, height, width = input_shape
        if channels != 3 or min(height, width) < min_side:
            raise ValueError(
                f"--model {name} needs 3-channel inputs of at least {min_side}x{min_side}, "
                f"got {'x'.join(map(str, input_shape))}; use --data synthetic --input-shape "
                f"3x{max(min_side, 64)}x{max(min_side, 64)}"
            )
        kwargs = {"weights": None, "num_classes": num_classes}
        if name == "googlenet":
            kwargs.update(aux_logits=False, init_weights=True)
        return getattr(torchvision.models, name)(**kwargs)

    return build


register_model("smallcnn", small_cnn)
register_model("mlp", mlp)
register_model("wide_mlp", wide_mlp)
_TORCHVISION = {"alexnet": 63, "googlenet": 32, "resnet18": 32, "resnet50": 32, "vgg16": 32}
for _name, _side in _TORCHVISION.items():
    register_model(_name, _torchvision(_name, _side))


def needs_torchvision(name: str) -> bool:
    """Whether model ``name`` is built by torchvision (the launcher preloads it then)."""
    return name in _TORCHVISION

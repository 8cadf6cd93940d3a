"""One PIL image as a float tensor in [0, 1], its value range respected, whatever its mode.

``Image.convert("RGB")`` alone is wrong for the modes that are not 8 bits per channel:
a 16-bit grayscale PNG (``I;16``, or ``I`` in older Pillow) clips every value above 255
to white, so the image loads as all ones. Here each mode is scaled by its own range:

=====================================  ========================================================
mode                                   conversion
=====================================  ========================================================
``1``, ``L``, ``LA``, ``La``           gray (alpha dropped), / 255; ``1`` is 0 or 1
``P``, ``PA``                          through the palette (and its transparency) to RGB, / 255
``RGB``, ``RGBA``, ``RGBa``, ``RGBX``  RGB (alpha dropped, as torchvision's loader does), / 255
``CMYK``, ``YCbCr``, ``HSV``           Pillow's conversion to RGB, / 255
``I;16``, ``I;16L``, ``I;16B``,        16-bit gray, / 65535
``I;16N``
``I``                                  32-bit integers holding 16-bit gray (a 16-bit PNG in
                                       older Pillow): / 65535; refused outside 0..65535
``F``                                  32-bit floats, taken as they are when in [0, 1]; refused
                                       otherwise (their range is not known)
anything else (``LAB``, ...)           refused, naming the mode
=====================================  ========================================================

Gray images become three equal channels (the models take RGB). A resize, when asked,
runs on the float channels (bicubic, clipped back to [0, 1]), so 16-bit precision is
kept through it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_GRAY = frozenset({"1", "L", "LA", "La"})
_PALETTE = frozenset({"P", "PA"})
_COLOR = frozenset({"RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "HSV"})
_SIXTEEN = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
#: every mode :func:`image_to_tensor` converts (others are refused by name)
MODES = tuple(sorted(_GRAY | _PALETTE | _COLOR | _SIXTEEN | {"I", "F"}))


def _unit_array(img: Any) -> np.ndarray:
    """``img`` as float32 ``(H, W, C)`` in [0, 1], ``C`` 1 (gray) or 3 (RGB)."""
    mode = img.mode
    if mode in _GRAY:
        return np.asarray(img.convert("L"), dtype=np.float32)[..., None] / 255.0
    if mode in _PALETTE:  # through RGBA: a palette's transparency is applied, then dropped
        return np.asarray(img.convert("RGBA").convert("RGB"), dtype=np.float32) / 255.0
    if mode in _COLOR:
        return np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0
    if mode in _SIXTEEN:
        return np.asarray(img).astype(np.float32)[..., None] / 65535.0
    if mode == "I":
        values = np.asarray(img)
        low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
        if low < 0 or high > 65535:
            raise ValueError(f"image mode 'I' (32-bit integers) with values {low}..{high}: only 0..65535 "
                             "(16-bit gray) has a known range; save the image as 8- or 16-bit")
        return values.astype(np.float32)[..., None] / 65535.0
    if mode == "F":
        values = np.asarray(img, dtype=np.float32)
        if values.size and not (np.isfinite(values).all() and values.min() >= 0.0 and values.max() <= 1.0):
            raise ValueError(f"image mode 'F' (32-bit floats) with values {float(np.nanmin(values)):g}.."
                             f"{float(np.nanmax(values)):g}: only finite floats in [0, 1] are taken as they "
                             "are; save the image as 8- or 16-bit")
        return values[..., None]
    raise ValueError(f"image mode {mode!r} cannot be converted to RGB in [0, 1] (known modes: "
                     f"{', '.join(MODES)}); save the image as RGB or grayscale, 8 or 16 bits")


def _resize(channels: np.ndarray, size: int) -> np.ndarray:
    from PIL import Image

    out = [np.asarray(Image.fromarray(np.ascontiguousarray(channels[..., c]))
                      .resize((size, size), Image.Resampling.BICUBIC)) for c in range(channels.shape[-1])]
    return np.clip(np.stack(out, axis=-1), 0.0, 1.0)


def image_to_tensor(img: Any, size: int | None = None) -> torch.Tensor:
    """One PIL image as a float32 tensor ``(3, H, W)`` in [0, 1], scaled by its mode's
    value range (see the module's table); ``size``: resized to ``size`` x ``size`` first.

    Raises:
        ValueError: a mode whose range is not known, or values outside it (names the
            mode and what to do).
    """
    channels = _unit_array(img)
    if size is not None and channels.shape[:2] != (size, size):
        channels = _resize(channels, size)
    if channels.shape[-1] == 1:
        channels = np.repeat(channels, 3, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(channels, dtype=np.float32)).permute(2, 0, 1).contiguous()

"""Pictures people would rather look at than read: image grids as PNG."""

from __future__ import annotations

from collections.abc import Sequence
from io import BytesIO
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from .storage import atomic_write


def quantize(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] floats -> uint8 in the same layout (how synthetic shards are stored)."""
    return images.detach().float().clamp(-1.0, 1.0).add(1.0).mul(127.5).round().to(torch.uint8)


def dequantize(images: torch.Tensor) -> torch.Tensor:
    """uint8 -> [-1, 1] float32: the inverse of :func:`quantize` up to rounding."""
    return images.float() / 127.5 - 1.0


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """``(N, 3, H, W)`` or ``(3, H, W)`` in [-1, 1] (or uint8) -> channels-last uint8 numpy, for PNGs.

    Values outside [-1, 1] (decoder overshoot) are clipped.
    """
    if images.ndim not in (3, 4) or images.shape[-3] != 3:
        raise ValueError(f"expected (N, 3, H, W) or (3, H, W), got shape {tuple(images.shape)}")
    pixels = images.cpu() if images.dtype == torch.uint8 else quantize(images).cpu()
    return pixels.movedim(-3, -1).contiguous().numpy()


def image_grid(
    rows: Sequence[torch.Tensor],
    path: str | Path,
    *,
    row_labels: Sequence[str] = (),
    columns: int = 12,
    label_width: int = 72,
) -> Path:
    """One labelled row per tensor (first ``columns`` images of each), saved as PNG."""
    size = rows[0].shape[-1]
    canvas = Image.new("RGB", (label_width + columns * size, len(rows) * size), "white")
    draw = ImageDraw.Draw(canvas)
    for r, images in enumerate(rows):
        for c, pixels in enumerate(to_uint8(images[:columns])):
            canvas.paste(Image.fromarray(pixels), (label_width + c * size, r * size))
        if r < len(row_labels):
            draw.text((4, r * size + size // 2 - 6), row_labels[r], fill="black")
    path = Path(path)
    buffer = BytesIO()
    canvas.save(buffer, format="PNG")
    return atomic_write(path, buffer.getvalue())

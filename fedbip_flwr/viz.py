"""Pictures people would rather look at than read: image grids as PNG."""

from __future__ import annotations

from collections.abc import Sequence
from io import BytesIO
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from .storage import atomic_write


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(N, 3, H, W) in [-1, 1] -> (N, H, W, 3) uint8."""
    scaled = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return scaled.permute(0, 2, 3, 1).cpu().numpy()


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

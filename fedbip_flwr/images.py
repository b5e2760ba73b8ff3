"""Image files as the model must see them: 8-bit RGB with the pixels every viewer shows.

An institution's folder holds what its devices export, not what a benchmark ships:

* 16-bit grayscale (PNG, TIFF: medical and scientific exports) is scaled from its full 16-bit
  range to 8 bits (value * 255 / 65535, rounded). PIL's own conversion clips it instead, which
  turns every value above 255 white. No windowing is applied: a scanner that fills only 12 of
  the 16 bits gives a dark image, as every viewer that shows the full range does.
* EXIF orientation is applied (a phone stores a portrait photo sideways with a "rotate" tag).
* Transparency is composited on :data:`BACKGROUND` (white, the paper of sketches and scans),
  never dropped, which would show whatever colour the transparent pixels happen to hold.
* Palette, CMYK, bilevel and other modes are converted by PIL.
* 32-bit integer and floating-point images have no agreed 8-bit meaning and are refused.

:func:`find_unreadable` decodes every file once, when a folder is indexed, so that a bad file
is named before any model loads, never halfway through personalization.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .logs import short_reason
from .progress import Progress

log = logging.getLogger(__name__)

BACKGROUND = (255, 255, 255)  # what transparent pixels become
SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
PROGRESS_FROM = 200  # files: a folder this large reports its check's progress


class UnsupportedImage(ValueError):
    """A file that decodes but has no 8-bit RGB meaning (32-bit integer or float pixels)."""


def is_hidden(name: str) -> bool:
    """Names starting with '.' (.ipynb_checkpoints, .DS_Store, macOS's ._ files) are not data."""
    return name.startswith(".")


def image_files(folder: Path, suffixes: frozenset[str] | tuple[str, ...]) -> list[Path]:
    """Files under ``folder`` (at any depth) whose suffix is in ``suffixes`` (any case), sorted;
    hidden files and everything under hidden folders are left out."""
    found: list[Path] = []
    for top, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = [d for d in dirs if not is_hidden(d)]
        found += [
            Path(top) / f for f in files if not is_hidden(f) and Path(f).suffix.lower() in suffixes
        ]
    return sorted(found)


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB, oriented, scaled and composited as the module docstring says."""
    image = ImageOps.exif_transpose(image)
    if image.mode in SIXTEEN_BIT_MODES or image.mode in ("I", "F"):
        image = _scaled_to_8_bits(image)
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ALPHA_MODES:
        rgba = image.convert("RGBA")
        flat = Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
        image = Image.alpha_composite(flat, rgba)
    return image.convert("RGB")


def _scaled_to_8_bits(image: Image.Image) -> Image.Image:
    """16-bit grayscale to ``L`` over its full range; mode ``I`` holding 16-bit values alike."""
    values = np.asarray(image)
    if image.mode == "F" or (
        image.mode == "I" and values.size and not 0 <= values.min() <= values.max() <= 65535
    ):
        raise UnsupportedImage(
            f"{image.mode!r} pixels ({'floating point' if image.mode == 'F' else '32-bit'}) have "
            "no 8-bit meaning; export 8- or 16-bit images"
        )
    scaled = np.rint(values.astype(np.float64) * (255 / 65535)).astype(np.uint8)
    return Image.fromarray(scaled, mode="L")


def open_rgb(path: Path) -> Image.Image:
    """Decode one file to 8-bit RGB (:func:`to_rgb`)."""
    with Image.open(path) as image:
        return to_rgb(image)


@dataclass(frozen=True)
class BadImage:
    """A file that cannot be decoded, and why, in words."""

    path: Path
    reason: str


def why_unreadable(path: Path) -> str | None:
    """None if ``path`` decodes; else the reason, in a few words.

    Every byte is decoded (JPEGs at 1/8 scale, which reads the same data for a fraction of the
    work), so a truncated file is caught, not only a bad header. Any exception counts: this is
    untrusted input, and a decoder may raise almost anything on it.
    """
    try:
        if path.stat().st_size == 0:
            return "empty file (0 bytes)"
        with Image.open(path) as image:
            image.draft(None, (1, 1))
            image.load()
            if image.mode in ("I", "F"):
                _scaled_to_8_bits(image)
    except UnidentifiedImageError:
        return "not an image file (PIL cannot identify it)"
    except Exception as err:  # noqa: BLE001 - any failure to decode makes the file unreadable
        return f"damaged or truncated ({short_reason(err)})"
    return None


def find_unreadable(paths: Sequence[Path], where: Path) -> list[BadImage]:
    """Every file of ``paths`` that does not decode, in order; progress lines for large folders."""
    bad = []
    progress = Progress(log, f"checking images in {where}", len(paths), "files")
    for path in paths:
        reason = why_unreadable(path)
        if reason is not None:
            bad.append(BadImage(path, reason))
        progress.update()
    if len(paths) >= PROGRESS_FROM:
        progress.finish()
    return bad

"""Durable files: an upload happens once, so nothing the server accepted may be lost.

Every write goes to a temporary file in the same folder, is fsynced, then renamed over the
target (atomic on POSIX), and the folder entry is fsynced too (as is the entry of every folder
created on the way). A crash leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save


def atomic_write(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and durably."""
    path = Path(path)
    _make_folders(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    return path


def remove_partial_writes(root: str | Path) -> list[Path]:
    """Delete the temporary files a killed :func:`atomic_write` left under ``root``.

    They never replaced a real file, so nothing accepted is lost; left alone they would pile
    up in payloads/ and shards/ with every crash.
    """
    stale = [p for p in Path(root).rglob(".*.tmp") if p.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def _make_folders(folder: Path) -> None:
    """``mkdir -p`` whose new entries are durable too: each new folder's parent is fsynced."""
    missing = [f for f in (folder, *folder.parents) if not f.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        _fsync_folder(created.parent)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_tensors(
    path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> Path:
    """A safetensors file of our own making (shards, the classifier), written atomically."""
    contiguous = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return atomic_write(path, save(contiguous, metadata=metadata))


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def read_metadata(path: str | Path) -> dict[str, str]:
    """A safetensors file's header metadata; empty when the file is missing or unreadable."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return handle.metadata() or {}
    except (OSError, SafetensorError):
        return {}

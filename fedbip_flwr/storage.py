"""Durable files: an upload happens once, so nothing the server accepted may be lost.

Every write goes to a temporary file in the same folder, is fsynced, then renamed over the
target (atomic on POSIX), and the folder entry is fsynced too (as is the entry of every folder
created on the way). A crash leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save


@contextlib.contextmanager
def _atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A handle on a temporary file beside ``path``: fsynced and renamed over ``path`` when the
    block ends, removed if it raises. Every durable write of this module goes through here."""
    path = Path(path)
    _make_folders(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def atomic_write(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and durably."""
    with _atomic_file(path) as handle:
        handle.write(data)
    return Path(path)


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


_DTYPE_CODES = {torch.uint8: "U8", torch.int64: "I64", torch.float32: "F32", torch.float16: "F16"}


def write_tensors_streamed(
    path: str | Path,
    first: dict[str, torch.Tensor],
    streamed: tuple[str, torch.dtype, tuple[int, ...]],
    parts: Iterable[torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> Path:
    """A safetensors file whose largest tensor arrives in parts, written atomically and durably.

    ``first`` holds small tensors known up front (written before the streamed one); the
    tensor named ``streamed[0]`` of dtype ``streamed[1]`` and shape ``streamed[2]`` is the
    concatenation of ``parts`` along dim 0, never held whole in memory. The bytes equal
    ``safetensors.torch.save`` of the same tensors when ``first``'s dtypes are at least as wide
    as the streamed one's (safetensors orders tensors by alignment, then name).
    """
    name, dtype, shape = streamed
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key, tensor in first.items():
        size = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": _DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    total = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    header[name] = {
        "dtype": _DTYPE_CODES[dtype],
        "shape": list(shape),
        "data_offsets": [offset, offset + total],
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with _atomic_file(path) as handle:
        handle.write(struct.pack("<Q", len(text)) + text)
        for tensor in first.values():
            handle.write(tensor.detach().cpu().contiguous().numpy().tobytes())
        written = 0
        for part in parts:
            if part.dtype != dtype or tuple(part.shape[1:]) != tuple(shape[1:]):
                raise ValueError(
                    f"{name}: part {tuple(part.shape)} {part.dtype} does not fit "
                    f"{tuple(shape)} {dtype}"
                )
            data = part.detach().cpu().contiguous().numpy().tobytes()
            handle.write(data)
            written += len(data)
        if written != total:
            raise ValueError(f"{name}: {written} bytes streamed, {total} expected")
    return Path(path)


def read_small_tensor(path: str | Path, name: str) -> torch.Tensor:
    """One tensor of a safetensors file by a plain read of its bytes (no memory map)."""
    offset, dtype, shape = tensor_location(path, name)
    torch_dtype = {code: d for d, code in _DTYPE_CODES.items()}[dtype]
    size = int(torch.Size(shape).numel()) * torch.empty((), dtype=torch_dtype).element_size()
    with open(path, "rb") as handle:
        handle.seek(offset)
        data = bytearray(handle.read(size))
    if len(data) != size:
        raise OSError(f"{path}: {name} is truncated")
    return (
        torch.frombuffer(data, dtype=torch_dtype).reshape(shape)
        if size
        else torch.empty(shape, dtype=torch_dtype)
    )


def tensor_location(path: str | Path, name: str) -> tuple[int, str, list[int]]:
    """(absolute byte offset, safetensors dtype code, shape) of one tensor, from the header only."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    entry = header[name]
    return 8 + length + entry["data_offsets"][0], entry["dtype"], entry["shape"]

"""Any method's upload: one safetensors blob, framed and read as untrusted network input.

Every method's upload (FedBiP's payload, a peer's) goes through here before its own schema:

* safetensors only: loading it cannot execute code (unlike pickle / ``torch.load``);
* size-capped before anything is parsed, with the header length checked against our own limit
  before safetensors sees it;
* exactly the tensor names the method expects, tiling the data with no gap or overlap, finite
  floats, and ``fedbip.*`` metadata parsed into the method's pydantic model, version first.

Every rejection is a :class:`PayloadError` whose message says what is wrong and what to change.
:func:`check_dtype` and :func:`check_shape` (together :func:`check_dtype_shape`),
:func:`check_finite` and :func:`check_index` are the checks every method's schema is written
in, FedBiP's contract (:mod:`fedbip_flwr.payload`) too.
"""

from __future__ import annotations

import json
import math
import os
import struct
import unicodedata
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Self, TypeVar

import safetensors.torch
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedbip_flwr.config import FederationConfig
from fedbip_flwr.logs import short_reason

SCHEMA_VERSION = 1
META_PREFIX = "fedbip."
# The server's default cap (run config federation.max-payload-mb), so tools and server agree
# out of the box.
DEFAULT_MAX_BYTES = int(FederationConfig.model_fields["max_payload_mb"].default * 2**20)
# A client id names files on the server: no separators, no leading dot, short enough in UTF-8.
CLIENT_ID_PATTERN = r"^\w[\w .-]{0,47}$"
MAX_HEADER_BYTES = 1024 * 1024  # ours is a few KiB; safetensors itself allows 100 MB
# Bytes per element of every dtype a payload may use; anything else is refused at the header.
_DTYPE_BYTES = {"F32": 4, "F16": 2, "I64": 8, "U8": 1}
_TENSOR_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
_MAX_RANK = 8


def printable(value: object) -> str:
    """``value`` as text with every control or invisible character (terminal escape codes,
    newlines, bidirectional overrides) written as its escape: an upload's strings reach logs,
    terminals and reports, where raw they could rewrite what a person reads."""
    return "".join(
        c.encode("unicode_escape").decode("ascii") if unicodedata.category(c)[0] == "C" else c
        for c in str(value)
    )


class PayloadError(ValueError):
    """A payload that cannot be accepted; ``reason`` says what is wrong and what to change
    (its upload-derived text made :func:`printable`)."""

    def __init__(self, reason: str) -> None:
        reason = printable(reason)
        self.reason = reason
        super().__init__(f"payload rejected: {reason}")

    def __reduce__(self) -> tuple[type[PayloadError], tuple[str]]:
        # Rebuild from the reason so the prefix is not doubled when the error crosses processes.
        return (type(self), (self.reason,))


class PayloadTooLarge(PayloadError):
    """Above the byte cap. ``amount`` is the size, or "more than <limit> bytes" for a stream
    that was not read to its end; the reason names the server's knob, run config
    federation.max-payload-mb (the CLI names its own)."""

    def __init__(self, amount: str, limit: int) -> None:
        self.amount, self.limit = amount, limit
        super().__init__(
            f"payload is {amount}, above the cap of {limit} bytes (raise run config "
            "federation.max-payload-mb if this client legitimately holds that many images, or "
            "upload float16 latents)"
        )

    def __reduce__(self) -> tuple[type[PayloadTooLarge], tuple[str, int]]:
        return (type(self), (self.amount, self.limit))


class UploadMeta(BaseModel):
    """What every method's upload says about itself; each method's metadata adds its own fields
    and fixes ``method`` to its name (:mod:`fedbip_flwr.methods`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int
    method: str
    client_id: str = Field(pattern=CLIENT_ID_PATTERN)  # the server's file name for it
    domain: str = Field(min_length=1)
    class_names: list[str] = Field(min_length=1)
    num_examples: int = Field(ge=1)

    @model_validator(mode="after")
    def _check_class_names(self) -> Self:
        if any(not name for name in self.class_names):
            raise ValueError("class_names must not contain empty names")
        if len(set(self.class_names)) != len(self.class_names):
            raise ValueError("class_names must be unique")
        return self


M = TypeVar("M", bound=UploadMeta)


def encode_tensors(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """Any method's upload as safetensors bytes; equal inputs give equal bytes, in any process.

    safetensors writes ``__metadata__`` in a per-process random order (a Rust HashMap), so the
    header is rewritten in sorted order.
    """
    tensors = {
        name: t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        for name, t in tensors.items()
    }
    blob = safetensors.torch.save(tensors, metadata=dict(metadata))
    size = _header_len(blob)
    header = json.loads(blob[8 : 8 + size])
    metadata = dict(sorted(header.pop("__metadata__").items()))
    raw = json.dumps(
        {"__metadata__": metadata, **dict(sorted(header.items()))},
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors' own padding: tensor data stays 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw + blob[8 + size :]


def meta_strings(meta: BaseModel) -> dict[str, str]:
    """safetensors metadata is str -> str; JSON values keep types and stay human-readable."""
    return {META_PREFIX + key: json.dumps(value) for key, value in meta.model_dump().items()}


def read_capped(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """A file's bytes, never more than ``max_bytes`` + 1 of them read: a file above the cap is
    refused before reading, and a device or pipe, whose size the file system does not know,
    once it passes the cap."""
    with open(path, "rb") as file:
        check_size(os.fstat(file.fileno()).st_size, max_bytes)
        blob = file.read(max_bytes + 1)
    if len(blob) > max_bytes:
        raise PayloadTooLarge(f"more than {max_bytes} bytes", max_bytes)
    return blob


def read_tensors(
    blob: bytes,
    names: Collection[str] | Callable[[dict[str, str]], Collection[str]],
    max_bytes: int,
    method: str,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Any method's upload, untrusted: ``(tensors, metadata)`` or :class:`PayloadError`.

    ``names``: the tensors it must hold, or a function of its metadata giving them.

    Size cap before parsing, our own header parse, the schema version and ``method`` (so an
    upload for another method says so), exactly ``names`` tiling the data with no gap or
    overlap, safetensors' load, and finite floats. What the tensors must look like is the
    method's own check, after this.
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise PayloadError(f"expected bytes, got {type(blob).__name__}")
    check_size(memoryview(blob).nbytes, max_bytes)
    blob = bytes(blob)
    entries, metadata = read_header(blob)
    check_schema_version(meta_value(metadata, "schema_version"))
    _check_method(metadata, method)
    if callable(names):
        names = names(metadata)
    _check_layout(entries, len(blob) - 8 - _header_len(blob), tuple(names))
    tensors = _load_tensors(blob)
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            check_finite(name, tensor)
    return tensors, metadata


# (what, the upload's value, the server's, why they must agree)
Check = tuple[str, Any, Any, str]


def refuse_mismatch(checks: Sequence[Check]) -> None:
    """:class:`PayloadError` naming the first value that is not the server's, and why."""
    for label, got, want, why in checks:
        if got != want:
            raise PayloadError(f"{label} {got!r} does not match the server's {want!r} ({why})")


def check_size(size: int, limit: int) -> None:
    """Refuse oversize input before parsing it, so a huge upload costs no parsing work."""
    if size > limit:
        raise PayloadTooLarge(f"{size} bytes", limit)


def _header_len(blob: bytes) -> int:
    return struct.unpack("<Q", blob[:8])[0]


def read_header(
    blob: bytes, max_header_bytes: int = MAX_HEADER_BYTES
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Parse the safetensors header ourselves, under our own limits, for clear error messages.

    Returns ``(tensor entries, metadata)``: each entry is the header's
    ``{"dtype", "shape", "data_offsets"}`` object, already type-checked; metadata is
    ``__metadata__`` (str -> str, empty when absent). Offsets are not checked against the data
    here; :func:`decode_payload` does that.
    """
    if len(blob) < 8:
        raise PayloadError(
            f"only {len(blob)} bytes; a safetensors file starts with an 8-byte header length "
            "(empty or truncated upload)"
        )
    size = _header_len(blob)
    if size > max_header_bytes:
        raise PayloadError(
            f"declared header length {size} bytes exceeds the {max_header_bytes}-byte limit "
            "(not a FedBiP payload, or corrupted)"
        )
    if size > len(blob) - 8:
        raise PayloadError(
            f"declared header length {size} bytes runs past the end of the {len(blob)}-byte "
            "blob (truncated upload?)"
        )
    header = _parse_json_object(blob[8 : 8 + size])
    metadata = header.pop("__metadata__", {})
    _check_metadata_types(metadata)
    for name, entry in header.items():
        _check_entry(name, entry)
    return header, metadata


def _parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(
            raw.decode("utf-8"),
            object_pairs_hook=_unique_keys,
            parse_constant=_reject_constant,
        )
    except UnicodeDecodeError:
        raise PayloadError("header is not valid UTF-8 (not a safetensors file?)") from None
    except (ValueError, RecursionError) as err:
        raise PayloadError(f"header is not valid JSON ({short_reason(err)})") from None
    if not isinstance(header, dict):
        raise PayloadError(f"header is a JSON {_json_type(header)}, expected an object")
    return header


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Duplicate keys would let our view of the header differ from the loader's."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _check_metadata_types(metadata: Any) -> None:
    if not isinstance(metadata, dict):
        raise PayloadError(f"__metadata__ is a JSON {_json_type(metadata)}, expected an object")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise PayloadError(
                f"__metadata__ value of {key!r} is a JSON {_json_type(value)}; "
                "safetensors metadata values are strings"
            )


def _check_entry(name: str, entry: Any) -> None:
    """Type-check one header entry so the layout arithmetic below cannot fail."""
    if not isinstance(entry, dict) or set(entry) != _TENSOR_ENTRY_KEYS:
        raise PayloadError(
            f"header entry {name!r} must be an object with exactly dtype, shape, data_offsets"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
        raise PayloadError(
            f"tensor {name!r} has dtype {dtype!r}; uploads hold F32, F16, I64 or U8 tensors"
        )
    if not _is_int_list(shape) or len(shape) > _MAX_RANK or any(s < 0 for s in shape):
        raise PayloadError(f"tensor {name!r} has an invalid shape {shape!r}")
    if not _is_int_list(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise PayloadError(f"tensor {name!r} has invalid data_offsets {offsets!r}")


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def _check_layout(
    entries: dict[str, dict[str, Any]], data_len: int, wanted: tuple[str, ...]
) -> None:
    """Exact tensor names, and byte ranges that tile the data section with no gap or overlap."""
    names = set(entries)
    if missing := sorted(set(wanted) - names):
        raise PayloadError(
            f"missing tensor(s) {missing}: expected {list(wanted)}, found {sorted(names)}"
        )
    if extra := sorted(names - set(wanted)):
        raise PayloadError(
            f"unexpected tensor(s) {extra}: expected {list(wanted)}, found {sorted(names)}"
        )
    for name, entry in entries.items():
        begin, end = entry["data_offsets"]
        nbytes = math.prod(entry["shape"]) * _DTYPE_BYTES[entry["dtype"]]
        if end - begin != nbytes:
            raise PayloadError(
                f"tensor {name!r} of shape {entry['shape']} and dtype {entry['dtype']} needs "
                f"{nbytes} bytes but its data_offsets span {end - begin}"
            )
    cursor = 0
    for name, entry in sorted(entries.items(), key=lambda item: item[1]["data_offsets"]):
        begin, end = entry["data_offsets"]
        if begin != cursor:
            where = "overlaps the previous tensor" if begin < cursor else "leaves a gap"
            raise PayloadError(f"tensor {name!r} starts at data byte {begin} and {where}")
        cursor = end
    if cursor != data_len:
        raise PayloadError(
            f"tensor data ends at byte {cursor} but the blob carries {data_len} data bytes "
            "(truncated or padded upload)"
        )


def parse_meta(metadata: dict[str, str], model: type[M]) -> M:
    """Turn ``fedbip.*`` metadata strings into ``model`` (a method's metadata), version first.

    The version is checked before anything else so that a payload from a newer schema gets a
    "version" message rather than a confusing one about fields it added; then the method, so
    an upload meant for another method says so.
    """
    check_schema_version(meta_value(metadata, "schema_version"))
    _check_method(metadata, model.model_fields["method"].default)
    expected = {META_PREFIX + field for field in model.model_fields}
    # A field with a default was added to the schema later: an upload written before it (a run
    # folder's persisted payloads) means the default.
    required = {
        META_PREFIX + name for name, field in model.model_fields.items() if field.is_required()
    }
    if missing := sorted(required - set(metadata)):
        raise PayloadError(f"metadata is missing {missing} (written by an incomplete encoder?)")
    if unknown := sorted(set(metadata) - expected):
        raise PayloadError(f"metadata has unknown key(s) {unknown}")
    values = {
        field: meta_value(metadata, field)
        for field in model.model_fields
        if META_PREFIX + field in metadata
    }
    try:
        return model.model_validate(values, strict=True)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(part) for part in first["loc"])
        where = f"metadata field '{META_PREFIX}{loc}'" if loc else "metadata"
        raise PayloadError(f"{where} is invalid: {first['msg']}") from None


def _check_method(metadata: dict[str, str], wanted: str) -> None:
    method = meta_value(metadata, "method")
    if method != wanted:
        raise PayloadError(
            f"this is an upload for method {method!r}, not {wanted!r} (in a federation, "
            "clients and server share run config method)"
        )


def upload_method(blob: bytes, max_bytes: int) -> str:
    """The method an untrusted upload says it is for (its ``fedbip.method``), read from its
    header alone: which method's checks to run on it."""
    check_size(memoryview(blob).nbytes, max_bytes)
    _, metadata = read_header(bytes(blob))
    method = meta_value(metadata, "method")
    if not isinstance(method, str):
        raise PayloadError(f"metadata 'fedbip.method' must be a string, got {method!r}")
    return method


def meta_value(metadata: dict[str, str], field: str) -> Any:
    key = META_PREFIX + field
    if key not in metadata:
        raise PayloadError(f"metadata is missing '{key}' (not a FedBiP payload?)")
    try:
        return json.loads(metadata[key], parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:
        raise PayloadError(f"metadata '{key}' is not valid JSON ({short_reason(err)})") from None


def check_schema_version(version: Any) -> None:
    if type(version) is not int or version != SCHEMA_VERSION:
        raise PayloadError(
            f"schema version {version!r} is not supported (this side reads version "
            f"{SCHEMA_VERSION}); run the same fedbip-flwr release on clients and server"
        )


def _load_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    """Let safetensors do the real load, wrapping whatever it raises.

    Our header checks should already have caught every problem; catching broadly here is
    deliberate, so that no loader edge case can escape as anything but a PayloadError.
    """
    try:
        return safetensors.torch.load(blob)
    except Exception as err:  # noqa: BLE001 - untrusted input: one error type, always
        raise PayloadError(f"safetensors could not load it ({short_reason(err)})") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def check_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype, why: str = "") -> torch.Tensor:
    """``tensor`` if it is ``dtype``, or :class:`PayloadError` naming ``name`` and ``why`` that
    dtype (where the schema takes it from, when not fixed)."""
    if tensor.dtype != dtype:
        raise PayloadError(
            f"{name} must be {dtype_name(dtype)}, got {dtype_name(tensor.dtype)}{_because(why)}"
        )
    return tensor


def check_shape(
    name: str, tensor: torch.Tensor, shape: tuple[int, ...], why: str = ""
) -> torch.Tensor:
    """``tensor`` if it has exactly ``shape``, or :class:`PayloadError` naming ``name`` and
    ``why`` that shape (the metadata or settings it follows from)."""
    if tuple(tensor.shape) != tuple(shape):
        raise PayloadError(
            f"{name} has shape {list(tensor.shape)}, expected {list(shape)}{_because(why)}"
        )
    return tensor


def check_dtype_shape(
    name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], why: str = ""
) -> torch.Tensor:
    """``tensor`` with exactly this dtype and shape, or :class:`PayloadError` naming ``name``."""
    return check_shape(name, check_dtype(name, tensor, dtype, why), shape, why)


def check_finite(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if every value is finite: NaN or Inf would poison whatever is made from it."""
    if not bool(torch.isfinite(tensor).all()):
        raise PayloadError(f"{name} contain NaN or Inf")
    return tensor


def _because(why: str) -> str:
    return f" ({why})" if why else ""


def check_index(name: str, tensor: torch.Tensor, count: int, what: str) -> torch.Tensor:
    """An integer tensor whose every entry indexes one of ``count`` things (``what``)."""
    if len(tensor) and (int(tensor.min()) < 0 or int(tensor.max()) >= count):
        bad = int(tensor.min()) if int(tensor.min()) < 0 else int(tensor.max())
        raise PayloadError(f"{name} must lie in [0, {count}) ({what}); found {bad}")
    return tensor

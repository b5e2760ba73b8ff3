"""The payload format: exact round trips, and rejection of every malformed or mismatched blob.

Payloads arrive from the network, so the contract under test is strict: any bytes either decode
to a valid :class:`Payload` or raise :class:`PayloadError` with an actionable reason, never
another exception. Test payloads are small random tensors (N=6, latents 4x8x8, d=32, 3 classes).
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from fedbip_flwr.payload import (
    SCHEMA_VERSION,
    Expectations,
    Payload,
    PayloadError,
    PayloadMeta,
    PayloadTooLarge,
    decode_payload,
    encode_payload,
    load_payload,
    read_header,
    save_payload,
    summarize,
)

N, LATENT_SHAPE, D = 6, (4, 8, 8), 32
CLASSES = ("cat", "dog", "fish")
TEMPLATE = "a {S} style of a {V}"
FINGERPRINT = "ab12"


# --- factories ----------------------------------------------------------------------------------


def make_meta(**overrides: Any) -> PayloadMeta:
    fields: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "client_id": "partition-0",
        "domain": "sketch",
        "timestep": 981,
        "scheduler": "PNDMScheduler",
        "num_inference_steps": 50,
        "n_s": 1,
        "n_v": 2,
        "concept_space": "token",
        "class_names": list(CLASSES),
        "prompt_template": TEMPLATE,
        "base_model": FINGERPRINT,
        "latent_shape": list(LATENT_SHAPE),
        "latent_dtype": "float32",
        "num_examples": N,
    }
    return PayloadMeta(**{**fields, **overrides})


def make_payload(*, latent_dtype: str = "float32", seed: int = 0, **tensors: torch.Tensor) -> Payload:
    """A valid payload; keyword tensors replace the random ones (for building bad cases)."""
    meta = make_meta(latent_dtype=latent_dtype)
    gen = torch.Generator().manual_seed(seed)
    parts = {
        "latents": torch.randn(N, *LATENT_SHAPE, generator=gen).to(getattr(torch, latent_dtype)),
        "labels": torch.arange(N, dtype=torch.int64) % len(CLASSES),
        "domain_concept": torch.randn(meta.n_s, D, generator=gen),
        "class_concepts": torch.randn(len(CLASSES), meta.n_v, D, generator=gen),
    }
    return Payload(**{**parts, **tensors}, meta=meta)


def make_expectations(**overrides: Any) -> Expectations:
    fields: dict[str, Any] = {
        "max_bytes": 1 << 20,
        "base_model": FINGERPRINT,
        "latent_shape": LATENT_SHAPE,
        "concept_dim": D,
        "timestep": 981,
        "num_inference_steps": 50,
        "scheduler": "PNDMScheduler",
        "n_s": 1,
        "n_v": 2,
        "concept_space": "token",
        "class_names": CLASSES,
        "prompt_template": TEMPLATE,
        "domains": ("sketch", "painting"),
    }
    return Expectations(**{**fields, **overrides})


def meta_strings(**overrides: Any) -> dict[str, str]:
    """The ``fedbip.*`` metadata of a valid payload, with fields replaced (raw JSON values)."""
    meta = {f"fedbip.{k}": json.dumps(v) for k, v in make_meta().model_dump().items()}
    meta.update({f"fedbip.{k}": json.dumps(v) for k, v in overrides.items()})
    return meta


def raw_blob(metadata: dict[str, str] | None = None, **tensors: torch.Tensor) -> bytes:
    """Write with plain safetensors, bypassing our encoder's checks (a hostile or buggy client)."""
    parts = {**make_payload().tensors(), **tensors}
    return safetensors.torch.save(parts, metadata=meta_strings() if metadata is None else metadata)


def split_blob(blob: bytes) -> tuple[dict[str, Any], bytes]:
    size = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + size]), blob[8 + size :]


def with_header(header: Any, data: bytes = b"") -> bytes:
    """Hand-craft a blob: any header (object, list, or raw bytes) followed by ``data``."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def edit_header(edit: Callable[[dict[str, Any]], None]) -> bytes:
    """A valid blob whose header was changed by ``edit`` (data bytes untouched)."""
    header, data = split_blob(encode_payload(make_payload()))
    edit(header)
    return with_header(header, data)


@pytest.fixture
def blob() -> bytes:
    return encode_payload(make_payload())


def assert_same(a: Payload, b: Payload) -> None:
    for name, tensor in a.tensors().items():
        other = getattr(b, name)
        assert other.dtype == tensor.dtype, name
        assert torch.equal(other, tensor), name
    assert a.meta == b.meta


# --- round trip ---------------------------------------------------------------------------------


@pytest.mark.parametrize("latent_dtype", ["float32", "float16"])
def test_round_trip_is_exact(latent_dtype: str) -> None:
    original = make_payload(latent_dtype=latent_dtype)
    decoded = decode_payload(encode_payload(original), make_expectations())
    assert_same(original, decoded)
    assert decoded.latents.dtype == getattr(torch, latent_dtype)


def test_float16_latents_halve_the_latent_bytes() -> None:
    full = len(encode_payload(make_payload(latent_dtype="float32")))
    half = len(encode_payload(make_payload(latent_dtype="float16")))
    assert full - half == N * 4 * 8 * 8 * 2


def test_equal_payloads_are_equal_bytes_in_any_process(blob: bytes) -> None:
    """safetensors orders metadata differently in each process; the encoder must not."""
    code = (
        "import sys; from tests.test_payload import make_payload; "
        "from fedbip_flwr.payload import encode_payload; "
        "sys.stdout.buffer.write(encode_payload(make_payload()))"
    )
    root = Path(__file__).resolve().parents[1]
    other = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, check=True)
    assert other.stdout == blob


def test_metadata_is_readable_json_under_fedbip_keys(blob: bytes) -> None:
    entries, metadata = read_header(blob)
    assert set(entries) == {"latents", "labels", "domain_concept", "class_concepts"}
    assert set(metadata) == {f"fedbip.{field}" for field in PayloadMeta.model_fields}
    assert json.loads(metadata["fedbip.class_names"]) == list(CLASSES)
    assert json.loads(metadata["fedbip.timestep"]) == 981


def test_decode_accepts_bytearray_and_memoryview(blob: bytes) -> None:
    assert_same(decode_payload(bytearray(blob)), decode_payload(memoryview(blob)))


# --- malformed blobs ----------------------------------------------------------------------------


def _shift_offsets(header: dict[str, Any], name: str, delta: int) -> None:
    header[name]["data_offsets"] = [o + delta for o in header[name]["data_offsets"]]


def _last_tensor(header: dict[str, Any]) -> str:
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    return max(tensors, key=lambda k: tensors[k]["data_offsets"][1])


def _second_tensor(header: dict[str, Any]) -> str:
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    return sorted(tensors, key=lambda k: tensors[k]["data_offsets"][0])[1]


def _without(metadata: dict[str, str], key: str) -> dict[str, str]:
    return {k: v for k, v in metadata.items() if k != key}


MALFORMED: dict[str, tuple[Callable[[], bytes], str]] = {
    "empty": (lambda: b"", "only 0 bytes"),
    "seven bytes": (lambda: b"\x01" * 7, "8-byte header length"),
    "huge header length": (lambda: struct.pack("<Q", 2**63) + b"{}", "exceeds"),
    "header length past end": (lambda: struct.pack("<Q", 100) + b"{}", "past the end"),
    "non-json header": (lambda: with_header(b"not json at all"), "not valid JSON"),
    "non-utf8 header": (lambda: with_header(b"\xff\xfe{}"), "UTF-8"),
    "nan literal in header": (lambda: with_header(b'{"x": NaN}'), "not valid JSON"),
    "deeply nested header": (lambda: with_header(b"[" * 100_000), "not valid JSON"),
    "header is a list": (lambda: with_header([1, 2]), "JSON array"),
    "header is a string": (lambda: with_header("latents"), "JSON string"),
    "duplicate key": (lambda: with_header(b'{"a": 1, "a": 2}'), "duplicate key"),
    "metadata not an object": (lambda: with_header({"__metadata__": [1]}), "__metadata__"),
    "metadata value not a string": (
        lambda: with_header({"__metadata__": {"fedbip.n_s": 1}}),
        "metadata values are strings",
    ),
    "entry not an object": (lambda: with_header({"latents": [0, 1]}), "header entry 'latents'"),
    "unhashable dtype": (
        lambda: with_header({"latents": {"dtype": [], "shape": [1], "data_offsets": [0, 4]}}),
        "dtype",
    ),
    "bool in shape": (
        lambda: with_header({"latents": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}),
        "invalid shape",
    ),
    "negative offsets": (
        lambda: with_header({"latents": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}),
        "data_offsets",
    ),
    "unsupported dtype": (lambda: raw_blob(labels=torch.zeros(N, dtype=torch.int32)), "'I32'"),
    "labels float": (lambda: raw_blob(labels=torch.zeros(N)), "labels must be int64"),
    "concepts float16": (
        lambda: raw_blob(domain_concept=torch.zeros(1, D, dtype=torch.float16)),
        "domain_concept must be float32",
    ),
    "latents dtype disagrees with meta": (
        lambda: raw_blob(latents=torch.zeros(N, *LATENT_SHAPE, dtype=torch.float16)),
        "latent_dtype",
    ),
    "latents wrong shape": (lambda: raw_blob(latents=torch.zeros(N, 4, 8, 7)), "latents has shape"),
    "latents wrong count": (lambda: raw_blob(latents=torch.zeros(N + 1, 4, 8, 8)), "latents has"),
    "labels wrong shape": (
        lambda: raw_blob(labels=torch.zeros(N - 1, dtype=torch.int64)),
        "labels has shape",
    ),
    "class concepts wrong class count": (
        lambda: raw_blob(class_concepts=torch.zeros(2, 2, D)),
        "class_concepts has shape",
    ),
    "concept dims disagree": (
        lambda: raw_blob(class_concepts=torch.zeros(3, 2, D + 1)),
        "class_concepts has shape",
    ),
    "domain concept 1-d": (lambda: raw_blob(domain_concept=torch.zeros(D)), "(n_s, d)"),
    "nan latents": (
        lambda: raw_blob(latents=torch.full((N, *LATENT_SHAPE), float("nan"))),
        "latents contain NaN or Inf",
    ),
    "inf class concepts": (
        lambda: raw_blob(class_concepts=torch.full((3, 2, D), float("inf"))),
        "class_concepts contain NaN or Inf",
    ),
    "label out of range": (
        lambda: raw_blob(labels=torch.tensor([0, 1, 2, 3, 0, 1])),
        "labels must lie in [0, 3)",
    ),
    "negative label": (
        lambda: raw_blob(labels=torch.tensor([0, 1, -1, 2, 0, 1])),
        "found -1",
    ),
    "schema version 2": (lambda: raw_blob(meta_strings(schema_version=2)), "schema version 2"),
    "schema version as string": (
        lambda: raw_blob(meta_strings(schema_version="1")),
        "schema version '1'",
    ),
    "schema version as bool": (
        lambda: raw_blob(meta_strings(schema_version=True)),
        "schema version True",
    ),
    "no metadata": (lambda: raw_blob({}), "missing 'fedbip.schema_version'"),
    "meta missing a field": (
        lambda: raw_blob(_without(meta_strings(), "fedbip.domain")),
        "missing ['fedbip.domain']",
    ),
    "meta unknown key": (lambda: raw_blob({**meta_strings(), "format": "pt"}), "unknown key"),
    "meta value not json": (
        lambda: raw_blob({**meta_strings(), "fedbip.n_s": "one"}),
        "'fedbip.n_s' is not valid JSON",
    ),
    "meta value out of range": (lambda: raw_blob(meta_strings(n_s=0)), "'fedbip.n_s'"),
    "meta value wrong type": (lambda: raw_blob(meta_strings(timestep="981")), "'fedbip.timestep'"),
    "meta template without slot": (
        lambda: raw_blob(meta_strings(prompt_template="a {V}")),
        "prompt_template must contain {S}",
    ),
    "meta duplicate class names": (
        lambda: raw_blob(meta_strings(class_names=["cat", "cat", "dog"])),
        "unique",
    ),
    "meta bad concept space": (
        lambda: raw_blob(meta_strings(concept_space="pixels")),
        "'fedbip.concept_space'",
    ),
    "client id with a path": (
        lambda: raw_blob(meta_strings(client_id="../../etc/passwd")),
        "'fedbip.client_id'",
    ),
    "client id hidden file": (lambda: raw_blob(meta_strings(client_id=".x")), "'fedbip.client_id'"),
    "client id too long": (lambda: raw_blob(meta_strings(client_id="x" * 49)), "'fedbip.client_id'"),
    "meta num_examples disagrees": (lambda: raw_blob(meta_strings(num_examples=5)), "num_examples=5"),
    "extra tensor": (
        lambda: raw_blob(extra=torch.zeros(1)),
        "unexpected tensor(s) ['extra']: expected ['latents', 'labels', 'domain_concept', "
        "'class_concepts'], found ['class_concepts', 'domain_concept', 'extra', 'labels', 'latents']",
    ),
    "missing tensor": (
        lambda: safetensors.torch.save(
            {k: v for k, v in make_payload().tensors().items() if k != "labels"}, meta_strings()
        ),
        "missing tensor(s) ['labels']: expected ['latents', 'labels', 'domain_concept', "
        "'class_concepts'], found ['class_concepts', 'domain_concept', 'latents']",
    ),
    "offsets past the end": (
        lambda: edit_header(lambda h: _shift_offsets(h, _last_tensor(h), 8)),
        "leaves a gap",
    ),
    "overlapping offsets": (
        lambda: edit_header(lambda h: _shift_offsets(h, _second_tensor(h), -8)),
        "overlaps",
    ),
    "shape disagrees with offsets": (
        lambda: edit_header(lambda h: h["labels"].update(shape=[N + 1])),
        "needs 56 bytes",
    ),
    "trailing bytes": (lambda: encode_payload(make_payload()) + b"\0" * 8, "padded"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_malformed_blob_is_rejected_with_reason(case: str) -> None:
    build, reason = MALFORMED[case]
    with pytest.raises(PayloadError) as info:
        decode_payload(build())
    assert reason in info.value.reason
    assert str(info.value).startswith("payload rejected: ")


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.3, 0.6, 0.9, 0.999])
def test_truncated_blob_is_rejected(blob: bytes, fraction: float) -> None:
    with pytest.raises(PayloadError, match="truncated"):
        decode_payload(blob[: int(len(blob) * fraction)])


def test_oversize_blob_is_rejected_before_parsing(blob: bytes) -> None:
    with pytest.raises(PayloadError, match="above the cap"):
        decode_payload(blob, max_bytes=len(blob) - 1)
    with pytest.raises(PayloadError, match="above the cap"):
        decode_payload(blob, make_expectations(max_bytes=len(blob) - 1))
    with pytest.raises(PayloadError, match="above the cap"):  # garbage, yet refused on size
        decode_payload(b"\xff" * 100, max_bytes=99)


def test_non_bytes_input_is_rejected() -> None:
    with pytest.raises(PayloadError, match="expected bytes"):
        decode_payload("not bytes")  # type: ignore[arg-type]


def test_header_length_limit_is_configurable(blob: bytes) -> None:
    with pytest.raises(PayloadError, match="exceeds the 16-byte limit"):
        read_header(blob, max_header_bytes=16)


# --- expectations -------------------------------------------------------------------------------


def test_base_model_mismatch_message() -> None:
    with pytest.raises(PayloadError) as info:
        decode_payload(encode_payload(make_payload()), make_expectations(base_model="cd34"))
    assert str(info.value) == (
        "payload rejected: base model fingerprint 'ab12' does not match the server's 'cd34' "
        "(client and server must load the same LDM)"
    )


EXPECTATION_MISMATCHES: dict[str, tuple[dict[str, Any], str]] = {
    "prompt template": ({"prompt_template": "a photo of a {V} in {S}"}, "prompt template"),
    "class names reordered": ({"class_names": ("dog", "cat", "fish")}, "class names"),
    "class names other": ({"class_names": ("cat", "dog")}, "class names"),
    "timestep": ({"timestep": 961}, "timestep 981"),
    "latent shape": ({"latent_shape": (4, 16, 16)}, "latent shape (4, 8, 8)"),
    "concept dim": ({"concept_dim": 768}, "concept dimension 32"),
    "steps": ({"num_inference_steps": 25}, "num_inference_steps"),
    "scheduler": ({"scheduler": "DDIMScheduler"}, "scheduler"),
    "n_s": ({"n_s": 2}, "n_s 1"),
    "n_v": ({"n_v": 1}, "n_v 2"),
    "concept space": ({"concept_space": "hidden"}, "concept space"),
    "domain": ({"domains": ("painting",)}, "domain 'sketch' is not one of the server's domains"),
}


@pytest.mark.parametrize("case", EXPECTATION_MISMATCHES, ids=list(EXPECTATION_MISMATCHES))
def test_expectation_mismatch_is_rejected(blob: bytes, case: str) -> None:
    overrides, reason = EXPECTATION_MISMATCHES[case]
    with pytest.raises(PayloadError) as info:
        decode_payload(blob, make_expectations(**overrides))
    assert reason in info.value.reason
    assert "the server's" in info.value.reason


# --- encoder refuses inconsistent payloads ------------------------------------------------------


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        ({"latents": torch.full((N, *LATENT_SHAPE), float("-inf"))}, "latents contain NaN"),
        ({"labels": torch.full((N,), 7)}, "labels must lie in"),
        ({"domain_concept": torch.zeros(2, D)}, "domain_concept has shape"),
        ({"class_concepts": torch.zeros(3, 2, D).numpy()}, "must be a torch.Tensor"),
    ],
)
def test_encode_refuses_inconsistent_payload(tensors: dict[str, Any], reason: str) -> None:
    with pytest.raises(PayloadError, match=reason):
        encode_payload(make_payload(**tensors))


# --- files --------------------------------------------------------------------------------------


def test_save_is_atomic_and_readable_by_plain_safetensors(tmp_path: Path) -> None:
    original = make_payload(latent_dtype="float16")
    path = save_payload(original, tmp_path / "client.safetensors")
    assert os.listdir(tmp_path) == ["client.safetensors"]
    assert path.stat().st_mode & 0o777 == 0o600
    with safe_open(path, framework="pt") as handle:
        assert set(handle.keys()) == {"latents", "labels", "domain_concept", "class_concepts"}
        assert json.loads(handle.metadata()["fedbip.domain"]) == "sketch"
        assert torch.equal(handle.get_tensor("latents"), original.latents)
    assert_same(original, load_payload(path))


def test_save_bytes_overwrites_and_keeps_them_verbatim(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "client.safetensors"
    path.write_bytes(b"old")
    save_payload(blob, path)
    assert path.read_bytes() == blob
    assert os.listdir(tmp_path) == ["client.safetensors"]


def test_failed_save_leaves_old_file_and_no_temp(
    tmp_path: Path, blob: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "client.safetensors"
    path.write_bytes(blob)
    with pytest.raises(PayloadError):
        save_payload(make_payload(labels=torch.full((N,), -5)), path)

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        save_payload(make_payload(seed=1), path)
    assert path.read_bytes() == blob
    assert os.listdir(tmp_path) == ["client.safetensors"]


def test_load_checks_size_before_reading_and_reports_missing_file(tmp_path: Path) -> None:
    path = save_payload(make_payload(), tmp_path / "client.safetensors")
    with pytest.raises(PayloadError, match="above the cap"):
        load_payload(path, max_bytes=100)
    with pytest.raises(FileNotFoundError):
        load_payload(tmp_path / "missing.safetensors")


# --- helpers ------------------------------------------------------------------------------------


def test_summarize_reports_every_tensor() -> None:
    payload = make_payload()
    rows = {row["name"]: row for row in summarize(payload)}
    assert list(rows) == ["latents", "labels", "domain_concept", "class_concepts"]
    assert rows["latents"]["shape"] == [N, *LATENT_SHAPE]
    assert rows["labels"]["dtype"] == "int64"
    assert rows["labels"]["mean"] == pytest.approx(1.0)
    assert rows["domain_concept"]["std"] == pytest.approx(
        float(payload.domain_concept.double().std(correction=0))
    )


def test_payload_error_survives_pickling() -> None:
    err = pickle.loads(pickle.dumps(PayloadError("labels out of range")))
    assert err.reason == "labels out of range"
    assert str(err) == "payload rejected: labels out of range"
    too_large = PayloadTooLarge("9 bytes", 8)
    copy = pickle.loads(pickle.dumps(too_large))
    assert (type(copy), copy.amount, copy.limit, str(copy)) == (PayloadTooLarge, "9 bytes", 8, str(too_large))

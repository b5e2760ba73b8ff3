"""The payload format: exact round trips, and rejection of every malformed or mismatched blob.

Payloads arrive from the network, so the contract under test is strict: any bytes either decode
to a valid :class:`Payload` or raise :class:`PayloadError` with an actionable reason, never
another exception. Test payloads are small random tensors (N=6, latents 4x8x8, d=32, 3 classes).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from fedbip_flwr.payload import (
    Payload,
    PayloadMeta,
    decode_payload,
    encode_payload,
    load_payload,
)
from fedbip_flwr.upload import (
    PayloadError,
    PayloadTooLarge,
    encode_tensors,
    read_header,
    read_tensors,
)
from fedbip_tools.cli import tensor_summary
from tests.helpers import (
    LATENT_SHAPE,
    MALFORMED,
    PAYLOAD_CLASSES,
    D,
    N,
    make_expectations,
    make_payload,
    save_payload,
)

# --- factories ----------------------------------------------------------------------------------


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
        "import sys; from tests.helpers import make_payload; "
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
    assert json.loads(metadata["fedbip.class_names"]) == list(PAYLOAD_CLASSES)
    assert json.loads(metadata["fedbip.timestep"]) == 981


def test_decode_accepts_bytearray_and_memoryview(blob: bytes) -> None:
    assert_same(decode_payload(bytearray(blob)), decode_payload(memoryview(blob)))


# --- malformed blobs ----------------------------------------------------------------------------


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


def test_implausible_payload_is_refused_only_against_the_servers_model() -> None:
    """Moments need the server's noise schedule and concept scale: without them (``fedbip
    inspect``, or Expectations with no plausibility) a well-formed upload passes."""
    loud = encode_payload(make_payload(latents=50 * torch.randn(N, *LATENT_SHAPE)))
    decode_payload(loud)
    decode_payload(loud, make_expectations(plausibility=None))
    with pytest.raises(
        PayloadError,
        match=r"^payload rejected: latents\[0\] has std [45]\d\.\d+ \(as do 5 more of the 6",
    ):
        decode_payload(loud, make_expectations())
    small = encode_payload(make_payload(domain_concept=1e-4 * torch.randn(1, D)))
    with pytest.raises(
        PayloadError,
        match=r"^payload rejected: domain_concept\[0\] \(S\) has RMS [\d.e-]+, outside \[0\.0999, 2\.46\]",
    ):
        decode_payload(small, make_expectations())


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


def test_inspect_summarizes_every_tensor() -> None:
    payload = make_payload()
    rows = {name: tensor_summary(name, t) for name, t in payload.tensors().items()}
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
    assert (type(copy), copy.amount, copy.limit, str(copy)) == (
        PayloadTooLarge,
        "9 bytes",
        8,
        str(too_large),
    )


# --- the class-clusters key -----------------------------------------------------------------------


def _with_metadata(blob: bytes, change) -> bytes:
    tensors, metadata = read_tensors(blob, tuple(read_header(blob)[0]), 2**30, "fedbip")
    change(metadata)
    return encode_tensors(tensors, metadata)


def test_a_payload_written_before_class_clusters_existed_means_one_concept_per_class(
    blob: bytes,
) -> None:
    old = _with_metadata(blob, lambda m: m.pop("fedbip.class_clusters"))
    assert decode_payload(old).meta.class_clusters == 1


def test_an_absurd_class_cluster_count_is_refused_before_any_work(blob: bytes) -> None:
    huge = _with_metadata(blob, lambda m: m.update({"fedbip.class_clusters": str(10**15)}))
    with pytest.raises(PayloadError, match="class_clusters"):
        decode_payload(huge)

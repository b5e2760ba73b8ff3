"""What left an institution (issue 91): the record its ClientApp keeps of every upload, the
membership figures it quotes, and ``fedbip inspect`` showing the same for a file."""

from __future__ import annotations

import hashlib
import json
import statistics

import pytest
import torch
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client_app import app as client_app
from fedbip_flwr.payload import Payload, encode_payload
from fedbip_flwr.policy import UploadKind
from fedbip_flwr.upload_record import MEMBERSHIP, Measured, UploadRecord, describe, record_lines
from fedbip_flwr.wire import PAYLOAD_RECORD, train_content
from fedbip_tools.cli import main, project_run_config
from tests.helpers import METHOD_CFG, PAYLOAD_CLASSES, ROOT, D, make_meta

BENCHMARKS = ROOT / "benchmarks"


def recomputed(entry: Measured) -> tuple[float, float]:
    """The entry's figure from its records: per domain, the best of its tests' attacks, each
    attack's AUC averaged over the records (seeds) that hold its setting; then the range over
    the domains. The records' own latent shape, where they state one, must be the entry's."""
    records = [json.loads((BENCHMARKS / name).read_text())["results"] for name in entry.records]
    best: dict[str, float] = {}
    for setting, prefix in entry.tests:
        for domain in sorted({d for r in records for d in r if setting in r[d]}):
            holding = [r[domain][setting] for r in records if setting in r.get(domain, {})]
            for found in holding:
                assert found.get("latent_shape", list(entry.latent_shape)) == list(
                    entry.latent_shape
                ), (entry.what, setting)
            attacks = {name for h in holding for name in h["attacks"] if name.startswith(prefix)}
            assert attacks, (entry.what, setting, prefix)
            for name in attacks:
                mean = statistics.fmean(h["attacks"][name]["auc"] for h in holding)
                best[domain] = max(best.get(domain, 0.0), mean)
    assert sorted(best) == ["painting", "quickdraw", "sketch"], entry.what
    return round(min(best.values()), 2), round(max(best.values()), 2)


@pytest.mark.parametrize(
    "entry", MEMBERSHIP.values(), ids=lambda m: f"{m.kind}-{m.latent_shape}-{m.epsilon}"
)
def test_every_membership_figure_is_what_its_records_say(entry: Measured):
    assert recomputed(entry) == entry.auc


EARLIEST_MODEL = "cc5d681c07eb"  # the model of every record made before records named theirs


@pytest.mark.parametrize(
    "entry", MEMBERSHIP.values(), ids=lambda m: f"{m.kind}-{m.latent_shape}-{m.epsilon}"
)
def test_every_membership_figure_names_the_model_its_records_ran(entry: Measured):
    models = {
        json.loads((BENCHMARKS / name).read_text()).get("provenance", {}).get("model")
        or EARLIEST_MODEL
        for name in entry.records
    }
    assert len(models) == 1, (entry.what, models)
    assert entry.what.endswith(f", model {models.pop()}"), entry.what


def payload_at(latent_shape: list[int]) -> bytes:
    meta = make_meta(latent_shape=latent_shape)
    return encode_payload(
        Payload(
            latents=torch.randn(6, *latent_shape),
            labels=torch.arange(6) % len(PAYLOAD_CLASSES),
            domain_concept=torch.randn(meta.n_s, D),
            class_concepts=torch.randn(len(PAYLOAD_CLASSES), meta.n_v, D),
            meta=meta,
        )
    )


def test_inspect_shows_what_an_institution_records(tmp_path, capsys):
    """A FedBiP payload at the miniature's latent size: its digest, kinds, no guarantee, and
    the records' figure for its z(T)."""
    blob = payload_at([4, 16, 16])
    path = tmp_path / "upload.safetensors"
    path.write_bytes(blob)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    record = describe(blob)
    assert record.sha256 == hashlib.sha256(blob).hexdigest()
    assert record.kinds == (UploadKind.CONCEPTS, UploadKind.COUNTS, UploadKind.LATENTS)
    assert record.dp == "none"
    lines = record_lines(record)
    assert all(line in out for line in lines), "\n".join(out)
    assert f"upload: fedbip from partition-0, {len(blob)} bytes, sha256 {record.sha256}" in out
    assert "DP guarantee: none" in out
    assert any(line.startswith("  latents: AUC 0.62-0.66 (FedBiP's z(T)") for line in out)
    assert "  counts: no record at this latent size and guarantee" in out


def test_an_upload_is_recorded_in_the_institutions_own_folder_as_it_leaves(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The ClientApp's own train step of a simulated partition: the record's digest is the
    digest of the bytes in its reply."""
    for field in ("_task_id", "_run_id", "_node_id"):  # what a SuperNode's runtime sets
        monkeypatch.setattr(TaskIdentity, field, 1)
    run = {
        **project_run_config(),
        **METHOD_CFG,
        "ldm.model": str(tiny_model_dir),
        "output-dir": str(tmp_path / "server"),
    }
    node = {"partition-id": 0, "num-partitions": 3, "output-dir": str(tmp_path / "own")}
    context = Context(run_id=7, node_id=1, node_config=node, state=RecordDict(), run_config=run)
    message = Message(content=train_content([]), dst_node_id=1, message_type=MessageType.TRAIN)
    reply = client_app.train(message, context)
    blob = bytes(reply.content.array_records[PAYLOAD_RECORD]["safetensors"].data)
    kept = tmp_path / "own" / "institutions" / "sketch-0" / "uploads.jsonl"
    [line] = kept.read_text().splitlines()
    record = UploadRecord.model_validate_json(line)
    assert record.sha256 == hashlib.sha256(blob).hexdigest()
    assert (record.method, record.client_id, record.bytes) == ("fedbip", "sketch-0", len(blob))
    assert record.run_id == 1 and record.time is not None  # the run of the message it answers
    assert record.dp == "none" and record.latent_shape == (4, 16, 16)
    figures = {m.kind: m.auc for m in record.membership}
    assert figures == {
        UploadKind.CONCEPTS: (0.55, 0.72),
        UploadKind.COUNTS: None,
        UploadKind.LATENTS: (0.62, 0.66),
    }
    assert not (tmp_path / "server").exists(), "the record stays in the institution's folder"

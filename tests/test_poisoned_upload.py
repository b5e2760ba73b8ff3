"""A poisoned upload through the real `flwr run`: refused for plausibility, the rest carry on.

Three SuperNodes run the project's own ClientApp, wrapped so that partition 1 (quickdraw)
multiplies the z(T) of the payload it computed by 50 before sending it: a well-formed upload
that, accepted, would turn a third of the training set into noise. The wrapper lives in a
temporary copy of the project; the product has no poisoning option.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedbip_flwr import results
from fedbip_flwr.results import Scored
from fedbip_flwr.server import RunFolder
from fedbip_flwr.storage import read_metadata
from tests.helpers import SMALL, as_run_config, make_wrapper_app, run_to_end

pytestmark = pytest.mark.long(minutes=1.0)

POISONED = {**SMALL, "federation.min-clients": 2, "run-name": '"poisoned"'}

POISONING_CLIENT = '''
"""The project's ClientApp; partition 1 scales the z(T) of its upload by 50 before sending."""
from dataclasses import replace

from flwr.app import Message
from flwr.clientapp import ClientApp

from client_app.app import evaluate as project_evaluate
from client_app.app import train as project_train
from fedbip_flwr.payload import decode_payload, encode_payload
from fedbip_flwr.wire import payload_bytes, payload_content, reply_metrics

app = ClientApp()


@app.train()
def train(msg, context):
    reply = project_train(msg, context)
    if int(context.node_config["partition-id"]) != 1:
        return reply
    payload = decode_payload(payload_bytes(reply, 2**40))
    poisoned = replace(payload, latents=payload.latents * 50)
    content = payload_content(encode_payload(poisoned), reply_metrics(reply), payload.meta.client_id)
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg, context):
    return project_evaluate(msg, context)
'''


@pytest.fixture(scope="module")
def poisoned_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict:
    """This tree's packages under a ClientApp that poisons one upload (the FAB carries them, so
    the run tests this tree's ServerApp, not whatever fedbip-flwr is installed)."""
    base = tmp_path_factory.mktemp("poisoned")
    app = make_wrapper_app(
        base / "app", {"poisoning_client": POISONING_CLIENT}, "poisoning_client:app"
    )
    out = base / "out"
    out.mkdir()
    values = {**POISONED, "ldm.model": f'"{tiny_model_dir}"', "output-dir": f'"{out}"'}
    status, log = run_to_end(base / "home", as_run_config(values), app)
    return {"status": status, "log": log, "folder": RunFolder(out / "poisoned")}


def test_the_poisoned_upload_is_refused_for_its_latents(poisoned_run: dict) -> None:
    assert poisoned_run["status"] == "finished:completed", poisoned_run["log"][-4000:]
    folder = poisoned_run["folder"]
    record = results.read(folder.metrics)
    rejected = [c for c in record.clients if c.status == "rejected"]
    assert len(rejected) == 1, record.clients
    reason = rejected[0].reason
    honest_T = read_metadata(folder.payload_path("sketch-0"))["fedbip.timestep"]  # the run's T
    # 36 latents: 6 classes x 3 shots x 2 z(T) per image
    assert re.match(
        r"payload rejected: latents\[0\] has std \d+\.\d+ \(as do 35 more of the 36 "
        rf"latents\), outside \[0\.\d+, 1\.\d+\] that z\(T\) at timestep {honest_T} can have "
        r"\(an honest z\(T\) is ",
        reason,
    ), reason
    assert results.read_clients(folder.clients) == record.clients
    assert sorted(p.name for p in folder.payloads.iterdir()) == [
        "painting-0.safetensors",
        "sketch-0.safetensors",
    ]


def test_the_federation_completes_with_the_two_honest_clients(poisoned_run: dict) -> None:
    folder = poisoned_run["folder"]
    record = results.read(folder.metrics)
    assert record.status == "completed"
    accepted = sorted(c.client_id for c in record.clients if c.status == "accepted")
    assert accepted == ["painting-0", "sketch-0"]
    assert set(record.accuracy.per_domain) == {"sketch", "painting"}
    assert all(0.0 <= acc <= 1.0 for acc in record.accuracy.per_domain.values())
    # two clients x 6 classes x 3 shots x 2 z(T) per image, one pass each
    assert record.accuracy.num_synthetic_images == 2 * 6 * 3 * 2
    assert folder.classifier.stat().st_size > 1_000_000
    per_client = record.evaluation.per_client
    for client in ("sketch-0", "painting-0"):
        assert isinstance(per_client[client], Scored), per_client

"""Bad input and faults at the server: every malformed upload is refused with a reason, none crash it.

Malformed uploads (structured cases, each with the reason it must be refused for, and seeded
random ones) travel in real Flower replies, deflated into Flower's wire objects and inflated
again as the ServerApp's grid does, through ``OneShotStrategy.aggregate_train`` in one batch with
valid uploads, which must still be accepted and persisted. Two real `flwr run`s check what a
user sees: a client uploading a payload made for another base model is refused, the reason is
in metrics.json and clients.json, and the run completes with the other two; a bad run config
fails the run with one sentence before any client is contacted.
"""

from __future__ import annotations

import json
import random
import struct
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.app.metadata import Metadata
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.task_identity import TaskIdentity

from fedbip_flwr import results
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.methods.fedbip import as_upload
from fedbip_flwr.payload import Payload, decode_payload, encode_payload
from fedbip_flwr.results import ClientOutcome, Evaluation, Scored, Unscored
from fedbip_flwr.server import RunFolder
from fedbip_flwr.strategy import OneShotStrategy, ScoreBounds
from fedbip_flwr.upload import MAX_HEADER_BYTES
from fedbip_flwr.wire import (
    BLOB_ARRAY,
    BLOB_STYPE,
    METRICS_RECORD,
    PAYLOAD_RECORD,
    payload_content,
    skipped_content,
)
from tests.helpers import (
    LATENT_SHAPE,
    MALFORMED,
    RECORDING_CLIENT,
    SMALL,
    D,
    N,
    as_run_config,
    make_expectations,
    make_meta,
    make_payload,
    make_wrapper_app,
    meta_strings,
    raw_blob,
    received,
    run_to_end,
    split_blob,
    with_header,
)

pytestmark = pytest.mark.long(minutes=1.4)

SERVER = make_expectations(max_bytes=3 * 2**20)  # room for an over-long header below the cap
METRICS = {"num-examples": N}


def upload(blob: bytes) -> RecordDict:
    return payload_content(blob, METRICS, "fuzz")


def valid_blob(client_id: str, domain: str, seed: int) -> bytes:
    return encode_payload(
        replace(make_payload(seed=seed), meta=make_meta(client_id=client_id, domain=domain))
    )


VALID = {
    "sketch-0": valid_blob("sketch-0", "sketch", 1),
    "painting-0": valid_blob("painting-0", "painting", 2),
}


def for_another_server(tensors: dict[str, torch.Tensor] | None = None, **meta: Any) -> RecordDict:
    """A payload that is valid on its own but was made under another base model or config."""
    payload = make_payload()
    return upload(
        encode_payload(Payload(**{**payload.tensors(), **(tensors or {})}, meta=make_meta(**meta)))
    )


def raw_array(
    data: bytes,
    *,
    dtype: str = "uint8",
    shape: tuple[int, ...] | None = None,
    stype: str = BLOB_STYPE,
) -> RecordDict:
    """A payload record whose Array fields a client chose freely: Flower does not check them."""
    array = Array(dtype=dtype, shape=shape or (len(data),), stype=stype, data=data)
    return RecordDict({PAYLOAD_RECORD: ArrayRecord({BLOB_ARRAY: array})})


def _duplicate_tensor_entry() -> bytes:
    header, data = split_blob(VALID["sketch-0"])
    text = json.dumps(header)
    entry = f'"latents": {json.dumps(header["latents"])}, '
    return with_header(text.replace('{"', "{" + entry + '"', 1).encode(), data)


def _header_length(blob: bytes, delta: int) -> bytes:
    size = struct.unpack("<Q", blob[:8])[0]
    return struct.pack("<Q", size + delta) + blob[8:]


CAP = SERVER.max_bytes
STRUCTURED: dict[str, tuple[Callable[[], RecordDict], str]] = {
    **{
        f"blob: {name}": (lambda build=build: upload(build()), reason)
        for name, (build, reason) in MALFORMED.items()
    },
    # valid payloads that do not fit this server
    "wrong T": (lambda: for_another_server(timestep=961), "timestep 961 does not match"),
    "wrong base model": (
        lambda: for_another_server(base_model="ffff"),
        "base model fingerprint 'ffff'",
    ),
    "wrong scheduler": (lambda: for_another_server(scheduler="DDIMScheduler"), "scheduler"),
    "wrong step count": (
        lambda: for_another_server(num_inference_steps=25),
        "num_inference_steps 25",
    ),
    "classes reordered": (
        lambda: for_another_server(class_names=["dog", "cat", "fish"]),
        "class names ('dog'",
    ),
    "other prompt": (
        lambda: for_another_server(prompt_template="a photo of a {V} in {S}"),
        "prompt template",
    ),
    "other concept space": (lambda: for_another_server(concept_space="hidden"), "concept space"),
    "domain not served": (
        lambda: for_another_server(domain="quickdraw"),
        "domain 'quickdraw' is not one of",
    ),
    "other n_v": (
        lambda: for_another_server({"class_concepts": torch.zeros(3, 1, D)}, n_v=1),
        "n_v 1",
    ),
    "other latent shape": (
        lambda: for_another_server(
            {"latents": torch.zeros(N, 4, 16, 16)}, latent_shape=[4, 16, 16]
        ),
        "latent shape (4, 16, 16)",
    ),
    "other concept dim": (
        lambda: for_another_server(
            {"domain_concept": torch.zeros(1, D + 1), "class_concepts": torch.zeros(3, 2, D + 1)}
        ),
        f"concept dimension {D + 1}",
    ),
    # hostile bytes beyond the decoder's own table
    "float64 latents": (
        lambda: upload(raw_blob(latents=torch.zeros(N, *LATENT_SHAPE, dtype=torch.float64))),
        "'F64'",
    ),
    "bool labels": (lambda: upload(raw_blob(labels=torch.zeros(N, dtype=torch.bool))), "'BOOL'"),
    "duplicate tensor entry": (
        lambda: upload(_duplicate_tensor_entry()),
        "duplicate key 'latents'",
    ),
    "over-long header": (
        lambda: upload(raw_blob({**meta_strings(), "pad": "x" * MAX_HEADER_BYTES})),
        f"exceeds the {MAX_HEADER_BYTES}-byte limit",
    ),
    "header length understated": (
        lambda: upload(_header_length(VALID["sketch-0"], -9)),
        "not valid JSON",
    ),
    "header length overstated": (lambda: upload(_header_length(VALID["sketch-0"], 8)), "not valid"),
    "header is null": (lambda: upload(with_header(b"null")), "JSON null"),
    "metadata is null": (lambda: upload(with_header({"__metadata__": None})), "__metadata__"),
    "cut by one byte": (lambda: upload(VALID["sketch-0"][:-1]), "truncated"),
    # the Flower record around the bytes
    "empty reply": (lambda: RecordDict({}), "carries no FedBiP payload"),
    "metrics only": (
        lambda: RecordDict({METRICS_RECORD: MetricRecord(METRICS)}),
        "carries no FedBiP payload",
    ),
    "payload under another name": (
        lambda: RecordDict({PAYLOAD_RECORD: ArrayRecord({"other": Array(torch.zeros(3))})}),
        "carries no FedBiP payload",
    ),
    "numpy array, not raw bytes": (
        lambda: RecordDict({PAYLOAD_RECORD: ArrayRecord({BLOB_ARRAY: Array(torch.zeros(3))})}),
        "stype",
    ),
    "float32 array": (lambda: raw_array(bytes(8), dtype="float32", shape=(2,)), "1-D uint8"),
    "2-d array": (lambda: raw_array(bytes(8), shape=(2, 4)), "1-D uint8"),
    "shape understates the bytes": (
        lambda: raw_array(VALID["sketch-0"], shape=(100,)),
        "declares 100 bytes but carries",
    ),
    # oversize: garbage refused on size alone shows the cap is applied before any parsing
    "oversize garbage": (lambda: raw_array(b"\xff" * (CAP + 1)), "above the cap"),
    "oversize behind a small shape": (
        lambda: raw_array(b"\xff" * (CAP + 1), shape=(8,)),
        "above the cap",
    ),
    "oversize declared": (lambda: raw_array(b"\xff" * 8, shape=(CAP + 1,)), "above the cap"),
    "second upload of a client": (lambda: upload(VALID["sketch-0"]), "already accepted"),
}


def over_the_wire(node: int, content: RecordDict | Error) -> Message:
    """A train reply from ``node`` as the ServerApp's grid hands it over.

    The message is deflated into Flower's content-addressed objects (arrays in chunks) and
    inflated again, so whatever a client put in its Array arrives as Flower delivers it.
    """
    metadata = Metadata(
        run_id=1,
        message_id="",
        src_node_id=node,
        dst_node_id=SUPERLINK_NODE_ID,
        reply_to_message_id=f"train-{node}",
        group_id="1",
        created_at=time.time(),
        ttl=3600,
        message_type=MessageType.TRAIN,
    )
    message = Message(content, metadata=metadata)
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    return inflate_object_from_contents(message.object_id, contents)


def one_round(folder: Path, contents: list[RecordDict | Error]) -> dict[int, ClientOutcome]:
    """Replies 1..n for ``contents`` plus node n+1, which never replies; outcomes by node."""
    strategy = OneShotStrategy(
        lambda blob: as_upload(decode_payload(blob, SERVER)),
        CAP,
        RunFolder(folder),
        min_clients=1,
        wait_for_clients_s=1,
    )
    strategy.sent_to = list(range(1, len(contents) + 2))  # what configure_train records
    strategy.aggregate_train(1, [over_the_wire(n, c) for n, c in enumerate(contents, start=1)])
    strategy.finish_round()
    return {outcome.node_id: outcome for outcome in strategy.outcomes}


def assert_valid_uploads_kept(folder: Path, outcomes: dict[int, ClientOutcome]) -> None:
    """Nodes 1 and 2 sent VALID: accepted, and on disk byte for byte, beside nothing half-written."""
    for node, (client_id, blob) in enumerate(VALID.items(), start=1):
        assert (outcomes[node].status, outcomes[node].client_id) == ("accepted", client_id)
        assert RunFolder(folder).payload_path(client_id).read_bytes() == blob
    accepted = {o.client_id for o in outcomes.values() if o.status == "accepted"}
    stored = sorted(p.name for p in RunFolder(folder).payloads.iterdir())
    assert stored == sorted(f"{c}.safetensors" for c in accepted)


def test_every_structured_bad_upload_is_refused_with_its_reason(tmp_path):
    cases = list(STRUCTURED.items())
    crashed = Error(code=8, reason="ClientApp crashed")
    contents = [*map(upload, VALID.values()), *(build() for _, (build, _) in cases), crashed]
    outcomes = one_round(tmp_path, contents)
    assert len(cases) >= 50
    assert_valid_uploads_kept(tmp_path, outcomes)
    wrong = {}
    for node, (name, (_, reason)) in enumerate(cases, start=len(VALID) + 1):
        got = outcomes[node]
        if (
            got.status != "rejected"
            or not got.reason.startswith("payload rejected: ")
            or reason not in got.reason
        ):
            wrong[name] = (got.status, got.reason, reason)
    assert not wrong, json.dumps(wrong, indent=1)
    failed, missing = outcomes[len(contents)], outcomes[len(contents) + 1]
    assert failed.status == "failed" and "ClientApp crashed" in failed.reason
    assert missing.status == "missing"


# --- random uploads: seeded, anything but a PayloadError is a bug -------------------------------


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return rng.randint(-(2**64), 2**64)
    if kind == 1:
        return rng.uniform(-1e9, 1e9)
    if kind == 2:
        return "".join(rng.choice('aF3{}[]"\\ é') for _ in range(rng.randrange(8)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.choice(["F32", "F16", "I64", "latents", "__metadata__", [0, 8]])
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["latents", "labels", "dtype", "shape", "data_offsets", "__metadata__", "x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def _mutate_header(rng: random.Random, valid: bytes) -> bytes:
    """Replace one value somewhere in a valid header with random JSON."""
    header, data = split_blob(valid)
    node: Any = header
    path = [rng.choice(list(header))]
    while isinstance(node[path[-1]], dict) and rng.random() < 0.7:
        node = node[path[-1]]
        path.append(rng.choice(list(node)))
    node[path[-1]] = _random_json(rng)
    return with_header(header, data)


def _random_blobs() -> list[tuple[str, bytes]]:
    """Random bytes, truncations and random headers, which can never be valid, then bit flips
    and mutated headers of a valid payload, which rarely can (a flip inside a latent)."""
    rng = random.Random(20250101)
    valid = encode_payload(make_payload())
    header_end = 8 + struct.unpack("<Q", valid[:8])[0]
    blobs: list[tuple[str, bytes]] = []
    for i in range(15):
        body = rng.randbytes(rng.randrange(0, 3000))
        if i % 3 == 0:  # a plausible header length, so parsing gets further
            body = struct.pack("<Q", rng.randrange(0, len(body) + 16)) + body
        blobs.append((f"random-{i}", body))
    for i in range(10):
        blobs.append((f"truncate-{i}", valid[: rng.randrange(len(valid))]))
    for i in range(10):
        blobs.append((f"random-header-{i}", with_header(_random_json(rng), rng.randbytes(64))))
    for i in range(25):
        mutated = bytearray(valid)
        in_header = i % 2 == 0  # these keep the header ASCII, so JSON parsing gets further
        for _ in range(rng.randint(1, 8)):
            position = rng.randrange(header_end if in_header else len(valid))
            mutated[position] ^= 1 << rng.randrange(7 if in_header else 8)
        blobs.append((f"bitflip-{i}", bytes(mutated)))
    for i in range(15):
        blobs.append((f"mutated-header-{i}", _mutate_header(rng, valid)))
    return blobs


RANDOM = _random_blobs()


def test_random_uploads_never_crash_the_server(tmp_path):
    outcomes = one_round(tmp_path, [*map(upload, VALID.values()), *(upload(b) for _, b in RANDOM)])
    assert len(RANDOM) >= 50
    assert_valid_uploads_kept(tmp_path, outcomes)
    wrong, accepted = {}, []
    for node, (name, blob) in enumerate(RANDOM, start=len(VALID) + 1):
        got = outcomes[node]
        never_valid = not name.startswith(("bitflip", "mutated"))
        if got.status == "accepted" and not never_valid:
            accepted.append(name)  # a flip that left a valid payload: stored verbatim
            assert RunFolder(tmp_path).payload_path(got.client_id).read_bytes() == blob
        elif got.status != "rejected" or not got.reason.startswith("payload rejected: "):
            wrong[name] = (got.status, got.reason)
    assert not wrong, json.dumps(wrong, indent=1)
    assert len(accepted) <= 5, accepted


def test_a_node_cannot_claim_another_institutions_upload(tmp_path, monkeypatch):
    """A second node that says it is "sketch-0" and sends no payload (as a client whose upload
    is on disk does) is refused: it is not recorded as that institution, so it is not sent the
    classifier and cannot score it in the institution's name."""
    for field in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, field, 1)
    strategy = OneShotStrategy(
        lambda blob: as_upload(decode_payload(blob, SERVER)),
        CAP,
        RunFolder(tmp_path),
        min_clients=1,
        wait_for_clients_s=1,
    )
    strategy.sent_to = [1, 2]
    strategy.aggregate_train(
        1,
        [
            over_the_wire(1, upload(VALID["sketch-0"])),
            over_the_wire(2, skipped_content("sketch-0")),
        ],
    )
    outcomes = {o.node_id: o for o in strategy.outcomes}
    assert (outcomes[1].status, outcomes[1].client_id) == ("accepted", "sketch-0")
    assert outcomes[2].status == "rejected"
    assert "'sketch-0' uploaded from node 1; node 2 cannot claim its upload" in outcomes[2].reason
    assert strategy.uploaded_by_node == {1: "sketch-0"}
    asked = strategy.configure_evaluate(
        1, ArrayRecord(), ConfigRecord(), ScoringGrid({1: {}, 2: {}})
    )
    assert [m.metadata.dst_node_id for m in asked] == [1], (
        "the classifier goes to the uploader only"
    )


def test_with_client_nodes_a_squatter_that_uploads_first_does_not_lock_the_owner_out(tmp_path):
    """Run config federation.client-nodes binds each id to its registered node: node 1 uploading as
    "sketch-0" before its owner (node 2) is refused, the owner's upload is then accepted, and
    an id no node is registered for is refused."""
    bound = FedBiPConfig.from_flat({"federation.client-nodes": "sketch-0=2"})
    owners = bound.federation.client_node_map
    strategy = OneShotStrategy(
        lambda blob: as_upload(decode_payload(blob, SERVER)),
        CAP,
        RunFolder(tmp_path),
        min_clients=1,
        wait_for_clients_s=1,
        owners=owners,
    )
    strategy.sent_to = [1, 2, 3]
    strategy.aggregate_train(
        1,
        [
            over_the_wire(1, upload(VALID["sketch-0"])),
            over_the_wire(2, upload(VALID["sketch-0"])),
            over_the_wire(3, upload(VALID["painting-0"])),
        ],
    )
    outcomes = {o.node_id: (o.status, o.reason) for o in strategy.outcomes}
    assert (
        outcomes[1][0] == "rejected"
        and "belongs to node 2 (run config federation.client-nodes)" in outcomes[1][1]
    )
    assert outcomes[2] == ("accepted", "")
    assert (
        outcomes[3][0] == "rejected"
        and "'painting-0' is not in run config federation.client-nodes" in outcomes[3][1]
    )
    assert strategy.uploaded_by_node == {2: "sketch-0"}


class ScoringGrid:
    """A grid whose institutions answer ``evaluate`` with the given metrics, by node."""

    def __init__(self, replies: dict[int, dict]) -> None:
        self.replies = replies

    def get_node_ids(self) -> list[int]:
        return list(self.replies)

    def send_and_receive(self, messages: list[Message], timeout: float) -> list[Message]:
        return [
            over_the_wire(node, RecordDict({METRICS_RECORD: MetricRecord(self.replies[node])}))
            for node in (m.metadata.dst_node_id for m in messages)
        ]


def test_malformed_scores_from_an_institution_are_recorded_not_raised(tmp_path, monkeypatch):
    for field in ("_task_id", "_run_id", "_node_id"):  # what the ServerApp's runtime sets
        monkeypatch.setattr(TaskIdentity, field, 1)
    good = {
        "accuracy": 0.5,
        "num-examples": 4,
        "per-class-correct": [1, 1],
        "per-class-total": [2, 2],
    }
    inconsistent = {  # client id: (its reply, what the refusal says)
        "d": (
            {
                "accuracy": 7.5,
                "num-examples": 10**9,
                "per-class-correct": [10**9, 0],
                "per-class-total": [10**9, 0],
            },
            "accuracy: Input should be less than or equal to 1",
        ),
        "e": ({**good, "per-class-correct": [3, 0]}, "more correct answers than images"),
        "f": ({**good, "num-examples": 40}, "sum to 4, not num-examples 40"),
        "g": ({**good, "accuracy": 1.0}, "accuracy 1 is not its counts' 2/4"),
        "h": (
            {**good, "per-class-correct": [1, 1, 0], "per-class-total": [2, 2, 0]},
            "count 3 classes, not the server's 2",
        ),
        "i": (
            {
                "accuracy": 0.5,
                "num-examples": 200,
                "per-class-correct": [50, 50],
                "per-class-total": [100, 100],
            },
            "200 held-out images, more than federation.max-images-per-client 100",
        ),
    }
    replies = {
        1: good,
        2: {**good, "accuracy": [0.5, 0.5]},
        3: {key: value for key, value in good.items() if key != "num-examples"},
        **{node: reply for node, (reply, _) in enumerate(inconsistent.values(), start=4)},
    }
    clients = dict(enumerate("abc" + "".join(inconsistent), start=1))
    strategy = OneShotStrategy(
        None,
        CAP,
        RunFolder(tmp_path),
        min_clients=1,
        wait_for_clients_s=1,
        uploaded_by_node=clients,
    )
    scores = strategy.evaluate_at_institutions(
        ScoringGrid(replies),
        b"weights",
        {},
        timeout=1,
        bounds=ScoreBounds(classes=2, max_examples=100),
    )
    assert scores["a"] == Scored(
        accuracy=0.5, num_examples=4, per_class_correct=[1, 1], per_class_total=[2, 2]
    )
    assert isinstance(scores["b"], Unscored) and "accuracy: " in scores["b"].reason
    assert isinstance(scores["c"], Unscored) and "together or not at all" in scores["c"].reason
    for client, (_, reason) in inconsistent.items():
        assert isinstance(scores[client], Unscored) and reason in scores[client].reason, scores[
            client
        ]
    assert Evaluation.of("clients", scores).weighted_mean == 0.5, "only the consistent score counts"


# --- what a user sees, through the real `flwr run` ----------------------------------------------

FOREIGN_CLIENT = '''
"""Partition 1 squats partition 0's client id (it says its upload is on disk), partition 2
scores the classifier it gets back with counts it cannot hold; the rest is the project's."""
from flwr.app import Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app.app import evaluate as project_evaluate
from fedbip_flwr.wire import METRICS_RECORD, skipped_content
from recording_client import project_train, record

app = ClientApp()


@app.evaluate()
def evaluate(msg, context):
    reply = project_evaluate(msg, context)
    if int(context.node_config["partition-id"]) != 2:
        return reply
    inflated = {"accuracy": 7.5, "num-examples": 10**9, "per-class-correct": [10**9] + [0] * 5,
                "per-class-total": [10**9] + [0] * 5}
    return Message(content=RecordDict({METRICS_RECORD: MetricRecord(inflated)}), reply_to=msg)


@app.train()
def train(msg, context):
    record(context)
    if int(context.node_config["partition-id"]) != 1:
        return project_train(msg, context)
    return Message(content=skipped_content("sketch-0"), reply_to=msg)
'''


@pytest.fixture(scope="module")
def foreign_app(tmp_path_factory) -> Path:
    modules = {"recording_client": RECORDING_CLIENT, "foreign_client": FOREIGN_CLIENT}
    return make_wrapper_app(tmp_path_factory.mktemp("fuzz") / "app", modules, "foreign_client:app")


def test_a_squatter_and_an_inflated_score_are_refused_and_the_honest_scores_recorded(
    tmp_path, tiny_model_dir, foreign_app
):
    """Whether the squatter's claim on "sketch-0" arrives before sketch-0's upload (it carries
    no payload) or after (the id is node-bound), it is refused and sketch-0 is accepted."""
    out, home = tmp_path / "out", tmp_path / "home"
    out.mkdir()
    values = {
        **SMALL,
        "ldm.model": f'"{tiny_model_dir}"',
        "output-dir": f'"{out}"',
        "federation.min-clients": 2,
    }
    status, log = run_to_end(home, as_run_config(values), foreign_app)
    assert status == "finished:completed", log[-4000:]
    assert received(out) == ["0", "1", "2"]
    folder = RunFolder(out / "e2e")
    record = results.read(folder.metrics)
    assert record.clients == results.read_clients(folder.clients)
    by_status: dict[str, list[ClientOutcome]] = {}
    for client in record.clients:
        by_status.setdefault(client.status, []).append(client)
    assert sorted(by_status) == ["accepted", "rejected"] and len(by_status["accepted"]) == 2
    reason = by_status["rejected"][0].reason
    assert (
        "the message carries no FedBiP payload" in reason or "cannot claim its upload" in reason
    ), reason
    assert "2 valid payloads: painting-0, sketch-0" in log
    assert set(record.accuracy.per_domain) == {"sketch", "painting"}
    # the inflated scores are refused, not averaged: the mean is the honest institution's
    scores = record.evaluation.per_client
    assert isinstance(scores["painting-0"], Unscored), scores["painting-0"]
    assert "accuracy: Input should be less than or equal to 1" in scores["painting-0"].reason
    assert isinstance(scores["sketch-0"], Scored)
    assert record.evaluation.weighted_mean == pytest.approx(scores["sketch-0"].accuracy, abs=1e-12)
    assert sorted(p.name for p in folder.payloads.iterdir()) == [
        "painting-0.safetensors",
        "sketch-0.safetensors",
    ]


def test_bad_run_config_fails_the_run_with_one_sentence(tmp_path, foreign_app):
    out, home = tmp_path / "out", tmp_path / "home"
    out.mkdir()
    status, log = run_to_end(
        home, as_run_config({"fedbip.concept-lr": -1, "output-dir": f'"{out}"'}), foreign_app
    )
    assert status == "finished:failed"
    sentence = "Invalid FedBiP run config: 'fedbip.concept-lr': Input should be greater than 0."
    errors = [line for line in log.splitlines() if line.startswith("fedbip_flwr.flat.ConfigError")]
    assert errors == [f"fedbip_flwr.flat.ConfigError: {sentence}"], log[-4000:]
    assert received(out) == [], "no client is contacted under a bad config"

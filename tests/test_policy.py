"""An institution's upload policy (issue 91): its node config says what may leave it, and its
ClientApp refuses the run's request before it reads an image or loads a model.

The ClientApp's own ``train`` runs here on real Flower messages; a refusal is proved to come
before any work by pointing the refusing institution's data-root and model at paths that do
not exist: touching either would fail the job with another error, not refuse it."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client_app import app as client_app
from fedbip_flwr import shapes
from fedbip_flwr.config import ConfigError, FedBiPConfig, NodeConfig
from fedbip_flwr.ldm import load_for_run
from fedbip_flwr.methods import institution_upload
from fedbip_flwr.policy import REFUSAL_PREFIX, PolicyRefusal, UploadKind
from fedbip_flwr.server import RunFolder
from fedbip_flwr.strategy import OneShotStrategy
from fedbip_flwr.wire import REFUSED, carries_payload, message_config, train_content
from fedbip_tools.cli import project_run_config

ABSENT = "/nonexistent/fedbip"  # a data-root and a model no job can open
CLASSES = ",".join(shapes.CLASSES)


def institution(**values) -> dict:
    return {"data-root": ABSENT, "domain": "sketch", "client-id": "hospital-a", **values}


def train(node: dict, monkeypatch: pytest.MonkeyPatch, **run) -> Message:
    """The ClientApp's reply to the one train message of a run with ``run`` over the
    project's defaults (its own folders: dataset imagefolder)."""
    for field in ("_task_id", "_run_id", "_node_id"):  # what a SuperNode's runtime sets
        monkeypatch.setattr(TaskIdentity, field, 1)
    config = {**project_run_config(), "data.dataset": "imagefolder", "data.classes": CLASSES, **run}
    context = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config=config)
    message = Message(content=train_content([]), dst_node_id=1, message_type=MessageType.TRAIN)
    return client_app.train(message, context)


def refusal(reply: Message) -> str:
    assert not carries_payload(reply)
    return message_config(reply)[REFUSED]


def test_a_real_institution_refuses_an_upload_without_a_guarantee_before_any_work(
    monkeypatch, tmp_path
):
    """The default for an institution with its own data: FedBiP's z(T) (no DP) is refused, with
    neither its folder nor its model touched; the server records the refusal with its reason."""
    reply = train(institution(model=ABSENT), monkeypatch)
    reason = refusal(reply)
    assert reason.startswith("the run's method fedbip uploads without a DP guarantee")
    assert "epsilon <= 4, delta <= 1e-05 per image" in reason
    strategy = OneShotStrategy(
        lambda blob: pytest.fail("a refusal is never decoded"),
        2**20,
        RunFolder(tmp_path),
        min_clients=1,
        wait_for_clients_s=1,
    )
    strategy.aggregate_train(1, [reply])
    [outcome] = strategy.outcomes
    assert (outcome.status, outcome.client_id) == ("refused", "hospital-a")
    assert outcome.reason == REFUSAL_PREFIX + reason


@pytest.mark.parametrize(
    ("node", "run", "needle"),
    [
        (
            {"allow-uploads": "statistics,concepts,counts", "require-dp": False},
            {},
            "uploads latents, which this institution does not allow",
        ),
        (
            {"max-dp-epsilon": 1.0},
            {"method": "fedbip-mixture", "fedbip-mixture.dp-epsilon": 4.0},
            "is (4, 1e-05)-DP per image, weaker than this institution's epsilon <= 1",
        ),
        (
            {},
            {
                "method": "fedbip-mixture",
                "fedbip-mixture.dp-epsilon": 4.0,
                "federation.replayable-client-noise": True,
            },
            "is void: run config federation.replayable-client-noise",
        ),
        ({"allow-uploads": "latents,concepts"}, {"method": "fedavg"}, "uploads classifier"),
    ],
)
def test_each_rule_of_the_policy_refuses_before_any_work(monkeypatch, node, run, needle):
    """FedAvg's rounds are refused the same way; its reply is an error Flower's strategy
    leaves out of the average, with the policy's reason."""
    if run.get("method") == "fedavg":
        with pytest.raises(PolicyRefusal, match=needle):
            train(institution(model=ABSENT, **node), monkeypatch, **run)
        return
    assert needle in refusal(train(institution(model=ABSENT, **node), monkeypatch, **run))


def test_the_defaults_and_allowing_everything_explicitly():
    real = NodeConfig.from_flat(institution()).upload_policy
    simulated = NodeConfig.from_flat({"partition-id": 0, "num-partitions": 3}).upload_policy
    assert real.require_dp and not simulated.require_dp
    assert real.kinds == simulated.kinds == frozenset(UploadKind)
    everything = NodeConfig.from_flat(
        institution(**{"allow-uploads": "all", "require-dp": False})
    ).upload_policy
    assert not everything.require_dp and (everything.max_images, everything.max_bytes) == (0, 0)
    with pytest.raises(ConfigError, match="'allow-uploads': 'pixels' is no upload kind"):
        NodeConfig.from_flat(institution(**{"allow-uploads": "latents,pixels"}))


@pytest.fixture(scope="module")
def own_folder(tmp_path_factory) -> Path:
    return shapes.write_image_folder(tmp_path_factory.mktemp("inst") / "data", "sketch", 2, 1)


def job(folder: Path, model: str, node: dict, **run) -> tuple[FedBiPConfig, NodeConfig]:
    node_config = NodeConfig.from_flat(institution(**{"data-root": str(folder), **node}))
    flat = {**project_run_config(), "data.dataset": "imagefolder", "data.classes": CLASSES, **run}
    cfg = FedBiPConfig.from_flat({**flat, "ldm.model": model, **node_config.run_overrides()})
    return cfg, node_config


def never_loaded() -> functools.partial:
    """A loader of a model that does not exist: calling it fails with another error."""
    return functools.partial(load_for_run, ABSENT, "cpu", False, 32)


def test_the_image_cap_refuses_once_the_images_are_counted_before_the_model_loads(own_folder):
    cfg, node = job(own_folder, ABSENT, {"require-dp": False, "max-upload-images": 11})
    with pytest.raises(PolicyRefusal) as refused:
        institution_upload(cfg, node, never_loaded(), policy=node.upload_policy)
    assert "more private images than this institution's node config max-upload-images" in str(
        refused.value
    )
    assert "12" not in refused.value.reason, "its count stays in its own log"
    assert "stand for 12 private images" in refused.value.detail


def test_the_byte_cap_refuses_from_a_bound_before_computing_and_on_the_real_size_after(
    own_folder, tiny_model_dir
):
    """FedBiP's z(T) alone take 12 images x 2 latents x 4x16x16 float32 values = 98,304 bytes
    at the tiny model's 32 px, a bound read from its VAE's config, no weight loaded; an upload
    whose size is known only once made (prompts-only's counts) is held to the cap after."""
    small = {"require-dp": False, "max-upload-mb": 40_000 / 2**20}
    cfg, node = job(own_folder, str(tiny_model_dir), small, **{"data.image-size": 32})
    with pytest.raises(PolicyRefusal) as refused:
        institution_upload(cfg, node, never_loaded(), policy=node.upload_policy)
    assert "would take at least 98304 bytes" in refused.value.detail
    tiny = {"require-dp": False, "max-upload-mb": 100 / 2**20}
    cfg, node = job(own_folder, ABSENT, tiny, method="prompts-only")
    with pytest.raises(PolicyRefusal, match="larger than this institution's") as refused:
        institution_upload(cfg, node, never_loaded(), policy=node.upload_policy)
    assert "the upload takes" in refused.value.detail

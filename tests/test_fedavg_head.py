"""FedAvg of the head alone (``fedavg.part = "head"``, fedbip_flwr/methods/fedavg.py): a linear
head on the frozen backbone FedPFT reads features from, trained with FedPFT's head recipe, only
its weight and bias travelling; what a client or the server receives checked before it is
loaded. On the tiny model (whose backbone is random-init)."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.app.metadata import Metadata
from torch import nn

from fedbip_flwr import dataset, shapes
from fedbip_flwr.classifier import backbone_path, evaluate, load_backbone
from fedbip_flwr.clusters import public_encoder
from fedbip_flwr.config import ConfigError, FedBiPConfig, NodeConfig
from fedbip_flwr.method_settings import FedAvgSettings, FedPFTSettings
from fedbip_flwr.methods import create, fedavg
from fedbip_flwr.methods.fedpft import encoder_identity
from fedbip_flwr.results import SENT_ACCURACY, SENT_IMAGES
from fedbip_flwr.storage import read_tensors
from fedbip_flwr.upload import PayloadError
from fedbip_tools.privacy import loss_drop_scores, membership_result
from tests.helpers import (
    SMALL,
    as_run_config,
    method_config,
    run_simulation,
    run_status,
    stop_local_superlink,
)

# about 15 s without its one `flwr run` (two SuperNodes, two rounds), which takes about a minute
pytestmark = pytest.mark.long(minutes=1)

C, D = 6, 512  # the shapes world's classes; the backbone's features
NODE = NodeConfig(partition_id=0, num_partitions=3)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    """The head's steps are tiny: OpenMP threads spinning on a shared machine slow them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(tiny_model_dir, **values) -> FedBiPConfig:
    return method_config(
        "fedavg",
        **{
            "ldm.model": str(tiny_model_dir),
            "fedavg.part": "head",
            "fedavg.local-epochs": 2,
            **{f"fedavg.{k}": v for k, v in values.items()},
        },
    )


def method(cfg: FedBiPConfig) -> fedavg.FedAvg:
    return create("fedavg", cfg.settings_of("fedavg"))


def global_head(cfg: FedBiPConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(cfg.seed)
    return method(cfg).classifier(cfg, "random").fc.state_dict()


def message(arrays, cfg: FedBiPConfig, kind: str = MessageType.TRAIN, **config) -> Message:
    """A train or evaluate message as Flower's FedAvg sends it under part = head."""
    sent = {fedavg.ENCODER: encoder_identity(cfg.ldm.model)[0], fedavg.ROUND: 1, **config}
    content = RecordDict(
        {fedavg.CONFIG: ConfigRecord({k: v for k, v in sent.items() if v is not None})}
    )
    if arrays is not None:
        content[fedavg.ARRAYS] = arrays if isinstance(arrays, ArrayRecord) else ArrayRecord(arrays)
    return delivered(content, kind, src=0, dst=1)


def reply(node: int, content: RecordDict) -> Message:
    """A client's train reply as the ServerApp's grid hands it over."""
    return delivered(content, MessageType.TRAIN, src=node, dst=0)


def delivered(content: RecordDict, kind: str, src: int, dst: int) -> Message:
    metadata = Metadata(
        run_id=1,
        message_id="",
        src_node_id=src,
        dst_node_id=dst,
        reply_to_message_id="" if src == 0 else "m",
        group_id="1",
        created_at=time.time(),
        ttl=3600,
        message_type=kind,
    )
    return Message(content, metadata=metadata)


def test_the_default_part_is_all_and_another_is_refused():
    assert FedAvgSettings().part == "all"
    assert FedBiPConfig.from_flat({"method": "fedavg"}).settings_of("fedavg").part == "all"
    with pytest.raises(ConfigError, match="fedavg.part"):
        FedBiPConfig.from_flat({"method": "fedavg", "fedavg.part": "backbone"})


def test_a_head_round_trains_the_global_head_on_the_frozen_encoders_features_and_sends_only_it(
    tiny_model_dir, monkeypatch
):
    cfg = config(tiny_model_dir)
    start = global_head(cfg)
    seen = {}
    real_fit = fedavg.fit_head

    def recording(head, features, labels, epochs, recipe, generator, device="cpu"):
        start = {k: v.clone() for k, v in head.state_dict().items()}
        seen.update(start=start, features=features, labels=labels, epochs=epochs, recipe=recipe)
        return real_fit(head, features, labels, epochs, recipe, generator, device)

    monkeypatch.setattr(fedavg, "fit_head", recording)
    backbone_bytes = backbone_path(tiny_model_dir).read_bytes()
    sent = method(cfg).client_round(message(start, cfg), cfg, NODE, CPU)

    data = dataset.institution_data(cfg.data_description, NODE)
    assert torch.equal(
        seen["features"], public_encoder(tiny_model_dir, cfg.classifier.image_size)(data.images)
    )
    assert torch.equal(seen["labels"], data.labels)
    assert all(torch.equal(seen["start"][k], start[k]) for k in start), "from the global head"
    assert seen["epochs"] == 2 and seen["recipe"] == cfg.settings_of("fedpft"), (
        "FedPFT's head recipe"
    )
    assert sorted(sent.keys()) == [fedavg.ARRAYS, fedavg.METRICS]
    arrays = sent[fedavg.ARRAYS].to_torch_state_dict()
    assert {k: (v.dtype, tuple(v.shape)) for k, v in arrays.items()} == {
        "weight": (torch.float32, (C, D)),
        "bias": (torch.float32, (C,)),
    }
    assert not torch.equal(arrays["weight"], start["weight"]), "the head moved"
    assert sum(len(a.data) for a in sent[fedavg.ARRAYS].values()) < 16_000, (
        "kilobytes, not the backbone"
    )
    assert dict(sent[fedavg.METRICS]) == {SENT_IMAGES: len(data)}
    assert backbone_path(tiny_model_dir).read_bytes() == backbone_bytes, "the encoder stays frozen"
    # the server's check takes the reply; the global classifier is the frozen backbone + that head
    fedavg.check_reply(sent, start, cfg.federation.max_images_per_client)
    model = method(cfg).classifier(cfg, cfg.classifier.init)
    model.fc.load_state_dict(arrays)
    backbone = load_backbone(backbone_path(tiny_model_dir))
    kept = {k: v for k, v in model.state_dict().items() if not k.startswith("fc.")}
    assert all(torch.equal(v, backbone.state_dict()[k]) for k, v in kept.items())


@pytest.mark.parametrize("part", ("head", "all"))
def test_each_round_shuffles_anew_and_a_replayed_round_is_the_same(tiny_model_dir, part):
    """The round's seed is the round-th draw of the client's own stream (replayable here), for
    the head and for the whole model; a round outside 1..rounds is refused either way."""
    cfg = config(tiny_model_dir, part=part, **({"local-epochs": 1} if part == "all" else {}))
    torch.manual_seed(cfg.seed)
    start = method(cfg).federated(method(cfg).classifier(cfg, "random")).state_dict()
    sent = [
        method(cfg)
        .client_round(message(start, cfg, **{fedavg.ROUND: r}), cfg, NODE, CPU)[fedavg.ARRAYS]
        .to_torch_state_dict()
        for r in (1, 1, 2)
    ]
    weight = "weight" if part == "head" else "fc.weight"
    first, again, second = (s[weight] for s in sent)
    assert torch.equal(first, again) and not torch.equal(first, second)
    with pytest.raises(PayloadError, match="round 0, not one of 1..10"):
        method(cfg).client_round(message(start, cfg, **{fedavg.ROUND: 0}), cfg, NODE, CPU)


def test_the_head_learns_separable_features_and_two_averaged_clients_do_too():
    generator = torch.Generator().manual_seed(0)
    centres = torch.rand(C, D, generator=generator) * 2

    def draw(n):
        labels = torch.arange(C).repeat(n)
        return (centres[labels] + 0.5 * torch.randn(len(labels), D, generator=generator)).clamp(
            min=0
        ), labels

    test_x, test_y = draw(50)
    recipe = FedPFTSettings()
    start = nn.Linear(D, C)
    before = float((start(test_x).argmax(1) == test_y).float().mean())
    heads, counts = [], []
    for client in range(2):  # two clients, one FedAvg round of 5 local epochs each
        head = nn.Linear(D, C)
        head.load_state_dict(start.state_dict())
        x, y = draw(8 + 4 * client)
        fedavg.fit_head(head, x, y, 5, recipe, torch.Generator().manual_seed(client))
        heads.append(head)
        counts.append(len(y))
        assert float((head(test_x).argmax(1) == test_y).float().mean()) > 0.9
    # Flower's FedAvg (through the checks) averages them, weighted by the image counts
    strategy = fedavg.CheckedFedAvg(
        start.state_dict(), 1000, min_train_nodes=1, min_available_nodes=1
    )
    replies = [
        reply(
            i + 1,
            RecordDict(
                {
                    fedavg.ARRAYS: ArrayRecord(h.state_dict()),
                    fedavg.METRICS: MetricRecord({SENT_IMAGES: n}),
                }
            ),
        )
        for i, (h, n) in enumerate(zip(heads, counts, strict=True))
    ]
    averaged, _ = strategy.aggregate_train(1, replies)
    mean = nn.Linear(D, C)
    mean.load_state_dict(fedavg.checked_arrays(averaged, start.state_dict(), "the average"))
    expected = (heads[0].weight * counts[0] + heads[1].weight * counts[1]) / sum(counts)
    assert torch.allclose(mean.weight, expected, atol=1e-6)
    after = float((mean(test_x).argmax(1) == test_y).float().mean())
    assert before < 0.5 and after > 0.9, (before, after)


def _wrong(change):
    def make(head):
        head = {k: v.clone() for k, v in head.items()}
        change(head)
        return head

    return make


MALFORMED_HEADS = {
    "a class too many": (
        _wrong(lambda h: h.update(weight=torch.zeros(C + 1, D))),
        r"'weight' has shape \[7, 512\], expected \[6, 512\]",
    ),
    "another feature size": (
        _wrong(lambda h: h.update(weight=torch.zeros(C, 2048))),
        r"'weight' has shape \[6, 2048\], expected \[6, 512\]",
    ),
    "the model's own names": (
        _wrong(lambda h: h.update({"fc.weight": h.pop("weight")})),
        r"lack \['weight'\] and hold \['fc.weight'\]",
    ),
    "no bias": (_wrong(lambda h: h.pop("bias")), r"lack \['bias'\]"),
    "float64": (
        _wrong(lambda h: h.update(bias=h["bias"].double())),
        "'bias' must be float32, got float64",
    ),
    "NaN": (_wrong(lambda h: h["weight"].__setitem__((0, 0), math.nan)), "NaN or Inf"),
    "a backbone besides": (
        _wrong(lambda h: h.update({f"layer{i}": torch.zeros(1) for i in range(9)})),
        r"hold \['layer0', .*\(9 in all\)",
    ),
}


@pytest.mark.parametrize("case", MALFORMED_HEADS)
def test_a_malformed_global_head_is_refused_before_it_is_loaded(tiny_model_dir, case):
    cfg = config(tiny_model_dir)
    make, reason = MALFORMED_HEADS[case]
    bad = message(make(global_head(cfg)), cfg)
    with pytest.raises(PayloadError, match=f"the server's global head.*{reason}"):
        method(cfg).client_round(bad, cfg, NODE, CPU)
    with pytest.raises(PayloadError, match=f"the server's global head.*{reason}"):
        method(cfg).client_evaluate(
            message(make(global_head(cfg)), cfg, MessageType.EVALUATE), cfg, NODE
        )


def test_a_round_from_another_encoder_or_none_is_refused(tiny_model_dir):
    cfg = config(tiny_model_dir)
    with pytest.raises(
        PayloadError, match="the server's encoder 'another'.*must ship the server's"
    ):
        method(cfg).client_round(message(global_head(cfg), cfg, encoder="another"), cfg, NODE, CPU)
    with pytest.raises(PayloadError, match="the server's encoder None"):
        method(cfg).client_evaluate(
            message(global_head(cfg), cfg, MessageType.EVALUATE, encoder=None), cfg, NODE
        )
    with pytest.raises(PayloadError, match="no ArrayRecord"):
        method(cfg).client_round(message(None, cfg), cfg, NODE, CPU)
    with pytest.raises(PayloadError, match="round 99, not one of 1..10"):
        method(cfg).client_round(
            message(global_head(cfg), cfg, **{fedavg.ROUND: 99}), cfg, NODE, CPU
        )


def test_client_evaluation_scores_the_backbone_with_the_global_head(tiny_model_dir):
    cfg = config(tiny_model_dir)
    sent = method(cfg).client_evaluate(
        message(global_head(cfg), cfg, MessageType.EVALUATE), cfg, NODE
    )
    scores = dict(sent[fedavg.METRICS])
    assert set(scores) == {SENT_ACCURACY, SENT_IMAGES} and 0 <= scores[SENT_ACCURACY] <= 1
    everything = method_config(
        "fedavg", **{"ldm.model": str(tiny_model_dir)}
    )  # part all: the whole model
    torch.manual_seed(0)
    whole = method(everything).classifier(everything, "random").state_dict()
    msg = delivered(
        RecordDict({fedavg.ARRAYS: ArrayRecord(whole)}), MessageType.EVALUATE, src=0, dst=1
    )
    assert set(dict(method(everything).client_evaluate(msg, everything, NODE)[fedavg.METRICS])) == {
        SENT_ACCURACY,
        SENT_IMAGES,
    }
    with pytest.raises(PayloadError, match="the server's global model lack"):
        method(everything).client_evaluate(
            message(global_head(cfg), everything, MessageType.EVALUATE), everything, NODE
        )


def test_the_server_leaves_a_malformed_reply_out_of_the_average(tiny_model_dir, caplog):
    cfg = config(tiny_model_dir)
    start = global_head(cfg)

    def content(arrays=None, metrics=None, **extra):
        return RecordDict(
            {
                fedavg.ARRAYS: ArrayRecord(arrays or start),
                fedavg.METRICS: MetricRecord(metrics or {SENT_IMAGES: 10}),
                **extra,
            }
        )

    bad = {
        "shape": content({"weight": torch.zeros(1, D), "bias": torch.zeros(C)}),
        "images": content(metrics={SENT_IMAGES: cfg.federation.max_images_per_client + 1}),
        "keys": content(metrics={SENT_IMAGES: 10, "loss": 0.1}),
        "records": content(config=ConfigRecord({"x": 1})),
    }
    reasons = {
        "shape": r"'weight' has shape \[1, 512\]",
        "images": "claims 100001 images, not an integer in 1..100000",
        "keys": r"metrics are \['num-examples', 'loss'\]",
        "records": "holds records",
    }
    for name, record in bad.items():
        with pytest.raises(PayloadError, match=reasons[name]):
            fedavg.check_reply(record, start, cfg.federation.max_images_per_client)
    good = {k: v + 1 for k, v in start.items()}
    strategy = fedavg.CheckedFedAvg(
        start, cfg.federation.max_images_per_client, min_train_nodes=1, min_available_nodes=1
    )
    replies = [reply(1, content(good)), *(reply(i + 2, c) for i, c in enumerate(bad.values()))]
    averaged, _ = strategy.aggregate_train(1, replies)
    assert all(torch.equal(v, good[k]) for k, v in averaged.to_torch_state_dict().items()), (
        "the good reply alone"
    )
    assert sum("left out of the average" in r.getMessage() for r in caplog.records) == len(bad)


def test_part_all_takes_flowers_float64_average_of_batchnorms_count():
    template = {"w": torch.zeros(2), "n": torch.tensor(0, dtype=torch.int64)}
    got = fedavg.checked_arrays(
        ArrayRecord({"w": torch.ones(2), "n": torch.tensor(3.5, dtype=torch.float64)}),
        template,
        "the average",
    )
    assert got["n"].dtype == torch.float64
    with pytest.raises(PayloadError, match="'n' must be int64, got bool"):
        fedavg.checked_arrays(
            ArrayRecord({"w": torch.ones(2), "n": torch.tensor(True)}), template, "x"
        )


# --- through the real `flwr run` ---------------------------------------------------------------


def test_head_only_fedavg_runs_end_to_end_through_flwr(tiny_model_dir, tmp_path):
    out, home = tmp_path / "outputs", tmp_path / "flwr-home"
    values = {
        **SMALL,
        "data.shots-per-class": 2,
        "data.domains": '"sketch,quickdraw"',
        "method": '"fedavg"',
        "fedavg.part": '"head"',
        "fedavg.rounds": 2,
        "fedavg.local-epochs": 1,
        "federation.evaluation": '"both"',
        "run-name": '"head"',
        "ldm.model": f'"{tiny_model_dir}"',
        "output-dir": f'"{out}"',
    }
    try:
        run_id, log = run_simulation(home, as_run_config(values), supernodes=2, timeout=600)
        status = run_status(home, run_id)
    finally:
        stop_local_superlink(home)
    assert status == "finished:completed", log[-4000:]
    metrics = json.loads((out / "head" / "metrics.json").read_text())
    assert metrics["config"]["fedavg.part"] == "head" and set(
        metrics["accuracy"]["per_domain"]
    ) == {"sketch", "quickdraw"}
    assert metrics["evaluation"]["round"] == 2, "both institutions scored the last round's head"
    saved = read_tensors(out / "head" / "classifier.safetensors")
    backbone = load_backbone(backbone_path(tiny_model_dir)).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in backbone.items() if not k.startswith("fc.")), (
        "frozen"
    )
    assert tuple(saved["fc.weight"].shape) == (C, D)


def test_the_servers_loss_drop_test_finds_a_head_clients_members_through_its_rounds(
    tiny_model_dir,
):
    """What scripts/server_attacks.py --kinds fedavg-head measures, at its positive control: a
    head trained for a few rounds on 8 images a class (FedAvg's own client step) lowers its
    members' loss below the sent head's, unseen images' less, and its last reply's loss tells
    them apart; with no round at all to train in, or with the member labels shuffled, nothing
    is found."""
    cfg = config(tiny_model_dir, **{"local-epochs": 40, "rounds": 3})
    fedavg_method = method(cfg)
    members = shapes.client_train_set("sketch", 8, seed=0, size=cfg.data.image_size)
    unseen = shapes.test_set("sketch", 8, seed=0, size=cfg.data.image_size)
    data = dataset.ClientSet(members.images, members.labels, members.classes, "sketch", "c0")
    sent = global_head(cfg)

    def losses(head: dict[str, torch.Tensor], images: shapes.ImageSet) -> torch.Tensor:
        model = fedavg_method.classifier(cfg, "random")
        model.fc.load_state_dict(head)
        return evaluate(model, images.images, images.labels, cfg.classifier.image_size).losses

    before, after = {"in": [], "out": []}, {"in": [], "out": []}
    for server_round in (1, 2, 3):
        reply = fedavg_method.local_update(
            sent, data, cfg, server_round, torch.Generator().manual_seed(7)
        )
        for side, images in (("in", members), ("out", unseen)):
            before[side].append(losses(sent, images))
            after[side].append(losses(reply, images))
        sent = reply  # one client: FedAvg's average is its reply
    drop = {s: loss_drop_scores(torch.stack(before[s]), torch.stack(after[s])) for s in before}
    found = membership_result(drop["in"], drop["out"])
    assert found.auc > 0.5 + 4 * found.auc_stderr, found.auc  # a random backbone: far from 1
    # the rows' statistic: the last reply's loss alone
    last = membership_result(-after["in"][-1], -after["out"][-1])
    assert last.auc > 0.5 + 4 * last.auc_stderr, last.auc
    unchanged = {
        s: loss_drop_scores(torch.stack(before[s]), torch.stack(before[s])) for s in before
    }
    assert membership_result(unchanged["in"], unchanged["out"]).auc == 0.5
    both = torch.cat([drop["in"], drop["out"]])
    shuffled = both[torch.randperm(len(both), generator=torch.Generator().manual_seed(0))]
    guess = membership_result(shuffled[: len(drop["in"])], shuffled[len(drop["in"]) :])
    assert abs(guess.auc - 0.5) < 4 * guess.auc_stderr
    with pytest.raises(ValueError, match="not both"):
        loss_drop_scores(torch.stack(before["in"]), torch.stack(after["out"])[:2])

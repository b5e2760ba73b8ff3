"""The method registry: every method's client and server steps on tiny models, its upload's
contract (malformed uploads refused like FedBiP's), and one real `flwr run` per method."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from typing import Literal

import pytest
import torch
from pydantic import Field

from fedbip_flwr import dataset, methods, shapes
from fedbip_flwr.classifier import build_classifier
from fedbip_flwr.config import ConfigError, FedBiPConfig, NodeConfig
from fedbip_flwr.method_settings import METHOD_SETTINGS
from fedbip_flwr.methods import base, create, create_for
from fedbip_flwr.methods.base import (
    class_counts,
    common_meta,
    encode_upload,
    fresh_noise_labels,
)
from fedbip_flwr.policy import UploadKind
from fedbip_flwr.server import RunFolder, evaluate_models
from fedbip_flwr.storage import read_tensors
from fedbip_flwr.upload import PayloadError, UploadMeta
from fedbip_tools import cli
from fedbip_tools.cli import project_run_config
from tests.helpers import (
    METHOD_CFG,
    ONE_SHOT,
    SMALL,
    as_run_config,
    client_job,
    method_config,
    own,
    run_simulation,
    run_status,
    server_job,
    stop_local_superlink,
    tampered,
)

pytestmark = pytest.mark.long(minutes=6)


def test_the_run_config_accepts_exactly_the_registered_methods():
    assert {*ONE_SHOT, "fedbip", "fedavg"} == set(methods.names())
    assert methods.names() == sorted(METHOD_SETTINGS), "every listed method has its class"
    for name in methods.names():
        assert FedBiPConfig.from_flat({"method": name}).method == name
    assert isinstance(create("fedavg"), methods.MultiRound)
    with pytest.raises(
        ConfigError, match="unknown method 'nope'; the registry knows central, espresso, fedavg"
    ):
        FedBiPConfig.from_flat({"method": "nope"})
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        create("nope")


class ToyMeta(UploadMeta):
    method: Literal["toy"] = "toy"


class ToySettings(methods.MethodSettings):
    scale: int = Field(1, ge=1)


class Toy(methods.Method):
    """The smallest method: uploads its class counts times its own ``toy.scale``; the server
    trains on nothing of it."""

    name = "toy"
    uploads = frozenset({UploadKind.COUNTS})  # what an institution's upload policy weighs
    meta_model = ToyMeta
    tensor_names = ("class_counts",)

    def upload(self, job):
        counts = class_counts(job.data.labels, len(job.data.classes)) * self.settings.scale
        return encode_upload(ToyMeta(**common_meta(job)), {"class_counts": counts}), {}

    def train_set(self, uploads, server, shard_path):
        return {}


def test_a_new_method_is_its_settings_entry_one_module_and_its_registration(monkeypatch, tiny_ldm):
    """What adding a method takes: its name and settings model in METHOD_SETTINGS, and a class
    declaring the kinds of its upload, with @register (here into a copy of the registry); then
    the run config (its own table too), create(), the shared upload checks and the
    institutions' upload policies know it by name."""
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    with pytest.raises(ValueError, match="'toy' has no settings in method_settings"):
        base.register(Toy)
    monkeypatch.setitem(METHOD_SETTINGS, "toy", ToySettings)
    with pytest.raises(ValueError, match="'toy' declares no upload kinds"):
        base.register(type("Kindless", (Toy,), {"uploads": frozenset()}))
    base.register(Toy)
    assert methods.upload_kinds("toy") == {UploadKind.COUNTS}
    cfg = method_config("toy", **{"toy.scale": 3})
    blob, _ = methods.create_for(cfg).upload(client_job(cfg, tiny_ldm))
    upload = create("toy").accept(blob, server_job(cfg, tiny_ldm))
    assert upload.meta.method == "toy" and int(upload.tensors["class_counts"].sum()) == 3 * 12
    assert create("toy", {"scale": 2}).settings.scale == 2
    with pytest.raises(
        ConfigError, match="'toy.scale': Input should be greater than or equal to 1"
    ):
        method_config("toy", **{"toy.scale": 0})
    with pytest.raises(ValueError, match="registered already"):
        base.register(type("Other", (Toy,), {}))


def test_a_multi_round_method_makes_no_upload_to_audit_or_compute():
    meta = UploadMeta(
        schema_version=1,
        method="fedavg",
        client_id="a",
        domain="sketch",
        class_names=["circle"],
        num_examples=1,
    )
    blob = encode_upload(meta, {"labels": torch.zeros(1, dtype=torch.int64)})
    with pytest.raises(PayloadError, match="'fedavg' trains over several rounds"):
        methods.audit_upload(blob, 2**20)
    with pytest.raises(ValueError, match="makes no one upload"):
        methods.create_one_shot("fedavg")


def test_prompts_only_tells_counts_and_samples_as_many_as_fedbip_per_class(tiny_ldm, tmp_path):
    cfg = method_config("prompts-only")
    job = client_job(cfg, tiny_ldm)
    blob, _ = create("prompts-only").upload(job)
    upload = create("prompts-only").accept(blob, server_job(cfg, tiny_ldm))
    counts = upload.tensors["class_counts"]
    assert counts.tolist() == torch.bincount(job.data.labels, minlength=6).tolist()
    assert len(blob) < 2000, "prompts-only uploads counts and names only"
    shards = create("prompts-only").train_set(
        {upload.client_id: upload}, server_job(cfg, tiny_ldm), RunFolder(tmp_path).shard_path
    )[upload.client_id]
    stored = read_tensors(shards[0])
    assert stored["images"].dtype == torch.uint8 and stored["images"].shape[1:] == (3, 32, 32)
    assert (
        stored["labels"].tolist() == torch.repeat_interleave(torch.arange(6), counts * 2).tolist()
    )


def test_images_per_class_overrides_the_fedbip_equal_count():
    counts = torch.tensor([2, 0, 1])
    cfg = method_config("prompts-only")
    # by default 2 per image: what the default federation's FedBiP makes (2 z(T), 1 pass each)
    fedbip = FedBiPConfig.from_flat(project_run_config()).settings_of("fedbip")
    assert own(cfg).images_per_image == fedbip.latents_per_image * fedbip.multiplier == 2
    assert fresh_noise_labels(counts, own(cfg), cfg.class_cap).tolist() == [0] * 4 + [2] * 2
    claimed_more = torch.tensor(
        [3, 0, 1]
    )  # than federation.max-images-per-class (here the run's 2 shots)
    assert fresh_noise_labels(claimed_more, own(cfg), cfg.class_cap).tolist() == [0] * 4 + [2] * 2
    fixed = method_config("prompts-only", **{"prompts-only.images-per-class": 2})
    assert fresh_noise_labels(counts, own(fixed), fixed.class_cap).tolist() == [0, 0, 1, 1, 2, 2]
    one = method_config("prompts-only", **{"prompts-only.images-per-image": 1})
    assert fresh_noise_labels(counts, own(one), one.class_cap).tolist() == [0] * 2 + [2]


def test_central_uploads_the_images_themselves_and_trains_on_them(tiny_ldm, tmp_path):
    cfg = method_config("central")
    job = client_job(cfg, tiny_ldm)
    blob, _ = create("central").upload(job)
    upload = create("central").accept(blob, server_job(cfg, tiny_ldm))
    assert len(blob) >= job.data.images.numel(), "one byte per pixel value: the raw images"
    shard = create("central").train_set(
        {upload.client_id: upload}, server_job(cfg, tiny_ldm), RunFolder(tmp_path).shard_path
    )[upload.client_id][0]
    stored = read_tensors(shard)
    restored = stored["images"].float() / 127.5 - 1.0
    assert (restored - job.data.images).abs().max() <= 1 / 127.5 + 1e-6
    assert torch.equal(stored["labels"], job.data.labels)


def test_local_uploads_a_trained_classifier_and_is_scored_per_client(tiny_ldm):
    cfg = method_config("local")
    server = server_job(cfg, tiny_ldm)
    uploads = {}
    for partition in (0, 1):
        blob, _ = create("local").upload(client_job(cfg, tiny_ldm, partition))
        upload = create("local").accept(blob, server)
        uploads[upload.client_id] = upload
    fresh = build_classifier(6, "random").state_dict()
    sent = uploads["sketch-0"].tensors
    assert set(sent) == set(fresh), "weights and every BatchNorm statistic"
    assert not torch.equal(sent["bn1.running_mean"], fresh["bn1.running_mean"]), "trained locally"
    models = create("local").final_models(uploads, server)
    assert sorted(models) == ["quickdraw-0", "sketch-0"]
    tests = {
        d: (s.images, s.labels)
        for d, s in dataset.load_test_sets(cfg.data_description, ["sketch", "painting"]).items()
    }
    scores = evaluate_models(models, tests, 32, "cpu")
    for domain in tests:
        per_model = [scores["per_model"][m]["per_domain"][domain] for m in models]
        assert scores["per_domain"][domain] == pytest.approx(sum(per_model) / 2)


_VALID: dict[str, bytes] = {}  # one honest upload per method, shared by the lies below


def valid_upload(method: str, ldm) -> tuple[bytes, FedBiPConfig]:
    cfg = method_config(method)
    if method not in _VALID:  # every tiny_ldm is the same saved model
        _VALID[method], _ = create_for(cfg).upload(client_job(cfg, ldm))
    return _VALID[method], cfg


def first_float(tensors: dict) -> str:
    return next(
        n for n, t in sorted(tensors.items()) if t.is_floating_point() or t.dtype == torch.uint8
    )


LIES = {
    "another method": lambda t, m: m.update({"fedbip.method": '"fedbip"'}),
    "a missing tensor": lambda t, m: t.pop(sorted(t)[0]),
    "an extra tensor": lambda t, m: t.update({"extra": torch.zeros(1)}),
    "a wrong dtype": lambda t, m: t.update({sorted(t)[0]: t[sorted(t)[0]].to(torch.float16)}),
    "a wrong shape": lambda t, m: t.update({sorted(t)[0]: torch.cat([t[sorted(t)[0]]] * 2)}),
    "an unknown class list": lambda t, m: m.update(
        {"fedbip.class_names": json.dumps(list("abcdef"))}
    ),
    "a newer schema": lambda t, m: m.update({"fedbip.schema_version": "2"}),
}


@pytest.mark.parametrize("method", ONE_SHOT)
@pytest.mark.parametrize("lie", sorted(LIES))
def test_malformed_uploads_are_refused_with_a_reason(method, lie, tiny_ldm):
    blob, cfg = valid_upload(method, tiny_ldm)
    bad = tampered(blob, method, cfg, LIES[lie])
    with pytest.raises(PayloadError):
        create_for(cfg).accept(bad, server_job(cfg, tiny_ldm))


@pytest.mark.parametrize("method", ONE_SHOT)
def test_oversize_truncated_and_non_finite_uploads_are_refused(method, tiny_ldm):
    blob, cfg = valid_upload(method, tiny_ldm)
    server = server_job(
        method_config(method, **{"federation.max-payload-mb": len(blob) / 2**20 / 2}), tiny_ldm
    )
    with pytest.raises(PayloadError, match="above the cap"):
        create_for(cfg).accept(blob, server)
    with pytest.raises(PayloadError):
        create_for(cfg).accept(blob[:-3], server_job(cfg, tiny_ldm))
    with pytest.raises(PayloadError):
        create_for(cfg).accept(struct.pack("<Q", 2**40) + blob[8:], server_job(cfg, tiny_ldm))

    def poison(tensors, _meta):
        name = next((n for n, t in sorted(tensors.items()) if t.is_floating_point()), None)
        if name is None:  # no float tensor: a negative count is the lie instead
            tensors["class_counts"] = -tensors["class_counts"]
        else:
            tensors[name] = tensors[name].clone().fill_(float("nan"))

    if method != "central":  # central's tensors are uint8 images and labels: nothing to poison
        with pytest.raises(PayloadError):
            create_for(cfg).accept(tampered(blob, method, cfg, poison), server_job(cfg, tiny_ldm))


@pytest.mark.parametrize("method", ["fedbip", "prompts-only", "oscar", "fedlmg"])
def test_every_claimed_image_count_is_held_to_max_images_per_client(method, tiny_ldm):
    """As the mixture methods' (test_instance_free.py): the server's synthesis grows with a
    client's claimed images, FedBiP's z(T) rows included."""
    blob, _ = valid_upload(method, tiny_ldm)
    n = len(client_job(method_config(method), tiny_ldm).data.labels)
    at_cap = method_config(method, **{"federation.max-images-per-client": n})
    create_for(at_cap).accept(blob, server_job(at_cap, tiny_ldm))
    below = method_config(method, **{"federation.max-images-per-client": n - 1})
    with pytest.raises(
        PayloadError,
        match=f"claims {n} images, above run config federation.max-images-per-client {n - 1}",
    ):
        create_for(below).accept(blob, server_job(below, tiny_ldm))


def test_a_fedbip_payload_names_its_method(tiny_ldm):
    upload_meta = methods.fedbip.FedBiP.meta_model.model_fields["method"].default
    assert upload_meta == "fedbip"
    blob = encode_upload(
        methods.prompts_only.PromptsOnlyMeta(
            schema_version=1,
            client_id="a",
            domain="sketch",
            class_names=list(shapes.CLASSES),
            num_examples=1,
        ),
        {"class_counts": torch.tensor([1, 0, 0, 0, 0, 0])},
    )
    with pytest.raises(PayloadError, match="upload for method 'prompts-only', not 'fedbip'"):
        create("fedbip").accept(blob, server_job(FedBiPConfig.from_flat(METHOD_CFG), tiny_ldm))


# --- every method through the real `flwr run` ------------------------------------------------

E2E = {
    **SMALL,
    "data.shots-per-class": 2,
    "classifier.epochs": 1,
    "local.epochs": 1,
    "fedlmg.local-epochs": 1,
    "fedavg.rounds": 2,
    "fedavg.local-epochs": 1,
    "data.domains": '"sketch,quickdraw"',
    "fedlmg.noise-edits": 1,
    "fedlmg.batch-size": 12,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """One `flwr run` per method, two SuperNodes each, one after another on one local SuperLink."""
    out = tmp_path_factory.mktemp("outputs")
    home = tmp_path_factory.mktemp("flwr-home")
    results = {}
    try:
        for method in (*ONE_SHOT, "fedavg"):
            values = {
                **E2E,
                "method": f'"{method}"',
                "run-name": f'"{method}"',
                "ldm.model": f'"{tiny_model_dir}"',
                "output-dir": f'"{out}"',
            }
            run_id, log = run_simulation(home, as_run_config(values), supernodes=2, timeout=900)
            results[method] = {
                "status": run_status(home, run_id),
                "log": log,
                "folder": out / method,
            }
    finally:
        stop_local_superlink(home)
    return results


@pytest.mark.parametrize("method", (*ONE_SHOT, "fedavg"))
def test_each_method_runs_end_to_end_through_flwr(runs, method):
    run = runs[method]
    assert run["status"] == "finished:completed", run["log"][-4000:]
    metrics = json.loads((run["folder"] / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["config"]["method"] == method
    assert set(metrics["accuracy"]["per_domain"]) == {"sketch", "quickdraw"}
    assert (run["folder"] / "classifier.safetensors").exists() or method == "local"
    if method == "fedavg":
        return
    accepted = [c for c in metrics["clients"] if c["status"] == "accepted"]
    assert sorted(c["client_id"] for c in accepted) == ["quickdraw-0", "sketch-0"]
    stored = sorted(p.name for p in RunFolder(run["folder"]).payloads.iterdir())
    assert stored == ["quickdraw-0.safetensors", "sketch-0.safetensors"], "persisted on arrival"


def test_the_node_config_cannot_change_the_method():
    with pytest.raises(ValueError, match="method"):
        NodeConfig.from_flat({"method": "central"})


def test_fedbip_with_several_latents_per_image_uploads_k_z_T_each(tiny_ldm):
    cfg = method_config("fedbip", **{"fedbip.latents-per-image": 2})
    job = client_job(cfg, tiny_ldm)
    blob, _ = create_for(cfg).upload(job)
    upload = create_for(cfg).accept(blob, server_job(cfg, tiny_ldm))
    n = len(job.data.labels)
    assert upload.meta.num_examples == 2 * n and upload.tensors["latents"].shape[0] == 2 * n
    # the rows come in a random order (instance.upload_order): each image's class twice
    counts = torch.bincount(upload.tensors["labels"], minlength=len(job.data.classes))
    assert torch.equal(counts, 2 * torch.bincount(job.data.labels, minlength=len(job.data.classes)))
    at_cap = method_config(
        "fedbip", **{"fedbip.latents-per-image": 2, "federation.max-images-per-client": n}
    )
    create_for(at_cap).accept(blob, server_job(at_cap, tiny_ldm))  # 2n z(T) rows of n images
    one_cfg = method_config("fedbip")
    one, _ = create_for(one_cfg).upload(client_job(one_cfg, tiny_ldm))
    assert len(blob) - len(one) >= upload.tensors["latents"][:n].numel() * 4 - 64, "k x the latents"


def test_concept_only_samples_every_pass_from_fresh_noise_with_the_learned_concepts(
    tiny_ldm, tmp_path
):
    cfg = method_config("fedbip", **{"fedbip.synthesis-start": "fresh-noise"})
    server, method = server_job(cfg, tiny_ldm), create_for(cfg)
    upload = method.accept(method.upload(client_job(cfg, tiny_ldm))[0], server)
    shards = method.train_set(
        {upload.client_id: upload}, server, RunFolder(tmp_path / "a").shard_path
    )[upload.client_id]
    first, second = (read_tensors(p) for p in shards)
    assert len(shards) == method.settings.multiplier
    assert torch.equal(first["labels"], upload.tensors["labels"])
    assert not torch.equal(first["images"], second["images"]), "every pass has noise of its own"
    # The uploaded z(T) play no part: other latents, the same images.
    payload = upload.content
    other = methods.fedbip.as_upload(replace(payload, latents=torch.randn_like(payload.latents)))
    again = method.train_set(
        {upload.client_id: other}, server, RunFolder(tmp_path / "b").shard_path
    )[upload.client_id]
    assert torch.equal(read_tensors(again[0])["images"], first["images"])
    from_latents = create_for(method_config("fedbip")).train_set(
        {upload.client_id: upload},
        server_job(method_config("fedbip"), tiny_ldm),
        RunFolder(tmp_path / "c").shard_path,
    )[upload.client_id]
    assert not torch.equal(read_tensors(from_latents[0])["images"], first["images"])


@pytest.mark.parametrize("method", ("fedbip", *ONE_SHOT))
def test_fedbip_inspect_audits_every_methods_upload(method, tiny_ldm, tmp_path, capsys):
    blob, _ = valid_upload(method, tiny_ldm)
    path = tmp_path / "upload.safetensors"
    path.write_bytes(blob)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"method: {method}" in out and f"bytes: {len(blob)}" in out
    for name in create(method).expected_tensors(server_job(method_config(method), tiny_ldm))[:3]:
        assert name in out
    path.write_bytes(blob[:-5])
    assert cli.main(["inspect", str(path)]) == 1
    assert capsys.readouterr().err.startswith("invalid payload: ")

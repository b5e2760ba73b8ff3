"""FedLMG (peer): the client's upload, the guidance loss (eqs. 7, 9) with per-image BatchNorm
statistics, the guided sampler (eqs. 8, 10), and the MD / SD distillation (eqs. 12, 13) through
the one shared classifier recipe, on tiny models."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from fedbip_flwr import dataset
from fedbip_flwr.classifier import (
    Distillation,
    ShardImages,
    TrainSettings,
    _prepare,
    build_classifier,
    distillation_loss,
    train_classifier,
)
from fedbip_flwr.concepts import unconditional_embedding
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.methods import ClientJob, ServerJob, create, create_for
from fedbip_flwr.methods.fedlmg import (
    PREFIX,
    GuidanceSettings,
    GuidedSampler,
    forward_with_bn_inputs,
    guidance_terms,
    mean_teacher,
    source_teacher,
)
from fedbip_flwr.server import RunFolder
from fedbip_flwr.storage import read_metadata, write_tensors
from fedbip_flwr.synthesis import decode_latents, encode_texts
from fedbip_flwr.upload import PayloadError
from fedbip_flwr.viz import quantize
from tests.helpers import tampered

CFG = {
    "data.image-size": 32,
    "classifier.image-size": 32,
    "synthesis.num-inference-steps": 3,
    "fedlmg.local-epochs": 1,
    "data.shots-per-class": 2,
    "federation.replayable-client-noise": True,
    "classifier.init": "random",
    "method": "fedlmg",
    "fedlmg.images-per-class": 1,
    "fedlmg.noise-edits": 1,
}


def config(**values) -> FedBiPConfig:
    return FedBiPConfig.from_flat({**CFG, **values})


def server_job(cfg: FedBiPConfig, ldm) -> ServerJob:
    return ServerJob(cfg, dataset.class_names(cfg.data_description), lambda: ldm)


def upload_of(cfg: FedBiPConfig, ldm, partition: int = 0):
    data = dataset.load_client_data(cfg.data_description, partition)
    job = ClientJob(cfg, data, torch.Generator().manual_seed(partition), lambda: ldm)
    blob, _ = create_for(cfg).upload(job)
    return blob, data


def toy_classifier(seed: int = 0, classes: int = 3) -> nn.Module:
    """Two BatchNorm2d layers with non-trivial running statistics, in eval mode."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 5, 1),
        nn.BatchNorm2d(5),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(5, classes),
    )
    for layer in model:
        if isinstance(layer, nn.BatchNorm2d):
            layer.running_mean.normal_()
            layer.running_var.uniform_(0.5, 2.0)
    return model.eval()


# --- the client's upload ---------------------------------------------------------------------


def test_the_upload_is_a_trained_resnet18_with_its_bn_statistics_and_class_counts(tiny_ldm):
    cfg = config()
    blob, data = upload_of(cfg, tiny_ldm)
    upload = create("fedlmg").accept(blob, server_job(cfg, tiny_ldm))
    fresh = build_classifier(6, "random").state_dict()
    assert set(upload.tensors) == {"class_counts"} | {PREFIX + name for name in fresh}
    for name, tensor in fresh.items():
        assert upload.tensors[PREFIX + name].shape == tensor.shape, name
    assert int(upload.tensors[PREFIX + "bn1.num_batches_tracked"]) > 0, "trained on the client"
    assert not torch.equal(
        upload.tensors[PREFIX + "layer4.1.bn2.running_var"], fresh["layer4.1.bn2.running_var"]
    )
    assert (
        upload.tensors["class_counts"].tolist() == torch.bincount(data.labels, minlength=6).tolist()
    )
    model = upload.content
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert torch.equal(model.state_dict()["fc.weight"], upload.tensors[PREFIX + "fc.weight"])
    assert len(blob) > 4 * sum(t.numel() for t in fresh.values() if t.is_floating_point())


def test_a_negative_running_variance_is_refused(tiny_ldm):

    cfg = config()
    blob, _ = upload_of(cfg, tiny_ldm)
    name = PREFIX + "layer1.0.bn1.running_var"
    bad = tampered(blob, "fedlmg", cfg, lambda t, m: t.update({name: -t[name]}))
    with pytest.raises(PayloadError, match="running_var must be non-negative"):
        create("fedlmg").accept(bad, server_job(cfg, tiny_ldm))


# --- the guidance loss -----------------------------------------------------------------------


def test_bn_statistics_are_per_image_as_a_batch_of_one_gives_them():
    model = build_classifier(6, "random").eval().double()  # float64: batch blockings agree
    images = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    _, per_image = forward_with_bn_inputs(model, images)

    seen: list[torch.Tensor] = []  # the BN layers' inputs, recorded independently
    handles = [
        m.register_forward_pre_hook(lambda _m, i: seen.append(i[0].detach()))
        for m in model.modules()
        if isinstance(m, nn.BatchNorm2d)
    ]
    with torch.no_grad():
        model(images)
        batched = [(x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)) for x in seen]
        for i in range(len(images)):
            seen.clear()
            model(images[i : i + 1])
            for (mean, var), x in zip(per_image, seen, strict=True):
                # float64 sums of <= 3 x 3 x 512 terms (x 2^-53 = 5e-13) over 20 layers: ~1e-11
                # of the features' size |x| in another batch blocking; 1e-9 leaves 100x
                size = float(x.abs().max())
                torch.testing.assert_close(mean[i], x.mean((0, 2, 3)), rtol=0, atol=1e-9 * size)
                own_var = x.var((0, 2, 3), unbiased=False)
                torch.testing.assert_close(var[i], own_var, rtol=0, atol=1e-9 * size**2)
    for handle in handles:
        handle.remove()
    assert len(per_image) == 20, "ResNet-18 has 20 BatchNorm layers"
    for (mean, var), (batch_mean, batch_var) in zip(per_image, batched, strict=True):
        assert not torch.allclose(mean[0], batch_mean) and not torch.allclose(var[0], batch_var)


def test_ce_and_bn_losses_are_eqs_7_and_9_computed_by_hand():
    model = toy_classifier()
    images, labels = torch.randn(2, 3, 5, 5), torch.tensor([2, 0])
    with torch.no_grad():
        terms = guidance_terms(model, images, labels)

    conv1, bn1, _, conv2, bn2, *_ = model
    with torch.no_grad():
        h1 = conv1(images)
        h2 = conv2(torch.relu(bn1(h1)))
        logits = model(images)
    for i in range(2):
        bn = 0.0
        for h, layer in ((h1, bn1), (h2, bn2)):
            pixels = h[i].flatten(1)  # (C, H*W)
            mu = pixels.sum(1) / pixels.shape[1]
            var = ((pixels - mu[:, None]) ** 2).sum(1) / pixels.shape[1]
            bn += math.sqrt(float(((mu - layer.running_mean) ** 2).sum()))
            bn += math.sqrt(float(((var - layer.running_var) ** 2).sum()))
        ce = -float(logits[i, labels[i]]) + math.log(float(logits[i].exp().sum()))
        # both sides share the float32 forward (h, logits); only the 25-pixel statistics and the
        # log-sum-exp are summed in other orders: worst case ~1e3 x 2^-24 = 6e-5 on L_BN ~ 8
        # (|h| < 2), 7.5e-6 relative; a few 2^-24 of CE ~ 1.5
        assert float(terms.bn[i]) == pytest.approx(bn, rel=1e-5)
        assert float(terms.ce[i]) == pytest.approx(ce, rel=1e-5)
        assert float(terms.total(0.2)[i]) == pytest.approx(ce + 0.2 * bn, rel=1e-5)


# --- the guided sampler ----------------------------------------------------------------------


def settings(**changes) -> GuidanceSettings:
    base = GuidanceSettings(
        num_inference_steps=3,
        guidance_scale=3.0,
        step=1.0,
        bn_weight=0.2,
        noise_edits=1,
        edit_step=0.1,
        batch_size=4,
        classifier_size=32,
    )
    return dataclasses.replace(base, **changes)


def sample(ldm, classifier, chosen: GuidanceSettings, labels: torch.Tensor) -> torch.Tensor:
    cond = encode_texts(ldm, ["a circle", "a square", "a triangle"])[labels]
    noise = torch.randn(
        (len(labels), *ldm.latent_shape()), generator=torch.Generator().manual_seed(0)
    )
    return GuidedSampler(ldm, classifier, chosen).sample(
        noise, cond, unconditional_embedding(ldm), labels
    )


def test_the_gradient_through_unet_vae_and_classifier_descends_the_loss(tiny_ldm):
    sampler = GuidedSampler(tiny_ldm, toy_classifier(), settings())
    labels = torch.tensor([0, 2])
    cond = encode_texts(tiny_ldm, ["a circle", "a triangle"])
    context = torch.cat([unconditional_embedding(tiny_ldm).expand_as(cond), cond])
    x, t = (
        torch.randn((2, *tiny_ldm.latent_shape()), generator=torch.Generator().manual_seed(1)),
        torch.tensor(501),
    )
    _, grad, before = sampler.loss_gradient(x, t, context, labels)
    assert grad.shape == x.shape and bool(grad.abs().sum(dim=(1, 2, 3)).gt(0).all()), (
        "every image gets one"
    )
    _, _, after = sampler.loss_gradient(x - 1e-2 * grad / grad.norm(), t, context, labels)
    assert bool((after.total(0.2) < before.total(0.2)).all())


def test_guided_and_unguided_sampling_from_the_same_noise_differ(tiny_ldm):
    classifier, labels = toy_classifier(), torch.tensor([0, 1, 2])
    plain = sample(tiny_ldm, classifier, settings(step=0.0, noise_edits=0), labels)
    assert torch.equal(
        plain, sample(tiny_ldm, classifier, settings(step=0.0, noise_edits=0), labels)
    )
    # a random tiny model's gradients are small: large steps make the change plain to see
    for changes in (
        {"step": 30.0, "noise_edits": 0},
        {"step": 0.0, "edit_step": 10.0},
        {"step": 30.0, "shift": "latents", "noise_edits": 0},
    ):
        guided = sample(tiny_ldm, classifier, settings(**changes), labels)
        assert guided.shape == plain.shape
        assert (guided - plain).abs().mean() > 1e-3 * plain.abs().mean(), changes


def test_guided_sampling_lowers_the_guidance_loss_of_the_images_it_makes(tiny_ldm):
    classifier, labels = toy_classifier(), torch.tensor([0, 1, 2, 0])

    def final_loss(chosen: GuidanceSettings) -> torch.Tensor:
        images = decode_latents(tiny_ldm, sample(tiny_ldm, classifier, chosen, labels))
        return guidance_terms(classifier, _prepare(images, 32), labels).total(0.2)

    plain = final_loss(settings(step=0.0, noise_edits=0))
    for shift in ("noise", "latents"):  # a random tiny model's gradients are small: a big step
        guided = final_loss(settings(step=1000.0, noise_edits=0, shift=shift))
        assert bool((guided < plain).all()), (shift, guided, plain)


def test_train_set_is_one_keyed_resumable_shard_per_client(tiny_ldm, tmp_path):
    cfg = config()
    server, method = server_job(cfg, tiny_ldm), create_for(cfg)
    blob, _ = upload_of(cfg, tiny_ldm)
    upload = method.accept(blob, server)
    shard_path = RunFolder(tmp_path).shard_path
    (path,) = method.train_set({upload.client_id: upload}, server, shard_path)[upload.client_id]
    stored = ShardImages([path], 32)
    counts = upload.tensors["class_counts"]
    assert (
        stored.labels.tolist()
        == torch.repeat_interleave(torch.arange(6), (counts > 0).long()).tolist()
    )
    key, made = read_metadata(path)["fedbip.shard-key"], path.stat().st_mtime_ns
    method.train_set({upload.client_id: upload}, server, shard_path)
    assert path.stat().st_mtime_ns == made, "reused, not redone"
    other = method.accept(upload_of(cfg, tiny_ldm, partition=2)[0], server)
    moved = method.train_set(
        {upload.client_id: dataclasses.replace(other, meta=upload.meta)}, server, shard_path
    )
    assert read_metadata(moved[upload.client_id][0])["fedbip.shard-key"] != key, (
        "other weights, other key"
    )


# --- the global model: FT, MD, SD ------------------------------------------------------------


def test_distillation_losses_are_the_divergences_computed_by_hand():
    student = torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]])
    teacher = torch.tensor([[0.0, 1.0, 0.0], [3.0, -1.0, 0.5]])
    s, t = student.double(), teacher.double()  # exact references for the float32 losses
    p_s = s.exp() / s.exp().sum(1, keepdim=True)
    p_t = t.exp() / t.exp().sum(1, keepdim=True)
    kl_s_t = (p_s * (p_s / p_t).log()).sum(1).mean()  # eqs. 12-13: KL(student || teacher)
    kl_t_s = (p_t * (p_t / p_s).log()).sum(1).mean()
    entropy_t = -(p_t * p_t.log()).sum(1).mean()
    # float32 log-softmax: log-probs up to 4.1 in size, each off by < ~17 x 2^-24, so KL (1.5)
    # and soft CE (1.6) by < 50 x 2^-24 relative; rel 1e-5 is 168 x 2^-24
    kl = float(distillation_loss(student, teacher, "kl-student-teacher"))
    assert kl == pytest.approx(float(kl_s_t), rel=1e-5)
    soft_ce = float(distillation_loss(student, teacher, "soft-ce"))
    code = float(kl_t_s + entropy_t)
    assert soft_ce == pytest.approx(code, rel=1e-5), "the code's soft CE: KL(t || s) + H(t)"
    assert float(distillation_loss(teacher, teacher, "kl-student-teacher")) == pytest.approx(
        0.0, abs=1e-7
    )


def test_md_targets_the_mean_softmax_and_sd_each_rows_own_client():
    # float64 models: the references are exact to ~1e-15; the teachers return float32
    models = {"a": toy_classifier(1).double(), "b": toy_classifier(2).double()}
    x, sources = torch.randn(4, 3, 6, 6, dtype=torch.float64), ["b", "a", "a", "b"]
    with torch.no_grad():
        md = mean_teacher(models)(x, sources)
        sd = source_teacher(models)(x, sources)
        mean = (models["a"](x).softmax(-1) + models["b"](x).softmax(-1)) / 2
        # probabilities <= 1 through a float32 log-sum-exp: a few 2^-24; atol 1e-5 is 168 x 2^-24
        torch.testing.assert_close(md.softmax(-1), mean.float(), rtol=0, atol=1e-5)
        for i, source in enumerate(sources):
            own = models[source](x[i : i + 1])[0]  # a batch of 1 against the teacher's of 2
            # float64 rows agree to ~1e-15; the cast rounds each by <= 2^-24: 2^-22 leaves 2x
            atol = 2**-22 * float(own.abs().max())
            torch.testing.assert_close(sd[i], own.float(), rtol=0, atol=atol)
        assert not torch.allclose(sd[0], models["a"](x[:1])[0].float())


def shards_of(tmp_path, values: dict[str, float]) -> ShardImages:
    """One shard per client of constant images (value per client), labels alternating."""
    paths = []
    for client_id, value in values.items():
        images = quantize(torch.full((6, 3, 16, 16), value))
        paths.append(
            write_tensors(
                tmp_path / f"{client_id}.safetensors",
                {"images": images, "labels": torch.arange(6) % 3},
            )
        )
    return ShardImages(paths, 16, groups=list(values))


def test_the_shared_recipe_distils_on_the_same_batch_with_each_rows_source(tmp_path):
    data = shards_of(tmp_path, {"dark": -1.0, "light": 1.0})
    recipe = TrainSettings(epochs=2, lr=0.01, momentum=0.9, batch_size=4, image_size=16)
    seen = []

    def teacher(x: torch.Tensor, sources: list[str]) -> torch.Tensor:
        seen.append((x.mean((1, 2, 3)).sign().tolist(), sources))
        return torch.zeros(len(x), 3)

    def train(distillation: Distillation | None) -> dict:
        model = toy_classifier(seed=0)  # any model: the recipe is what is under test
        return train_classifier(
            model, data, None, recipe, seed=0, distillation=distillation
        ).state_dict()

    plain = train(None)
    weightless = train(Distillation(teacher, weight=0.0))
    assert seen and all(
        signs == [-1.0 if s == "dark" else 1.0 for s in sources] for signs, sources in seen
    )
    assert sum(len(s) for _, s in seen) == 2 * 12, "every row of every epoch, once"
    for name in plain:
        torch.testing.assert_close(weightless[name], plain[name], msg=name)  # the same recipe
    distilled = train(Distillation(teacher, weight=1.0))
    assert not torch.equal(distilled["8.weight"], plain["8.weight"]), "the teacher's term counts"


def test_the_global_mode_picks_the_teacher_and_the_variant_its_divergence(tiny_ldm):
    server = server_job(config(), tiny_ldm)
    uploads = {}
    for partition in (0, 1):
        upload = create("fedlmg").accept(upload_of(config(), tiny_ldm, partition)[0], server)
        uploads[upload.client_id] = upload

    def teacher(**values) -> Distillation | None:
        return create_for(config(**values)).teacher(uploads, server_job(config(**values), tiny_ldm))

    assert teacher(**{"fedlmg.global": "ft"}) is None
    assert teacher().divergence == "kl-student-teacher", "default: MD, as the paper writes it"
    assert teacher(**{"fedlmg.variant": "code"}).divergence == "soft-ce"
    x, sources = torch.randn(2, 3, 32, 32), ["sketch-0", "quickdraw-0"]
    with torch.no_grad():
        own = torch.stack([uploads[s].content(x[i : i + 1])[0] for i, s in enumerate(sources)])
        mean = torch.stack([uploads[s].content(x).softmax(-1) for s in sources]).mean(0)
        # SD: each row alone, as `own` (the same forward); MD: the same logits, probabilities
        # <= 1 by two float32 formulas, a few 2^-24 apart (the default atol is 1e-5)
        torch.testing.assert_close(teacher(**{"fedlmg.global": "sd"}).teacher(x, sources), own)
        torch.testing.assert_close(
            teacher(**{"fedlmg.global": "md"}).teacher(x, sources).softmax(-1), mean
        )

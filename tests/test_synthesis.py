"""Server synthesis (eq. 5) on a tiny model: starts from the uploaded z(T), at T, deterministic."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from diffusers import PNDMScheduler

from fedbip_flwr import ldm as ldm_module
from fedbip_flwr.concepts import concept_scale, unconditional_embedding
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import load_for_run, load_ldm
from fedbip_flwr.method_settings import PassSettings
from fedbip_flwr.methods.fedbip import personalize
from fedbip_flwr.sampler import Sampler
from fedbip_flwr.synthesis import SynthesisSettings, decode_latents, denoise
from fedbip_tools.build_ldm import TINY, build_ldm
from fedbip_tools.sampling import sample_from_prompts, synthesize_client, synthesize_pass
from tests.helpers import WORDS

CLASSES = ["circle", "square", "star"]


@pytest.fixture()
def payload(tiny_ldm):
    cfg = FedBiPConfig.from_flat(
        {"synthesis.num-inference-steps": 10, "data.image-size": 32}
    ).with_settings("fedbip", concept_epochs=1)
    images = torch.rand(6, 3, 32, 32) * 2 - 1
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    payload, _ = personalize(
        tiny_ldm,
        images,
        labels,
        CLASSES,
        "sketch",
        "sketch-0",
        cfg,
        torch.Generator().manual_seed(0),
    )
    return payload


def settings(**kw) -> SynthesisSettings:
    base = {"num_inference_steps": 10, "guidance_scale": 3.0, "batch_size": 4}
    return SynthesisSettings(**{**base, **kw})


TWO_PASSES = PassSettings(multiplier=2, eta_std=0.1)


def test_first_denoising_timestep_is_payload_T(tiny_ldm, payload):
    seen: list[int] = []
    hook = tiny_ldm.unet.register_forward_pre_hook(
        lambda _m, args: seen.append(int(args[1].flatten()[0]))
    )
    try:
        synthesize_pass(tiny_ldm, payload, settings(), torch.zeros(1, tiny_ldm.concept_dim))
    finally:
        hook.remove()
    assert payload.meta.timestep == 901  # first timestep of a 10-step SD schedule
    assert seen[0] == payload.meta.timestep
    assert seen[:3] == [901, 801, 801]  # PNDM warm-up repeats the second step


def test_same_seed_same_images_and_eta_changes_them(tiny_ldm, payload):
    a = synthesize_client(tiny_ldm, payload, settings(), TWO_PASSES, seed=7)
    b = synthesize_client(tiny_ldm, payload, settings(), TWO_PASSES, seed=7)
    assert torch.equal(a.images, b.images)
    assert a.images.shape == (12, 3, 32, 32) and a.images.min() >= -1 and a.images.max() <= 1
    assert torch.equal(a.labels, payload.labels.repeat(2))
    first, second = a.images[:6], a.images[6:]  # two passes over the same z(T), two etas
    assert (first - second).abs().mean() > 1e-4
    no_eta_passes = TWO_PASSES.model_copy(update={"eta_std": 0.0})
    no_eta = synthesize_client(tiny_ldm, payload, settings(), no_eta_passes, seed=7)
    assert torch.allclose(no_eta.images[:6], no_eta.images[6:])


def test_synthesis_starts_from_uploaded_latents(tiny_ldm, payload):
    eta = torch.zeros(1, tiny_ldm.concept_dim)
    base = synthesize_pass(tiny_ldm, payload, settings(), eta)
    shifted = payload.__class__(
        latents=payload.latents.roll(1, dims=0),
        labels=payload.labels,
        domain_concept=payload.domain_concept,
        class_concepts=payload.class_concepts,
        meta=payload.meta,
    )
    other = synthesize_pass(tiny_ldm, shifted, settings(), eta)
    assert (base - other).abs().mean() > 1e-3
    # an image depends only on its own z(T): batching does not mix them. In float64 batches of
    # 1 and 4 agree to ~1e-12; decode_latents returns float32, each pixel (in [-1, 1]) rounded
    # by <= 2^-24: 2^-22 leaves 2x
    wide = copy.deepcopy(tiny_ldm).to("cpu", torch.float64)
    alone, batched = (synthesize_pass(wide, payload, settings(batch_size=b), eta) for b in (1, 4))
    assert torch.allclose(alone, batched, rtol=0, atol=2**-22)


def test_prompts_only_baseline_starts_from_fresh_noise_at_T(tiny_ldm):
    """The baseline uses the same schedule from T, but fresh noise: seeds change the images."""
    seen: list[int] = []
    hook = tiny_ldm.unet.register_forward_pre_hook(
        lambda _m, args: seen.append(int(args[1].flatten()[0]))
    )
    prompts = ["a sketch of a circle", "a photo of a star", "a photo of a star"]
    try:
        a = sample_from_prompts(tiny_ldm, prompts, settings(), torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    assert seen[0] == 901
    assert a.shape == (3, 3, 32, 32) and a.min() >= -1 and a.max() <= 1
    assert (a[1] - a[2]).abs().mean() > 1e-4  # same prompt, different noise
    again = sample_from_prompts(tiny_ldm, prompts, settings(), torch.Generator().manual_seed(0))
    assert torch.equal(a, again)


def test_uint8_synthetic_sets_train_like_float_ones():
    """The server keeps synthetic images as uint8; training on them equals training on floats."""
    from fedbip_flwr.classifier import (
        TrainSettings,
        build_classifier,
        shrink,
        train_classifier,
    )
    from fedbip_flwr.viz import dequantize, quantize

    images = quantize(torch.rand(8, 3, 32, 32) * 2 - 1)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    settings = TrainSettings(epochs=1, lr=0.01, momentum=0.9, batch_size=4, image_size=16)
    runs = []
    for data in (images, dequantize(images)):
        torch.manual_seed(0)
        model = train_classifier(build_classifier(3, "random"), data, labels, settings, seed=0)
        runs.append(model.fc.weight.detach().clone())
    assert torch.allclose(runs[0], runs[1])
    small = shrink(images, 16)
    assert small.dtype == torch.uint8 and small.shape == (8, 3, 16, 16)
    assert shrink(images, 64) is images  # never enlarged


def test_decoding_in_slices_equals_one_batch(tiny_ldm):
    # float64 slices agree to ~1e-13; decode_latents returns float32, each pixel (in
    # [-1, 1]) rounded by <= 2^-24: 2^-22 leaves 2x
    wide = copy.deepcopy(tiny_ldm).to("cpu", torch.float64)
    generator = torch.Generator().manual_seed(0)
    z0 = torch.randn(10, *tiny_ldm.latent_shape(), generator=generator, dtype=torch.float64)
    whole = decode_latents(wide, z0, batch_size=10)
    assert whole.shape == (10, 3, 32, 32)
    assert torch.allclose(decode_latents(wide, z0, batch_size=3), whole, rtol=0, atol=2**-22)
    assert torch.allclose(decode_latents(wide, z0, batch_size=1), whole, rtol=0, atol=2**-22)


def test_eta_is_in_units_of_the_concept_scale(tiny_ldm, payload):
    """S_hat = S + scale * eta: sigma 0.1 shifts S by ~10% of a token's norm in either space."""
    eta = torch.randn(1, tiny_ldm.concept_dim, generator=torch.Generator().manual_seed(3))
    shifted = synthesize_pass(tiny_ldm, payload, settings(), eta)
    scale = concept_scale(tiny_ldm, payload.meta.concept_space)
    moved = replace(payload, domain_concept=payload.domain_concept + scale * eta)
    assert torch.allclose(
        synthesize_pass(tiny_ldm, moved, settings(), torch.zeros_like(eta)), shifted, atol=1e-5
    )


def test_denoising_follows_the_models_prediction_type(tmp_path):
    """PNDM reads prediction_type from the model's scheduler config: a v-prediction model's
    output is converted before each step, so it denoises differently from an eps reading."""
    folder = tmp_path / "v-model"
    build_ldm(replace(TINY, prediction_type="v_prediction"), WORDS, seed=0).save(folder)
    v_model = load_ldm(folder)
    as_eps = replace(
        v_model,
        scheduler=PNDMScheduler.from_config(
            {**v_model.scheduler.config, "prediction_type": "epsilon"}
        ),
    )
    z = torch.randn(2, *v_model.latent_shape(), generator=torch.Generator().manual_seed(0))
    cond = unconditional_embedding(v_model).expand(2, -1, -1)
    out = denoise(v_model, z, cond, cond, Sampler.create("pndm", v_model.scheduler, 10), 901, 1.0)
    assert torch.isfinite(out).all()
    as_eps_out = denoise(
        as_eps, z, cond, cond, Sampler.create("pndm", as_eps.scheduler, 10), 901, 1.0
    )
    assert not torch.allclose(out, as_eps_out, atol=1e-3)


def test_half_precision_on_a_bf16_cpu_samples_under_bf16_autocast(
    tiny_model_dir, payload, monkeypatch
):
    exact = load_for_run(str(tiny_model_dir), "cpu", half_precision=False, image_size=32)
    assert exact.autocast is None
    monkeypatch.setattr(ldm_module, "cpu_has_bf16", lambda: True)
    fast = load_for_run(str(tiny_model_dir), "cpu", half_precision=True, image_size=32)
    assert fast.autocast == torch.bfloat16 and fast.unet.dtype == torch.float32, "weights stay fp32"
    seen = []
    hook = fast.unet.conv_in.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    try:
        half = synthesize_pass(fast, payload, settings(), torch.zeros(1, fast.concept_dim))
    finally:
        hook.remove()
    full = synthesize_pass(exact, payload, settings(), torch.zeros(1, exact.concept_dim))
    assert set(seen) == {torch.bfloat16} and half.dtype == torch.float32
    assert (half - full).abs().mean() < 0.05, "bf16 sampling draws the same images, to rounding"
    assert not torch.equal(half, full)
    monkeypatch.setattr(ldm_module, "cpu_has_bf16", lambda: False)
    assert (
        load_for_run(str(tiny_model_dir), "cpu", half_precision=True, image_size=32).autocast
        is None
    )


def test_channels_last_unet_samples_the_same_images(tiny_model_dir, payload):
    plain = load_for_run(str(tiny_model_dir), "cpu", half_precision=False, image_size=32)
    fast = load_for_run(
        str(tiny_model_dir), "cpu", half_precision=False, image_size=32, channels_last=True
    )
    plain, fast = plain.to("cpu", torch.float64), fast.to("cpu", torch.float64)  # keeps layouts
    assert fast.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    eta = torch.zeros(1, plain.concept_dim)
    a, b = (synthesize_pass(m, payload, settings(), eta) for m in (plain, fast))
    # float64 layouts agree to ~1e-12; decode_latents returns float32, each pixel (in
    # [-1, 1]) rounded by <= 2^-24: 2^-22 leaves 2x
    assert torch.allclose(a, b, rtol=0, atol=2**-22)


def test_padding_a_batch_to_its_bucket_changes_no_row(tiny_ldm):
    """A compiled UNet gets every batch at the full size; the filler rows must not leak."""
    ldm = copy.deepcopy(tiny_ldm).to("cpu", torch.float64)
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(2, *ldm.latent_shape(), generator=generator, dtype=torch.float64)
    uncond = unconditional_embedding(ldm)
    cond = torch.randn(2, *uncond.shape[1:], generator=generator, dtype=torch.float64)
    sampler = Sampler.create("dpm-solver++", ldm.scheduler, 4)
    sizes: list[int] = []
    hook = ldm.unet.register_forward_pre_hook(lambda _m, args: sizes.append(len(args[0])))
    try:
        padded = denoise(ldm, z, cond, uncond, sampler, sampler.first_timestep(), 3.0, pad_to=5)
    finally:
        hook.remove()
    plain = denoise(ldm, z, cond, uncond, sampler, sampler.first_timestep(), 3.0)
    assert set(sizes) == {10}, "5 rows, doubled for guidance"
    assert padded.shape == plain.shape == z.shape and padded.dtype == torch.float64
    # float64 throughout: sums of <= 3 x 3 x 64 terms (x 2^-53 = 6e-14) over 4 guided steps,
    # ~1e-12 of max|z| in another batch blocking; 1e-9 leaves 1000x, a leaked row is O(max|z|)
    assert torch.allclose(padded, plain, rtol=0, atol=1e-9 * float(plain.abs().max()))

"""Instance-level personalization against eq. 3 of the paper."""

from __future__ import annotations

import copy

import torch
from diffusers import PNDMScheduler

from fedbip_flwr.instance import (
    encode_images,
    forward_noise,
    personalize_instances,
    pick_partners,
    sample_gammas,
)
from fedbip_flwr.ldm import SD_SCHEDULER_CONFIG


def sd_scheduler() -> PNDMScheduler:
    return PNDMScheduler(**SD_SCHEDULER_CONFIG)


def test_forward_noise_matches_equation():
    sched = sd_scheduler()
    zbar = torch.randn(5, 4, 8, 8)
    eps = torch.randn(5, 4, 8, 8)
    abar = sched.alphas_cumprod[981]
    expected = abar.sqrt() * zbar + (1 - abar).sqrt() * eps
    assert torch.allclose(forward_noise(sched, zbar, 981, eps), expected, atol=1e-6)


def test_gamma_distribution_and_clipping():
    g = torch.Generator().manual_seed(0)
    gammas = sample_gammas(20000, 0.5, 0.1, g)
    assert abs(gammas.mean().item() - 0.5) < 0.005
    assert abs(gammas.std().item() - 0.1) < 0.005
    wide = sample_gammas(20000, 0.5, 1.0, g)
    assert wide.min() == 0.0 and wide.max() == 1.0
    assert 0.2 < (wide == 0).float().mean() < 0.4  # P(N(0.5,1) < 0) ~ 0.31


def test_partners_same_class_and_different_index():
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        partners = pick_partners(labels, g)
        assert torch.equal(labels[partners], labels)
        alone = labels == 3
        assert torch.all(partners[~alone] != torch.arange(len(labels))[~alone])
        assert partners[alone].item() == 9  # a lone image is its own partner
    # every other member of a class is picked sometimes (uniform choice)
    picks = torch.stack([pick_partners(labels, g) for _ in range(300)])
    assert set(picks[:, 5].tolist()) == {6, 7, 8}


def test_personalize_instances_equation_and_statistics(tiny_ldm):
    images = torch.rand(16, 3, 32, 32) * 2 - 1
    labels = torch.arange(16) % 4
    z0 = encode_images(tiny_ldm.vae, images)
    out = personalize_instances(
        tiny_ldm.vae,
        tiny_ldm.scheduler,
        images,
        labels,
        981,
        generator=torch.Generator().manual_seed(3),
    )
    assert torch.allclose(out.z0, z0)
    g = out.gammas.view(-1, 1, 1, 1)
    zbar = g * z0 + (1 - g) * z0[out.partners]
    abar = tiny_ldm.scheduler.alphas_cumprod[981]
    eps = (out.zT - abar.sqrt() * zbar) / (1 - abar).sqrt()
    # recovered noise is standard normal: z(T) is close to N(0, I)
    assert abs(eps.mean().item()) < 0.05 and abs(eps.std().item() - 1) < 0.05
    assert abs(out.zT.std().item() - 1) < 0.1
    assert out.zT.shape == (16, *tiny_ldm.latent_shape())


def test_encoding_in_slices_equals_one_batch(tiny_ldm):
    """ldm.vae-batch-size bounds memory only: the posterior mean is per image (GroupNorm, no
    BatchNorm)."""
    vae = copy.deepcopy(tiny_ldm.vae).double()
    images = torch.rand(10, 3, 32, 32, dtype=torch.float64) * 2 - 1
    whole = encode_images(vae, images, batch_size=10)
    # float64 slices agree to ~1e-13 (sums of <= 144 terms x 2^-53); encode_images returns
    # float32, one rounding of <= 2^-24 |z| each: 2^-22 max|z| leaves 2x
    atol = 2**-22 * float(whole.abs().max())
    assert torch.allclose(encode_images(vae, images, batch_size=3), whole, rtol=0, atol=atol)
    assert torch.allclose(encode_images(vae, images, batch_size=1), whole, rtol=0, atol=atol)


def test_several_draws_give_independent_z_T_per_image_each_by_the_equation(tiny_ldm):
    """latents-per-image = k: k rows of z(T) per image, each its own partner, gamma and noise."""
    images = torch.rand(12, 3, 32, 32) * 2 - 1
    labels = torch.arange(12) % 3
    out = personalize_instances(
        tiny_ldm.vae,
        tiny_ldm.scheduler,
        images,
        labels,
        981,
        draws=3,
        generator=torch.Generator().manual_seed(5),
    )
    assert out.zT.shape == (36, *tiny_ldm.latent_shape()) and out.z0.shape[0] == 12
    assert torch.equal(out.zT_labels, labels.repeat(3))
    assert torch.equal(labels[out.partners], out.zT_labels), "partners share the class"
    g = out.gammas.view(-1, 1, 1, 1)
    zbar = g * out.z0.repeat(3, 1, 1, 1) + (1 - g) * out.z0[out.partners]
    abar = tiny_ldm.scheduler.alphas_cumprod[981]
    eps = ((out.zT - abar.sqrt() * zbar) / (1 - abar).sqrt()).view(3, 12, -1)
    assert abs(eps.std().item() - 1) < 0.05
    # the draws' noises are independent: correlation between draws ~ 0, not 1
    corr = torch.corrcoef(eps.flatten(1))
    assert corr[0, 1].abs() < 0.05 and corr[1, 2].abs() < 0.05
    assert not torch.equal(out.gammas[:12], out.gammas[12:24])

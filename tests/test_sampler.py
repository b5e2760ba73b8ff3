"""The sampler choice: each scheduler's timesteps from T, and its steps against the ODE it solves."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from diffusers import PNDMScheduler

from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.expectations import expectations
from fedbip_flwr.instance import forward_noise
from fedbip_flwr.ldm import SD_SCHEDULER_CONFIG
from fedbip_flwr.methods.fedbip import personalize
from fedbip_flwr.payload import decode_payload, encode_payload
from fedbip_flwr.sampler import Sampler, SchedulerName
from fedbip_flwr.synthesis import ZSampling, denoise, zigzag_schedulers, zigzag_step
from fedbip_flwr.upload import PayloadError

SD = PNDMScheduler(**SD_SCHEDULER_CONFIG)


def test_T_is_first_synthesis_timestep_of_sd_schedule():
    assert Sampler.create("pndm", SD, 50).first_timestep() == 981
    assert math.isclose(float(SD.alphas_cumprod[981]), 0.00578, rel_tol=0.01)
    assert math.isclose(float(SD.alphas_cumprod[981]) ** 0.5, 0.076, rel_tol=0.01)


def test_earlier_T_snaps_to_schedule_and_keeps_pndm_warmup():
    sampler = Sampler.create("pndm", SD, 50)
    assert sampler.first_timestep(801) == 801
    assert sampler.first_timestep(800) == 781
    _, steps = sampler.start(601)
    assert steps[:4].tolist() == [601, 581, 581, 561]
    stock = PNDMScheduler.from_config(SD.config)
    stock.set_timesteps(50)
    assert torch.equal(sampler.start(981)[1], stock.timesteps)


@pytest.mark.parametrize(
    "config",
    [dict(SD.config), {**SD.config, "timestep_spacing": "leading"}],
    ids=["sd-v1-4-config", "saved-config"],
)
def test_every_sampler_keeps_the_models_timesteps(config):
    """SD v1-4's scheduler config has no timestep_spacing (PNDM's default, leading, applies);
    a config saved by today's diffusers names it. Either way each sampler gets the same grid."""
    noise_schedule = PNDMScheduler.from_config(config)
    grids = {
        name: Sampler.create(name, noise_schedule, 25).grid()[:2].tolist() for name in SchedulerName
    }
    assert grids == {
        "pndm": [961, 921],
        "ddim": [961, 921],
        "dpm-solver++": [951, 913],
        "unipc": [951, 913],
    }


@pytest.mark.parametrize("steps", [5, 10, 25])
def test_trailing_spacing_keeps_T_at_999_for_every_sampler_and_step_count(steps):
    """Fewer steps must not buy speed with privacy: with trailing spacing the noise level of
    z(T) is the same at every step count, and the four samplers share one grid."""
    grids = {
        tuple(Sampler.create(name, SD, steps, "trailing").grid().tolist()) for name in SchedulerName
    }
    assert len(grids) == 1
    grid = grids.pop()
    assert grid[0] == 999 and len(grid) == steps
    leading = Sampler.create("pndm", SD, steps, "leading").first_timestep()
    assert leading < 999 and SD.alphas_cumprod[leading] > SD.alphas_cumprod[999]


@pytest.mark.parametrize("name", list(SchedulerName))
def test_from_the_first_timestep_each_sampler_runs_its_stock_schedule(name):
    sampler = Sampler.create(name, SD, 10)
    scheduler, steps = sampler.start(sampler.first_timestep())
    stock = type(sampler.scheduler).from_config(sampler.scheduler.config)
    stock.set_timesteps(10)
    assert torch.equal(steps, stock.timesteps)
    assert int(steps[0]) == sampler.first_timestep()
    assert scheduler is not sampler.scheduler, "each run steps its own copy"


def test_a_timestep_off_the_grid_is_refused():
    with pytest.raises(ValueError, match="not a timestep of the 10-step DDIMScheduler"):
        Sampler.create("ddim", SD, 10).start(900)


class OracleUNet(torch.nn.Module):
    """Predicts the true noise of one known x0: z_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps.

    Along this exact probability-flow trajectory every consistent solver step lands back on it,
    so denoising must return x0 (up to the last step's alpha): a sampler that steps with the
    wrong noise level for t (its sigmas indexed from the wrong place) does not.
    """

    def __init__(self, x0: torch.Tensor, abar: torch.Tensor):
        super().__init__()
        self.x0, self.abar = x0, abar
        self.anchor = torch.nn.Parameter(torch.zeros(()), requires_grad=False)  # device, dtype

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    def forward(self, z, t, encoder_hidden_states):
        a = self.abar[int(t)]
        return SimpleNamespace(sample=(z - a.sqrt() * self.x0) / (1 - a).sqrt())


@pytest.mark.parametrize("name", list(SchedulerName))
@pytest.mark.parametrize("spacing", ["leading", "trailing"])
@pytest.mark.parametrize("from_first", [True, False], ids=["first-T", "earlier-T"])
def test_every_sampler_follows_the_trajectory_from_T_to_x0(tiny_ldm, name, spacing, from_first):
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, *tiny_ldm.latent_shape(), generator=generator, dtype=torch.float64).float()
    eps = torch.randn(x0.shape, generator=generator)
    sampler = Sampler.create(name, tiny_ldm.scheduler, 10, spacing)
    T = sampler.first_timestep(0 if from_first else 500)
    assert from_first or T < 500
    oracle = replace(tiny_ldm, unet=OracleUNet(x0, tiny_ldm.scheduler.alphas_cumprod))
    cond = torch.zeros(2, 4, tiny_ldm.concept_dim)
    out = denoise(
        oracle, forward_noise(tiny_ldm.scheduler, x0, T, eps), cond, cond, sampler, T, 1.0
    )
    # samplers that end at t=1 keep sqrt(1 - abar_0) = 0.029 of the noise; a misplaced sigma is O(1)
    error = (out - x0).pow(2).mean().sqrt() / x0.pow(2).mean().sqrt()
    assert error < 0.05, f"{name} from T={T}: relative error {error:.3f}"


@pytest.mark.parametrize("spacing", ["leading", "trailing"])
def test_z_samplings_round_trip_returns_z_t_under_an_exact_model(tiny_ldm, spacing):
    """With the true noise, one DDIM step down and one DDIM inversion step back up return
    z(t) itself (Espresso's Z-Sampling): a round trip with a misplaced timestep or alpha does
    not. So every sampler with the zigzag still lands on x0; a real model's zigzag does change
    the images."""
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, *tiny_ldm.latent_shape(), generator=generator)
    eps = torch.randn(x0.shape, generator=generator)
    oracle = replace(tiny_ldm, unet=OracleUNet(x0, tiny_ldm.scheduler.alphas_cumprod))
    cond = torch.zeros(2, 4, tiny_ldm.concept_dim)
    for name in SchedulerName:
        sampler = Sampler.create(name, tiny_ldm.scheduler, 10, spacing)
        for t in sampler.grid()[:3]:
            z_t = forward_noise(tiny_ldm.scheduler, x0, int(t), eps)
            back = zigzag_step(oracle, z_t, t, cond, cond, 1.0, 0.0, zigzag_schedulers(sampler))
            assert (back - z_t).abs().max() < 1e-3 * z_t.abs().max(), f"{name} at t={int(t)}"
        T = sampler.first_timestep()
        out = denoise(
            oracle,
            forward_noise(tiny_ldm.scheduler, x0, T, eps),
            cond,
            cond,
            sampler,
            T,
            1.0,
            zigzag=ZSampling(threshold=500),
        )
        assert (out - x0).pow(2).mean().sqrt() / x0.pow(2).mean().sqrt() < 0.05, name
    sampler, cond = (
        Sampler.create("unipc", tiny_ldm.scheduler, 10, spacing),
        torch.randn(2, 4, tiny_ldm.concept_dim),
    )
    z_t = forward_noise(tiny_ldm.scheduler, x0, sampler.first_timestep(), eps)
    plain = denoise(tiny_ldm, z_t, cond, cond * 0, sampler, sampler.first_timestep(), 4.0)
    zigzag = denoise(
        tiny_ldm, z_t, cond, cond * 0, sampler, sampler.first_timestep(), 4.0, zigzag=ZSampling(500)
    )
    assert not torch.allclose(plain, zigzag)


def test_the_upload_records_its_sampler_and_the_server_refuses_another(tiny_ldm):
    """A client on DPM-Solver++ noises to its schedule's first timestep and says which sampler
    it noised for; a server on PNDM names the scheduler as the mismatch, not the timestep."""
    cfg = FedBiPConfig.from_flat(
        {
            "synthesis.num-inference-steps": 10,
            "data.image-size": 32,
            "synthesis.scheduler": "dpm-solver++",
        }
    ).with_settings("fedbip", concept_epochs=1)
    fedbip = cfg.settings_of("fedbip")
    classes = cfg.data.class_list
    images = torch.rand(6, 3, 32, 32) * 2 - 1
    payload, _ = personalize(
        tiny_ldm,
        images,
        torch.tensor([0, 0, 1, 1, 2, 2]),
        classes,
        "sketch",
        "sketch-0",
        cfg,
        torch.Generator().manual_seed(0),
    )
    assert (payload.meta.scheduler, payload.meta.timestep) == ("DPMSolverMultistepScheduler", 901)
    blob = encode_payload(payload)
    assert decode_payload(blob, expectations(cfg, tiny_ldm, classes, fedbip)).meta.timestep == 901
    on_pndm = FedBiPConfig.from_flat({**cfg.to_flat(), "synthesis.scheduler": SchedulerName.PNDM})
    with pytest.raises(
        PayloadError,
        match="scheduler 'DPMSolverMultistepScheduler' does not match"
        ".*'PNDMScheduler'.*run config synthesis.scheduler",
    ):
        decode_payload(blob, expectations(on_pndm, tiny_ldm, classes, fedbip))

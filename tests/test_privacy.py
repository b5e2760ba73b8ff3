"""Privacy as a property: what the server sees and sets must not let it undo z(T).

The attack is the one a curious server would run: replay the client's generator from the run
seed and the payload's client id, recompute the partners, the gammas and the noise eps, invert
the forward process, zbar = (z(T) - sqrt(1 - abar_T) eps) / sqrt(abar_T), and solve the N x N
interpolation system zbar = A z(0) for every private latent. It must fail against a client's
default randomness and succeed only under the explicit simulation opt-in (which shows it can).
"""

from __future__ import annotations

import pytest
import torch

from fedbip_flwr import shapes
from fedbip_flwr.config import FedBiPConfig, NodeConfig
from fedbip_flwr.instance import encode_images, pick_partners, sample_gammas
from fedbip_flwr.methods.fedbip import personalize
from fedbip_flwr.payload import Payload
from fedbip_flwr.seeds import client_generator, client_seed

CLIENT = "sketch-0"


def replay_attack(payload: Payload, cfg: FedBiPConfig, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """The server's estimate of every z_i(0), from the payload and the run config alone."""
    generator = torch.Generator().manual_seed(client_seed(cfg.seed, payload.meta.client_id))
    labels, z_t = payload.labels, payload.latents.float()
    partners = pick_partners(labels, generator)
    gammas = sample_gammas(len(labels), cfg.gamma_mean, cfg.gamma_std, generator)
    noise = torch.randn(z_t.shape, generator=generator)
    abar = alphas_cumprod[payload.meta.timestep].double()
    zbar = (z_t.double() - (1 - abar).sqrt() * noise.double()) / abar.sqrt()
    mixing = torch.zeros(len(labels), len(labels), dtype=torch.float64)
    rows = torch.arange(len(labels))
    mixing[rows, rows] += gammas.double()
    mixing[rows, partners] += 1 - gammas.double()
    solution = torch.linalg.lstsq(mixing, zbar.flatten(1)).solution
    return solution.view_as(zbar).float()


def relative_error(estimate: torch.Tensor, truth: torch.Tensor) -> float:
    return float((estimate - truth).pow(2).mean().sqrt() / truth.pow(2).mean().sqrt())


@pytest.fixture(scope="module")
def client_images():
    data = shapes.client_train_set("sketch", 4, 0, seed=0, size=32)
    return data.images, data.labels, list(data.classes)


def upload(ldm, client_images, cfg: FedBiPConfig, node: NodeConfig) -> Payload:
    images, labels, classes = client_images
    payload, _ = personalize(
        ldm, images, labels, classes, "sketch", CLIENT, cfg, client_generator(cfg, node, CLIENT)
    )
    return payload


def config(**values) -> FedBiPConfig:
    return FedBiPConfig(**{"concept_epochs": 0, "image_size": 32, "num_inference_steps": 4, **values})


def test_the_server_cannot_replay_a_clients_default_noise(tiny_ldm, client_images):
    cfg = config()
    truth = encode_images(tiny_ldm.vae, client_images[0])
    estimate = replay_attack(upload(tiny_ldm, client_images, cfg, NodeConfig()), cfg,
                             tiny_ldm.scheduler.alphas_cumprod)
    assert relative_error(estimate, truth) > 0.5, "the private latents were recovered"


def test_the_attack_succeeds_under_the_simulation_opt_in(tiny_ldm, client_images):
    """The same attack recovers every latent when the client seeds from the run config."""
    cfg = config(replayable_client_noise=True)
    truth = encode_images(tiny_ldm.vae, client_images[0])
    estimate = replay_attack(upload(tiny_ldm, client_images, cfg, NodeConfig()), cfg,
                             tiny_ldm.scheduler.alphas_cumprod)
    assert relative_error(estimate, truth) < 1e-3


def test_an_institutions_own_seed_is_reproducible_for_it_and_not_replayable(
    tiny_ldm, client_images
):
    cfg = config()
    node = NodeConfig(seed=1234)
    first, second = (upload(tiny_ldm, client_images, cfg, node) for _ in range(2))
    assert torch.equal(first.latents, second.latents)
    truth = encode_images(tiny_ldm.vae, client_images[0])
    estimate = replay_attack(first, cfg, tiny_ldm.scheduler.alphas_cumprod)
    assert relative_error(estimate, truth) > 0.5


def test_default_noise_is_fresh_on_every_upload_and_no_seed_travels(tiny_ldm, client_images):
    cfg = config()
    first, second = (upload(tiny_ldm, client_images, cfg, NodeConfig()) for _ in range(2))
    assert not torch.allclose(first.latents, second.latents)
    assert not any("seed" in field for field in first.meta.model_dump())


def averaging_attack(payload: Payload, draws: int, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """With ``latents-per-image = k`` the server knows which k rows come from one image (row
    ``j * N + i``): their mean halves the noise's variance per doubling of k, and divided by
    sqrt(abar_T) it is its best guess of the image's latent without the client's noise."""
    views = payload.latents.float().view(draws, -1, *payload.latents.shape[1:])
    abar = alphas_cumprod[payload.meta.timestep]
    return views.mean(0) / abar.sqrt()


def test_averaging_the_k_z_T_of_one_image_does_not_reveal_it(tiny_ldm, client_images):
    """Independent z(T) per image are k noised views of one private
    latent; at the default start timestep their mean is still dominated by the noise."""
    truth = encode_images(tiny_ldm.vae, client_images[0])
    errors = {}
    for draws in (1, 2, 5):
        cfg = config(latents_per_image=draws, num_inference_steps=FedBiPConfig().num_inference_steps)
        payload = upload(tiny_ldm, client_images, cfg, NodeConfig())
        errors[draws] = relative_error(averaging_attack(payload, draws, tiny_ldm.scheduler.alphas_cumprod), truth)
    print(f"averaging attack, relative error by z(T) per image: {errors}")
    assert errors[1] > errors[2] > errors[5], "more views, less noise: the attack is real"
    assert errors[5] > 1.0, "five views of one image gave away its latent"

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
from fedbip_flwr.instance import encode_images, pick_partners, sample_gammas, upload_order
from fedbip_flwr.methods.fedbip import personalize
from fedbip_flwr.payload import Payload
from fedbip_flwr.seeds import client_generator, client_seed
from fedbip_tools.benchmark import row_sources

CLIENT = "sketch-0"


def replay_attack(
    payload: Payload, cfg: FedBiPConfig, alphas_cumprod: torch.Tensor
) -> torch.Tensor:
    """The server's estimate of every z_i(0), from the payload and the run config alone."""
    generator = torch.Generator().manual_seed(client_seed(cfg.seed, payload.meta.client_id))
    order = upload_order(len(payload.labels), generator)
    labels, z_t = torch.empty_like(payload.labels), torch.empty_like(payload.latents.float())
    labels[order], z_t[order] = payload.labels, payload.latents.float()  # the rows as drawn
    partners = pick_partners(labels, generator)
    own = cfg.settings_of("fedbip")
    gammas = sample_gammas(len(labels), own.gamma_mean, own.gamma_std, generator)
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


REPLAYABLE = {"federation.replayable-client-noise": True}
# T = 5 of 200 steps: so little noise that the rows of one image identify it
LOW_T = {"synthesis.start-timestep": 5, "synthesis.num-inference-steps": 200}


def config(latents_per_image: int = 1, **values) -> FedBiPConfig:
    """A tiny run config with ``values`` (run-config keys) over it."""
    flat = {"data.image-size": 32, "synthesis.num-inference-steps": 4, **values}
    return FedBiPConfig.from_flat(flat).with_settings(
        "fedbip", concept_epochs=0, latents_per_image=latents_per_image
    )


def test_the_server_cannot_replay_a_clients_default_noise(tiny_ldm, client_images):
    cfg = config()
    truth = encode_images(tiny_ldm.vae, client_images[0])
    estimate = replay_attack(
        upload(tiny_ldm, client_images, cfg, NodeConfig()), cfg, tiny_ldm.scheduler.alphas_cumprod
    )
    assert relative_error(estimate, truth) > 0.5, "the private latents were recovered"


def test_the_attack_succeeds_under_the_simulation_opt_in(tiny_ldm, client_images):
    """The same attack recovers every latent when the client seeds from the run config."""
    cfg = config(**REPLAYABLE)
    truth = encode_images(tiny_ldm.vae, client_images[0])
    estimate = replay_attack(
        upload(tiny_ldm, client_images, cfg, NodeConfig()), cfg, tiny_ldm.scheduler.alphas_cumprod
    )
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


def identified(estimates: torch.Tensor, truth: torch.Tensor) -> float:
    """The share of images whose estimate correlates best with their own latent (both centred
    on their set's mean: the scale sqrt(abar_T) and what all images share drop out)."""
    a, b = (x.flatten(1) - x.flatten(1).mean(0) for x in (estimates, truth))
    best = (
        torch.nn.functional.normalize(a, dim=1) @ torch.nn.functional.normalize(b, dim=1).T
    ).argmax(1)
    return float((best == torch.arange(len(truth))).float().mean())


def test_the_upload_gives_away_no_order(tiny_ldm, client_images):
    """With k z(T) per image, a server that knew which k rows come from one image could average
    them before testing a candidate. The rows are uploaded in a random order: at a T low enough
    that averaging the right rows identifies every image, averaging rows by their position
    (all a server without the client's generator can do) identifies few."""
    draws, seed = 5, 1234
    cfg = config(draws, **LOW_T)
    payload = upload(tiny_ldm, client_images, cfg, NodeConfig(seed=seed))
    truth = encode_images(tiny_ldm.vae, client_images[0])
    n, rows = len(truth), payload.latents.float()
    source = (
        upload_order(len(rows), torch.Generator().manual_seed(seed)) % n
    )  # replayed with the seed
    grouped = torch.stack([rows[source == i].mean(0) for i in range(n)])
    by_position = rows.view(draws, n, *rows.shape[1:]).mean(0)

    assert identified(grouped, truth) >= 0.9, "the right rows identify their image at this T"
    assert identified(by_position, truth) <= 0.3, "rows in draw order: the order gave images away"


def test_the_benchmarks_oracle_replays_the_upload_order(tiny_ldm, client_images):
    """Under federation.replayable-client-noise the benchmark matches each row to its image (its
    reconstruction scores need it): at a low T the rows it assigns to an image identify it."""
    cfg = config(3, **LOW_T, **REPLAYABLE)
    payload = upload(tiny_ldm, client_images, cfg, NodeConfig())
    truth = encode_images(tiny_ldm.vae, client_images[0])
    rows = payload.latents.float()
    sources = row_sources(CLIENT, len(truth), cfg, 2 * len(rows))[
        : len(rows)
    ]  # two passes: the first
    assert torch.equal(torch.bincount(sources), torch.full((len(truth),), 3))
    grouped = torch.stack([rows[sources == i].mean(0) for i in range(len(truth))])
    assert identified(grouped, truth) >= 0.5, "a wrong order identifies about 1 in 24"

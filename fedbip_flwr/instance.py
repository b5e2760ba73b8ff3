"""Instance-level personalization (paper eq. 3): where z(T) is computed.

    z_i(0)   = VAE(x_i) * scaling_factor                 (each image encoded once)
    zbar_i   = gamma * z_i(0) + (1 - gamma) * z_i'(0),  y_i' = y_i, i' != i, gamma ~ N(0.5, 0.1^2)
    z_i(T)   = sqrt(abar_T) * zbar_i + sqrt(1 - abar_T) * eps     (the scheduler's add_noise)

T is the first timestep the server denoises from (:meth:`fedbip_flwr.sampler.Sampler.first_timestep`),
so the server continues exactly where the client's forward process stopped. Every sampler shares
the model's noise schedule, so the forward noise is the same whichever one denoises. A class with a single image has no partner: that image is
its own partner (zbar = z(0)); the noise at T is the only thing hiding it, so a warning is logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, SchedulerMixin

log = logging.getLogger(__name__)


@torch.no_grad()
def encode_images(vae: AutoencoderKL, images: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """z(0) = E(x) * scaling_factor for images in [-1, 1]; the posterior mean (deterministic).

    ``batch_size`` images per encoder call (run config ldm.vae-batch-size): the encoder's
    full-resolution activations are the client's memory peak at 512 px.
    """
    chunks = []
    for batch in images.split(batch_size):
        batch = batch.to(vae.device, vae.dtype)
        chunks.append(vae.encode(batch).latent_dist.mean.float().cpu())
    return torch.cat(chunks) * float(vae.config.scaling_factor)


def pick_partners(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """For each i a uniformly random i' != i with the same label (i itself if it is alone)."""
    partners = torch.empty_like(labels)
    for label in labels.unique():
        members = (labels == label).nonzero().flatten()
        if len(members) == 1:
            log.warning("class %d has a single image: it is interpolated with itself", label)
            partners[members] = members
            continue
        # offset in 1..n-1 picks uniformly among the other members
        offsets = torch.randint(1, len(members), (len(members),), generator=generator)
        partners[members] = members[(torch.arange(len(members)) + offsets) % len(members)]
    return partners


def sample_gammas(n: int, mean: float, std: float, generator: torch.Generator) -> torch.Tensor:
    """gamma ~ N(mean, std^2) clipped to [0, 1]."""
    return (mean + std * torch.randn(n, generator=generator)).clamp(0.0, 1.0)


def forward_noise(
    noise_schedule: SchedulerMixin, zbar: torch.Tensor, timestep: int, noise: torch.Tensor
) -> torch.Tensor:
    """delta(T, zbar) = sqrt(abar_T) zbar + sqrt(1 - abar_T) eps, via the scheduler itself."""
    t = torch.full((zbar.shape[0],), timestep, dtype=torch.long)
    return noise_schedule.add_noise(zbar, noise, t)


@dataclass(frozen=True)
class InstanceLatents:
    """What instance-level personalization produces; z0 is kept for concept learning.

    ``zT`` holds ``draws`` independent z(T) per image (each its own partner, gamma and
    noise), draw by draw: row ``k * N + i`` comes from image ``i`` (uploaded in
    :func:`upload_order`, which hides that).
    """

    z0: torch.Tensor
    zT: torch.Tensor
    labels: torch.Tensor  # of z0, one per image
    partners: torch.Tensor  # per row of zT
    gammas: torch.Tensor  # per row of zT
    timestep: int

    @property
    def zT_labels(self) -> torch.Tensor:
        """The label of every row of ``zT`` (what the payload's labels are)."""
        return self.labels.repeat(len(self.zT) // len(self.labels))


def upload_order(rows: int, generator: torch.Generator) -> torch.Tensor:
    """The order z(T) rows are uploaded in: upload row j is row ``order[j]`` of
    :class:`InstanceLatents`. A uniform permutation, so the server cannot tell which rows come
    from one image (in draw order it could average an image's K rows, cutting their noise by
    sqrt(K), before testing a candidate against them). Drawn first from the client's generator,
    so a run that lets the server replay that generator (``federation.replayable-client-noise``, the
    benchmark's oracle measurements) can replay the order too, and nothing else can."""
    return torch.randperm(rows, generator=generator)


def personalize_instances(
    vae: AutoencoderKL,
    noise_schedule: SchedulerMixin,
    images: torch.Tensor,
    labels: torch.Tensor,
    timestep: int,
    *,
    gamma_mean: float = 0.5,
    gamma_std: float = 0.1,
    vae_batch_size: int = 8,
    draws: int = 1,
    generator: torch.Generator,
) -> InstanceLatents:
    """Encode once; then ``draws`` times: mix each latent with a same-class partner and
    forward-noise to T (eq. 3). With ``draws`` = m every image gets m independent z(T), so the
    server's m images of it differ by more than the concept perturbation eta."""
    z0 = encode_images(vae, images, vae_batch_size)
    return noise_instances(
        noise_schedule,
        z0,
        labels,
        timestep,
        gamma_mean=gamma_mean,
        gamma_std=gamma_std,
        draws=draws,
        generator=generator,
    )


def noise_instances(
    noise_schedule: SchedulerMixin,
    z0: torch.Tensor,
    labels: torch.Tensor,
    timestep: int,
    *,
    gamma_mean: float = 0.5,
    gamma_std: float = 0.1,
    draws: int = 1,
    generator: torch.Generator,
) -> InstanceLatents:
    """:func:`personalize_instances` from latents already encoded (the server's attacks make
    its reference rows so, from public images it encoded once)."""
    partners, gammas, noised = [], [], []
    for _ in range(draws):
        partners.append(pick_partners(labels, generator))
        gammas.append(sample_gammas(len(labels), gamma_mean, gamma_std, generator))
        g = gammas[-1].view(-1, 1, 1, 1)
        zbar = g * z0 + (1 - g) * z0[partners[-1]]
        noise = torch.randn(z0.shape, generator=generator)
        noised.append(forward_noise(noise_schedule, zbar, timestep, noise))
    return InstanceLatents(
        z0, torch.cat(noised), labels.clone(), torch.cat(partners), torch.cat(gammas), timestep
    )

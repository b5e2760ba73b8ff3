"""Server-side synthesis (paper eq. 5): denoising toward a client's concepts.

    S_hat = S + scale * eta,  eta ~ N(0, sigma^2)
    x~_i  = D( denoise(z_i(T) -> 0 | tau(S_hat, V_{y_i})) )

What every diffusion method shares: the conditioning a client's learned concepts give
(:class:`~fedbip_flwr.shared_concepts.Concepts`, whichever method's upload carried them), the
denoising loop, and starts from fresh noise or a client's latent mixture. FedBiP starts from
each uploaded z(T) itself at exactly its T (:mod:`fedbip_flwr.methods.fedbip`); with a
multiplier m (FedBiP-S/M/L = 2/5/10) every z(T) is denoised m times, each pass with its own eta:
every sampler here is deterministic (DDIM with eta 0), so eta is what makes the m images
differ. ``scale`` is the concept space's typical coordinate size
(:func:`fedbip_flwr.concepts.concept_scale`), so sigma = 0.1 means the same in token and hidden
space. A prompt embedding is computed once per (client, pass, class) and shared by the batch.
The sampler (:mod:`fedbip_flwr.sampler`, run config ``synthesis.scheduler``) steps by the model's
prediction type (epsilon or v-prediction).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .concepts import (
    PromptLayout,
    concept_scale,
    encode_prompts,
    prompt_layout,
    unconditional_embedding,
)
from .config import FedBiPConfig
from .ldm import LDM
from .sampler import Sampler, SchedulerName, TimestepSpacing
from .shared_concepts import Concepts, check_concept_rows
from .upload import PayloadError

if TYPE_CHECKING:
    from diffusers import SchedulerMixin


@dataclass(frozen=True)
class ZSampling:
    """Z-Sampling's zigzag (Espresso's server): at every timestep t above ``threshold``, one
    DDIM step down with the run's guidance, one DDIM inversion step back up to t with the
    weaker ``inverse_guidance``, then the sampler's own step from the new z(t). The round trip
    moves z(t) toward where the guided model puts its class: the condition's semantics enter
    the early, layout-setting steps twice. Both DDIM steps are diffusers' (DDIMScheduler and
    DDIMInverseScheduler on the sampler's noise schedule), one DDIM stride long (1000 / steps),
    which is not the next timestep of a multistep solver's leading grid: the round trip needs
    only to return to t."""

    threshold: int = 800
    inverse_guidance: float = 0.0

    def applies(self, t: torch.Tensor, down: SchedulerMixin) -> bool:
        """Zigzag at t: above the threshold, and a DDIM step below it still on the schedule."""
        return int(t) > self.threshold and int(t) - _ddim_stride(down) >= 0

    def knobs(self) -> tuple:
        """What a shard's pixels depend on here: part of its key."""
        return ("z-sampling", self.threshold, self.inverse_guidance)


@torch.no_grad()
def denoise(
    ldm: LDM,
    z_t: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor,
    sampler: Sampler,
    timestep: int,
    guidance_scale: float,
    pad_to: int | None = None,
    zigzag: ZSampling | None = None,
) -> torch.Tensor:
    """Denoise z(T), T = ``timestep``, to z(0) with classifier-free guidance (and Z-Sampling's
    zigzag at the early steps, when given).

    ``pad_to``: a smaller batch is filled up to this size with copies of its first row, whose
    results are dropped. A compiled UNet compiles a graph per batch size, so without it a
    pass's last, smaller batch would pay a second compile (every row is denoised on its own:
    the padding changes no other row).
    """
    n = len(z_t)
    if pad_to is not None and n < pad_to:
        z_t = torch.cat([z_t, z_t[:1].expand(pad_to - n, *z_t.shape[1:])])
        cond = torch.cat([cond, cond[:1].expand(pad_to - n, *cond.shape[1:])])
    scheduler, timesteps = sampler.start(timestep)
    z = z_t.to(ldm.device, ldm.dtype)
    cond, uncond = cond.to(ldm.device, ldm.dtype), uncond.to(ldm.device, ldm.dtype)
    ddim = zigzag_schedulers(sampler) if zigzag is not None else None
    for i, t in enumerate(timesteps):
        # PNDM's warm-up steps twice at its second timestep and discards the sample it is given
        # the first time: zigzag at a timestep's last occurrence only.
        repeated = i + 1 < len(timesteps) and int(timesteps[i + 1]) == int(t)
        if zigzag is not None and zigzag.applies(t, ddim[0]) and not repeated:
            z = zigzag_step(ldm, z, t, cond, uncond, guidance_scale, zigzag.inverse_guidance, ddim)
        model_in = scheduler.scale_model_input(z, t)
        z = scheduler.step(
            guided_eps(ldm, model_in, t, cond, uncond, guidance_scale), t, z
        ).prev_sample
    return z[:n]


def guided_eps(
    ldm: LDM,
    z: torch.Tensor,
    t: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The model's prediction under classifier-free guidance ``scale``: uncond + scale (cond -
    uncond); scale 1 is the conditional prediction alone and 0 the unconditional one, each one
    UNet pass, any other scale both in one batch."""
    t = torch.as_tensor(t).to(ldm.device)
    if scale in (0.0, 1.0):
        context = cond if scale == 1.0 else uncond.expand_as(cond)
        with ldm.sampling_precision():
            return ldm.unet(z, t, encoder_hidden_states=context).sample.to(z.dtype)
    with ldm.sampling_precision():
        both = ldm.unet(
            torch.cat([z, z]), t, encoder_hidden_states=torch.cat([uncond.expand_as(cond), cond])
        )
    eps_uncond, eps_cond = both.sample.to(z.dtype).chunk(2)
    return eps_uncond + scale * (eps_cond - eps_uncond)


def zigzag_schedulers(sampler: Sampler) -> tuple[SchedulerMixin, SchedulerMixin]:
    """DDIM down and DDIM inversion up, over ``sampler``'s noise schedule, spacing and steps."""
    from diffusers import DDIMInverseScheduler, DDIMScheduler

    config = sampler.scheduler.config
    down = DDIMScheduler.from_config(config, clip_sample=False)
    up = DDIMInverseScheduler.from_config(config, clip_sample=False)
    for scheduler in (down, up):
        scheduler.set_timesteps(sampler.num_inference_steps)
    return down, up


def zigzag_step(
    ldm: LDM,
    z: torch.Tensor,
    t: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor,
    guidance_scale: float,
    inverse_guidance: float,
    ddim: tuple[SchedulerMixin, SchedulerMixin],
) -> torch.Tensor:
    """z(t) -> DDIM one step down under ``guidance_scale`` -> DDIM inversion back to t under
    ``inverse_guidance``: the new z(t). With an exact noise prediction it returns z(t)."""
    down, up = ddim
    lower = down.step(guided_eps(ldm, z, t, cond, uncond, guidance_scale), t, z).prev_sample
    eps = guided_eps(ldm, lower, t - _ddim_stride(down), cond, uncond, inverse_guidance)
    return up.step(eps, t, lower).prev_sample


def _ddim_stride(scheduler: SchedulerMixin) -> int:
    return scheduler.config.num_train_timesteps // scheduler.num_inference_steps


@torch.no_grad()
def decode_latents(ldm: LDM, z0: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """Images in [-1, 1] (float32, CPU) from latents z(0), ``batch_size`` at a time.

    The VAE decoder is the memory peak of synthesis at 512 px (full-resolution activations),
    so it gets its own, smaller batch than the UNet.
    """
    scale = float(ldm.vae.config.scaling_factor)
    with ldm.sampling_precision():
        images = [
            ldm.vae.decode(part.to(ldm.device, ldm.vae.dtype) / scale).sample.float().cpu()
            for part in z0.split(batch_size)
        ]
    return torch.cat(images).clamp(-1.0, 1.0)


@dataclass(frozen=True)
class SynthesisSettings:
    """The sampler's knobs, which clients (noising z(T) to its first timestep) and server share."""

    num_inference_steps: int
    guidance_scale: float
    batch_size: int
    vae_batch_size: int = 8  # run config ldm.vae-batch-size: latents per VAE decode
    n_v: int = 1  # run config data.n-v: with the tokenizer it fixes which rows each V_y uses
    scheduler: SchedulerName = SchedulerName.PNDM
    timestep_spacing: TimestepSpacing = "leading"

    @classmethod
    def from_config(cls, cfg: FedBiPConfig) -> SynthesisSettings:
        """The run's synthesis knobs, which clients and server must share."""
        return cls(
            num_inference_steps=cfg.synthesis.num_inference_steps,
            scheduler=cfg.synthesis.scheduler,
            timestep_spacing=cfg.synthesis.timestep_spacing,
            guidance_scale=cfg.synthesis.guidance_scale,
            batch_size=cfg.synthesis.batch_size,
            vae_batch_size=cfg.ldm.vae_batch_size,
            n_v=cfg.data.n_v,
        )

    def sampler(self, ldm: LDM) -> Sampler:
        return Sampler.create(
            self.scheduler, ldm.scheduler, self.num_inference_steps, self.timestep_spacing
        )

    def sampling_knobs(self) -> tuple:
        """What an image's pixels depend on beyond its input: part of every shard's key."""
        return (
            self.num_inference_steps,
            self.guidance_scale,
            self.batch_size,
            str(self.scheduler),
            self.timestep_spacing,
        )


def concept_layout(ldm: LDM, concepts: Concepts, settings: SynthesisSettings) -> PromptLayout:
    """The client's prompt layout, rebuilt from its concepts and the run config's data.n-v.

    S's size is its row count (never fewer than its phrase's tokens). V is one tensor, so
    which of its rows V_y uses depends on data.n-v: validation with the server's token counts has
    matched them already, and the check here catches synthesis run with another data.n-v.
    """
    n_s = len(concepts.domain)
    layout = prompt_layout(
        ldm.tokenizer,
        concepts.template,
        n_s,
        settings.n_v,
        concepts.domain_phrase,
        list(concepts.concept_names),
        warn=False,
    )
    if layout.n_s != n_s:
        raise PayloadError(
            f"S of {concepts.owner} has {n_s} vectors but its domain phrase "
            f"'{concepts.domain_phrase}' is {layout.n_s} tokens: a concept starts from its whole "
            "phrase"
        )
    check_concept_rows(concepts.classes, layout.v_lengths.tolist(), concepts.concept_names)
    return layout


def pass_conditioning(
    ldm: LDM, concepts: Concepts, settings: SynthesisSettings, eta: torch.Tensor
) -> torch.Tensor:
    """tau(S + scale * eta, V) for every row of V (a class's, or with class-clusters a
    sub-cluster's, class-major): (C x class_clusters, L, d), one pass's prompt embeddings."""
    layout = concept_layout(ldm, concepts, settings)
    s_hat = concepts.domain + concept_scale(ldm, concepts.space) * eta
    rows = torch.arange(len(concepts.concept_names))
    return encode_prompts(ldm, layout, concepts.space, s_hat, concepts.classes, rows)


def draw_etas(concepts: Concepts, passes: int, eta_std: float, seed: int) -> torch.Tensor:
    """(passes, n_s, d) perturbations of S in units of the concept scale, reproducible from
    the seed."""
    generator = torch.Generator().manual_seed(seed)
    shape = (passes, *concepts.domain.shape)
    return eta_std * torch.randn(shape, generator=generator)


@torch.no_grad()
def encode_texts(ldm: LDM, texts: list[str]) -> torch.Tensor:
    """Plain text -> the text encoder's hidden states (len(texts), L, d): the conditioning a
    prompt gives the UNet."""
    tok = ldm.tokenizer
    ids = tok(
        texts,
        padding="max_length",
        max_length=tok.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids
    return ldm.text_encoder(ids.to(ldm.device)).last_hidden_state


@torch.no_grad()
def iter_from_noise(
    ldm: LDM,
    cond_per_class: torch.Tensor,
    labels: torch.Tensor,
    settings: SynthesisSettings,
    generator: torch.Generator,
    conditions: torch.Tensor | None = None,
) -> Iterator[torch.Tensor]:
    """Images (batches in [-1, 1], float32, CPU) from fresh Gaussian noise over the full
    schedule, guided toward each label's conditioning ``cond_per_class[label]`` (C, L, d), or
    toward row ``conditions[i]`` when given.

    How every method without uploaded latents samples (Prompts-only, OSCAR's per-class caption
    embeddings). The noise comes from ``generator`` batch by batch, so the images do not
    depend on how many were drawn before them in other shards.
    """
    shape = ldm.latent_shape()
    first = settings.sampler(ldm).first_timestep()
    yield from iter_denoised(
        ldm,
        cond_per_class,
        labels,
        settings,
        first,
        lambda batch: torch.randn((len(batch), *shape), generator=generator),
        conditions,
    )


@torch.no_grad()
def iter_denoised(
    ldm: LDM,
    cond_per_class: torch.Tensor,
    labels: torch.Tensor,
    settings: SynthesisSettings,
    timestep: int,
    start: Callable[[torch.Tensor], torch.Tensor],
    conditions: torch.Tensor | None = None,
    zigzag: ZSampling | None = None,
) -> Iterator[torch.Tensor]:
    """Images (batches in [-1, 1], float32, CPU) denoised from ``timestep``, each from the
    z(T) ``start(batch_labels)`` draws for it (fresh noise, or a client's latent mixture),
    guided toward row ``conditions[i]`` of ``cond_per_class`` (K, L, d); without
    ``conditions``, toward its label's row."""
    uncond = unconditional_embedding(ldm)
    sampler = settings.sampler(ldm)
    rows = labels if conditions is None else conditions
    for batch, chosen in zip(
        labels.split(settings.batch_size), rows.split(settings.batch_size), strict=True
    ):
        cond = cond_per_class[chosen.to(cond_per_class.device)].to(ldm.device, ldm.dtype)
        z0 = denoise(
            ldm,
            start(batch),
            cond,
            uncond,
            sampler,
            timestep,
            settings.guidance_scale,
            ldm.batch_bucket(settings.batch_size),
            zigzag,
        )
        yield decode_latents(ldm, z0, settings.vae_batch_size)

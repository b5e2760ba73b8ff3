"""What the server expects of an upload of z(T) and concepts, from its run config and base model.

FedBiP's payload contract (:mod:`fedbip_flwr.payload`) checks an upload against an
:class:`~fedbip_flwr.payload.Expectations`; this builds it from the server's own side, including
what honest numbers look like under its model (:class:`~fedbip_flwr.payload.Plausibility`).
The mixture methods check their uploads against the same expectations.
"""

from __future__ import annotations

import functools

import torch

from .concepts import concept_scale, count_tokens, prompt_layout
from .config import FedBiPConfig
from .ldm import LDM
from .method_settings import FedBiPSettings, FedBiPStepSettings
from .payload import Expectations, Plausibility, adam_step_bound
from .synthesis import SynthesisSettings


def expectations(
    cfg: FedBiPConfig, ldm: LDM, class_names: list[str], own: FedBiPStepSettings | None
) -> Expectations:
    """What every payload must agree with: the server's config and its base model, including
    the statistics an honest upload has under that model (:class:`Plausibility`). The concept
    and z(T) row fields come from ``own``, the method's settings where its upload carries
    FedBiP's concepts; None for an upload without them (FedLD, Espresso), never checked against
    those fields, which then hold the defaults."""
    own = own or FedBiPSettings()
    sampler = SynthesisSettings.from_config(cfg).sampler(ldm)
    timestep = sampler.first_timestep(cfg.synthesis.start_timestep)
    return Expectations(
        max_bytes=int(cfg.federation.max_payload_mb * 2**20),
        base_model=ldm.fingerprint,
        latent_shape=ldm.latent_shape(cfg.data.image_size),
        concept_dim=ldm.concept_dim,
        timestep=timestep,
        num_inference_steps=cfg.synthesis.num_inference_steps,
        scheduler=sampler.name,
        n_s=cfg.data.n_s,
        n_v=cfg.data.n_v,
        concept_space=own.concept_space,
        class_names=tuple(class_names),
        prompt_template=cfg.data.prompt_template,
        domains=tuple(cfg.data.domain_list),
        phrase_tokens=functools.partial(count_tokens, ldm.tokenizer),
        layout=functools.partial(prompt_layout, ldm.tokenizer, warn=False),
        plausibility=plausibility(own, ldm, timestep),
        class_clusters=own.class_clusters,
    )


def plausibility(own: FedBiPStepSettings, ldm: LDM, timestep: int) -> Plausibility:
    """The noise level at T and the concept scale and learning budget, for the moment checks."""
    scale = concept_scale(ldm, own.concept_space)
    return Plausibility(
        alpha_bar=float(ldm.scheduler.alphas_cumprod[timestep]),
        concept_scale=scale,
        concept_init_rms=concept_init_rms(ldm, own.concept_space) / scale,
        concept_step=own.concept_lr * adam_step_bound(),
        concept_epochs=own.concept_epochs,
        concept_batch_size=own.concept_batch_size,
        latents_per_image=own.latents_per_image,
    )


@torch.no_grad()
def concept_init_rms(ldm: LDM, space: str) -> float:
    """The largest RMS a concept's initial vector can have: a row of the token embedding table,
    or (hidden) an output of the text encoder's final LayerNorm, gamma * xhat + beta with
    RMS(xhat) = 1, so at most max|gamma| + RMS(beta)."""
    if space == "token":
        table = ldm.text_encoder.get_input_embeddings().weight.float()
        return float(table.pow(2).mean(-1).sqrt().max())
    norm = next(
        m for name, m in ldm.text_encoder.named_modules() if name.endswith("final_layer_norm")
    )
    return float(norm.weight.float().abs().max() + norm.bias.float().pow(2).mean().sqrt())

"""A client's whole job: private images -> z(T) and concepts -> one payload (Algorithm 1, ClientUpdate).

Plain library code: the Flower ClientApp only loads the partition and calls :func:`personalize`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from .concepts import learn_concepts, prompt_layout
from .config import FedBiPConfig
from .instance import personalize_instances, start_timestep
from .ldm import LDM
from .payload import SCHEMA_VERSION, Payload, PayloadMeta

log = logging.getLogger(__name__)

LATENT_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass
class ClientReport:
    """What the client tells the server besides the payload (timings, loss curve)."""

    seconds: dict[str, float] = field(default_factory=dict)
    concept_losses: list[float] = field(default_factory=list)


def personalize(
    ldm: LDM,
    images: torch.Tensor,
    labels: torch.Tensor,
    class_names: list[str],
    domain: str,
    client_id: str,
    cfg: FedBiPConfig,
    seed: int,
) -> tuple[Payload, ClientReport]:
    """Instance level (z(T)) then concept level (S, V); returns the payload to upload once."""
    report = ClientReport()
    generator = torch.Generator().manual_seed(seed)
    timestep = start_timestep(ldm.scheduler, cfg.num_inference_steps, cfg.start_timestep)

    started = time.perf_counter()
    instances = personalize_instances(
        ldm.vae,
        ldm.scheduler,
        images,
        labels,
        timestep,
        gamma_mean=cfg.gamma_mean,
        gamma_std=cfg.gamma_std,
        generator=generator,
    )
    report.seconds["instance"] = time.perf_counter() - started

    started = time.perf_counter()
    layout = prompt_layout(
        ldm.tokenizer, cfg.prompt_template, cfg.n_s, cfg.n_v, domain, class_names
    )
    concepts = learn_concepts(
        ldm,
        layout,
        cfg.concept_space,
        instances.z0,
        instances.labels,
        timestep,
        epochs=cfg.concept_epochs,
        batch_size=cfg.concept_batch_size,
        lr=cfg.concept_lr,
        generator=generator,
        on_epoch=lambda e, loss: log.info(
            "[%s] concept epoch %d/%d loss %.4f", client_id, e + 1, cfg.concept_epochs, loss
        ),
    )
    report.seconds["concept"] = time.perf_counter() - started
    report.concept_losses = concepts.losses

    meta = PayloadMeta(
        schema_version=SCHEMA_VERSION,
        client_id=client_id,
        domain=domain,
        timestep=timestep,
        scheduler=type(ldm.scheduler).__name__,
        num_inference_steps=cfg.num_inference_steps,
        n_s=cfg.n_s,
        n_v=cfg.n_v,
        concept_space=cfg.concept_space,
        class_names=list(class_names),
        prompt_template=cfg.prompt_template,
        base_model=ldm.fingerprint,
        latent_shape=list(instances.zT.shape[1:]),
        latent_dtype=cfg.latent_dtype,
        num_examples=len(labels),
    )
    payload = Payload(
        latents=instances.zT.to(LATENT_DTYPES[cfg.latent_dtype]).contiguous(),
        labels=instances.labels.to(torch.int64),
        domain_concept=concepts.domain,
        class_concepts=concepts.classes,
        meta=meta,
    )
    return payload, report

"""A client's side: its own randomness, FedBiP's personalization (Algorithm 1, ClientUpdate),
and scoring the classifier it gets back.

Plain library code. Which method's upload a client computes is
:func:`fedbip_flwr.methods.institution_upload`; FedBiP's is :func:`personalize`.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .classifier import evaluate
from .clusters import cluster_images, public_encoder
from .concepts import learn_concepts, prompt_layout
from .config import FedBiPConfig
from .instance import personalize_instances
from .ldm import LDM
from .paths import resolve
from .payload import SCHEMA_VERSION, Payload, PayloadMeta
from .shapes import ImageSet
from .synthesis import SynthesisSettings

log = logging.getLogger(__name__)

LATENT_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass
class ClientReport:
    """What the client tells the server besides the payload (timings, loss curve)."""

    seconds: dict[str, float] = field(default_factory=dict)
    concept_losses: list[float] = field(default_factory=list)
    concept_drift: dict[str, float] = field(default_factory=dict)  # ||S-S0||/||S0||, mean for V


def personalize(
    ldm: LDM,
    images: torch.Tensor,
    labels: torch.Tensor,
    class_names: list[str],
    domain: str,
    client_id: str,
    cfg: FedBiPConfig,
    generator: torch.Generator,
) -> tuple[Payload, ClientReport]:
    """Instance level (z(T)) then concept level (S, V); returns the payload to upload once.

    ``generator`` is all the randomness used: see :func:`client_generator` for where it must
    come from to keep z(T) private.
    """
    report = ClientReport()
    sampler = SynthesisSettings.from_config(cfg).sampler(ldm)  # the server's sampler: z(T) is noised for it
    timestep = sampler.first_timestep(cfg.start_timestep)

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
        vae_batch_size=cfg.vae_batch_size,
        draws=cfg.latents_per_image,
    )
    report.seconds["instance"] = time.perf_counter() - started

    started = time.perf_counter()
    clusters = cfg.class_clusters
    sub = sub_clusters(images, labels, cfg, ldm.device)
    concept_names = [name for name in class_names for _ in range(clusters)]
    layout = prompt_layout(
        ldm.tokenizer, cfg.prompt_template, cfg.n_s, cfg.n_v, domain, concept_names
    )

    def on_epoch(epoch: int, loss: float) -> None:
        bar.set_postfix(loss=f"{loss:.4f}")
        bar.update()
        log.info("[%s] concept epoch %d/%d loss %.4f", client_id, epoch + 1, cfg.concept_epochs, loss)

    with tqdm(total=cfg.concept_epochs, desc=f"concepts {client_id}", unit="epoch",
              mininterval=5) as bar:
        concepts = learn_concepts(
            ldm,
            layout,
            cfg.concept_space,
            instances.z0,
            instances.labels * clusters + sub,
            timestep,
            epochs=cfg.concept_epochs,
            batch_size=cfg.concept_batch_size,
            lr=cfg.concept_lr,
            generator=generator,
            on_epoch=on_epoch,
        )
    report.seconds["concept"] = time.perf_counter() - started
    report.concept_losses = concepts.losses
    report.concept_drift = {"s": concepts.domain_drift, "v": concepts.class_drift}

    meta = PayloadMeta(
        schema_version=SCHEMA_VERSION,
        client_id=client_id,
        domain=domain,
        timestep=timestep,
        scheduler=sampler.name,
        num_inference_steps=cfg.num_inference_steps,
        n_s=layout.n_s,
        n_v=layout.n_v,
        concept_space=cfg.concept_space,
        class_names=list(class_names),
        prompt_template=cfg.prompt_template,
        base_model=ldm.fingerprint,
        latent_shape=list(instances.zT.shape[1:]),
        latent_dtype=cfg.latent_dtype,
        num_examples=len(instances.zT),
        class_clusters=clusters,
    )
    payload = Payload(
        latents=instances.zT.to(LATENT_DTYPES[cfg.latent_dtype]).contiguous(),
        labels=instances.zT_labels.to(torch.int64),
        domain_concept=concepts.domain,
        class_concepts=concepts.classes,
        meta=meta,
        # each z(T) is denoised with its own image's sub-cluster's concept
        latent_clusters=sub.repeat(cfg.latents_per_image) if clusters > 1 else None,
    )
    return payload, report


def sub_clusters(images: torch.Tensor, labels: torch.Tensor, cfg: FedBiPConfig, device: torch.device) -> torch.Tensor:
    """Each image's sub-cluster within its class (run config class-clusters; all 0 for one
    concept per class), from the public encoder shipped with the base model."""
    if cfg.class_clusters == 1:
        return torch.zeros_like(labels)
    encoder = public_encoder(cfg.model, cfg.classifier_image_size, device)
    return cluster_images(images, labels, cfg.class_clusters, encoder)


def score_classifier(model: torch.nn.Module, test: ImageSet, image_size: int) -> dict:
    """What an institution reports about the classifier it got back: metrics only, no images."""
    result = evaluate(model, test.images, test.labels, image_size)
    classes = len(test.classes)
    correct = torch.bincount(test.labels[result.predictions == test.labels], minlength=classes)
    total = torch.bincount(test.labels, minlength=classes)
    return {
        "accuracy": result.accuracy,
        "num-examples": len(test.labels),
        "per-class-correct": correct.tolist(),
        "per-class-total": total.tolist(),
    }


def kept_classifier_path(output_dir: str, run_folder: str, client_id: str) -> Path:
    """Where an institution keeps the classifier sent back: its own output folder, per run.

    The run folder's name comes from the server, so it must be a plain name, never a path.
    """
    if not re.fullmatch(r"\w[\w.-]{0,127}", run_folder):
        raise ValueError(f"the server named the run folder {run_folder!r}, which is not a plain name")
    return resolve(output_dir) / run_folder / "institutions" / client_id / "classifier.safetensors"

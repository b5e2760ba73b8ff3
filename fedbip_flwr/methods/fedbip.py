"""FedBiP (this paper): z(T) of interpolated latents plus learned concepts S and V, uploaded
once; the server denoises every z(T) m times with the client's concepts.

The client step (:func:`personalize`, Algorithm 1's ClientUpdate) and the server's work units
and shards (:func:`synthesize_all`) are here; the building blocks they use are named for the
step they implement: :mod:`fedbip_flwr.instance` (z(T)), :mod:`fedbip_flwr.concepts` (S, V),
:mod:`fedbip_flwr.payload` (the upload's contract) and :mod:`fedbip_flwr.synthesis` (eq. 5).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..clusters import cluster_images, public_encoder
from ..concepts import (
    DPSGD,
    LearnedConcepts,
    PromptLayout,
    learn_concepts,
    prompt_layout,
    unconditional_embedding,
)
from ..config import FedBiPConfig
from ..expectations import expectations
from ..instance import personalize_instances, upload_order
from ..ldm import LDM, configured_latent_shape
from ..method_settings import FedBiPSettings, FedBiPStepSettings, PassSettings
from ..payload import (
    TENSOR_NAMES,
    Payload,
    PayloadMeta,
    check_expectations,
    check_payload,
    encode_payload,
    payload_tensor_names,
)
from ..policy import UploadKind
from ..progress import Progress
from ..results import SENT_CONCEPT_LOSSES
from ..seeds import client_seed
from ..server import ShardMode, WorkUnit, keyed_shard, shard_key
from ..shared_concepts import Concepts
from ..synthesis import (
    SynthesisSettings,
    decode_latents,
    denoise,
    draw_etas,
    pass_conditioning,
)
from ..upload import SCHEMA_VERSION
from .base import (
    ClientJob,
    Method,
    ServerJob,
    Upload,
    check_class_rows,
    check_image_count,
    fresh_noise_set,
    register,
)

log = logging.getLogger(__name__)

LATENT_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass
class ClientReport:
    """What the client tells the server besides the payload (timings, loss curve)."""

    seconds: dict[str, float] = field(default_factory=dict)
    concept_losses: list[float] = field(default_factory=list)
    concept_drift: dict[str, float] = field(default_factory=dict)  # ||S-S0||/||S0||, mean for V


# --- the client step ---------------------------------------------------------------------------


def personalize(
    ldm: LDM,
    images: torch.Tensor,
    labels: torch.Tensor,
    class_names: list[str],
    domain: str,
    client_id: str,
    cfg: FedBiPConfig,
    generator: torch.Generator,
    own: FedBiPStepSettings | None = None,
) -> tuple[Payload, ClientReport]:
    """Instance level (z(T)) then concept level (S, V) under ``own`` (default: the run's
    ``fedbip`` table); returns the payload to upload once.

    ``generator`` is all the randomness used: see :func:`fedbip_flwr.seeds.client_generator` for where it must
    come from to keep z(T) private.
    """
    own = own or fedbip_settings(cfg)
    report = ClientReport()
    sampler = SynthesisSettings.from_config(cfg).sampler(
        ldm
    )  # the server's sampler: z(T) is noised for it
    timestep = sampler.first_timestep(cfg.synthesis.start_timestep)

    order = upload_order(len(labels) * own.latents_per_image, generator)
    started = time.perf_counter()
    instances = personalize_instances(
        ldm.vae,
        ldm.scheduler,
        images,
        labels,
        timestep,
        gamma_mean=own.gamma_mean,
        gamma_std=own.gamma_std,
        generator=generator,
        vae_batch_size=cfg.ldm.vae_batch_size,
        draws=own.latents_per_image,
    )
    report.seconds["instance"] = time.perf_counter() - started

    started = time.perf_counter()
    clusters = own.class_clusters
    sub = sub_clusters(images, labels, cfg, clusters, ldm.device)
    layout, concepts = client_concepts(
        ldm,
        instances.z0,
        instances.labels * clusters + sub,
        class_names,
        domain,
        client_id,
        cfg,
        own,
        timestep,
        generator,
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
        num_inference_steps=cfg.synthesis.num_inference_steps,
        n_s=layout.n_s,
        n_v=layout.n_v,
        concept_space=own.concept_space,
        class_names=list(class_names),
        prompt_template=cfg.data.prompt_template,
        base_model=ldm.fingerprint,
        latent_shape=list(instances.zT.shape[1:]),
        latent_dtype=own.latent_dtype,
        num_examples=len(instances.zT),
        class_clusters=clusters,
    )
    payload = Payload(
        latents=instances.zT[order].to(LATENT_DTYPES[own.latent_dtype]).contiguous(),
        labels=instances.zT_labels[order].to(torch.int64),
        domain_concept=concepts.domain,
        class_concepts=concepts.classes,
        meta=meta,
        # each z(T) is denoised with its own image's sub-cluster's concept
        latent_clusters=sub.repeat(own.latents_per_image)[order] if clusters > 1 else None,
    )
    return payload, report


def client_concepts(
    ldm: LDM,
    z0: torch.Tensor,
    concept_labels: torch.Tensor,
    class_names: list[str],
    domain: str,
    client_id: str,
    cfg: FedBiPConfig,
    own: FedBiPStepSettings,
    timestep: int,
    generator: torch.Generator,
    privacy: DPSGD | None = None,
) -> tuple[PromptLayout, LearnedConcepts]:
    """FedBiP's concept level on the client's latents ``z0``: S and V (one V per class and
    sub-cluster, ``concept_labels`` = label x class-clusters + sub-cluster) learned with
    ``own``'s budget, by DP-SGD with ``privacy``."""
    clusters = own.class_clusters
    concept_names = [name for name in class_names for _ in range(clusters)]
    layout = prompt_layout(
        ldm.tokenizer, cfg.data.prompt_template, cfg.data.n_s, cfg.data.n_v, domain, concept_names
    )

    progress = Progress(log, f"[{client_id}] concepts", own.concept_epochs, "epochs")
    concepts = learn_concepts(
        ldm,
        layout,
        own.concept_space,
        z0,
        concept_labels,
        timestep,
        epochs=own.concept_epochs,
        batch_size=own.concept_batch_size,
        lr=own.concept_lr,
        generator=generator,
        on_epoch=lambda _epoch, loss: progress.update(note=f"loss {loss:.4f}"),
        privacy=privacy,
    )
    losses = concepts.losses
    progress.finish(
        (f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; " if losses else "")
        + f"S moved {concepts.domain_drift:.2f}, V {concepts.class_drift:.2f} of their start"
    )
    return layout, concepts


def sub_clusters(
    images: torch.Tensor,
    labels: torch.Tensor,
    cfg: FedBiPConfig,
    clusters: int,
    device: torch.device,
) -> torch.Tensor:
    """Each image's sub-cluster within its class (``clusters`` per class, the method's
    class-clusters; all 0 for one concept per class), from the public encoder shipped with the
    base model."""
    if clusters == 1:
        return torch.zeros_like(labels)
    encoder = public_encoder(cfg.ldm.model, cfg.classifier.image_size, device)
    return cluster_images(images, labels, clusters, encoder)


def fedbip_settings(cfg: FedBiPConfig) -> FedBiPSettings:
    """The run's ``fedbip`` table."""
    settings = cfg.settings_of(FedBiP.name)
    assert isinstance(settings, FedBiPSettings)
    return settings


# --- the method ------------------------------------------------------------------------------


@register
class FedBiP(Method):
    name = "fedbip"
    # uploads: z(T) per image, S and V, labels
    uploads = frozenset({UploadKind.LATENTS, UploadKind.CONCEPTS, UploadKind.COUNTS})
    settings: FedBiPSettings
    meta_model = PayloadMeta
    tensor_names = TENSOR_NAMES

    def upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        data = job.data
        payload, report = personalize(
            job.ldm(),
            data.images,
            data.labels,
            list(data.classes),
            data.domain,
            data.client_id,
            job.cfg,
            job.generator,
            self.settings,
        )
        blob = encode_payload(payload)
        return blob, {
            "seconds-instance": report.seconds["instance"],
            "seconds-concept": report.seconds["concept"],
            SENT_CONCEPT_LOSSES: report.concept_losses,
            "concept-drift-s": report.concept_drift["s"],
            "concept-drift-v": report.concept_drift["v"],
        }

    def upload_floor(self, cfg: FedBiPConfig, images: int) -> int:
        """The z(T) alone: latents-per-image rows per image, each a latent of the run's model
        at data.image-size, in the table's latent-dtype (read from the model's VAE config only)."""
        own = self.settings
        values = math.prod(configured_latent_shape(cfg.ldm.model, cfg.data.image_size))
        itemsize = torch.finfo(getattr(torch, own.latent_dtype)).bits // 8
        return images * own.latents_per_image * values * itemsize

    def tensor_names_of(self, server: ServerJob, metadata: Mapping[str, str]) -> tuple[str, ...]:
        """With class-clusters > 1 a payload also holds each z(T)'s sub-cluster, as its
        metadata says; :meth:`check` refuses a count other than the server's."""
        return payload_tensor_names(dict(metadata))

    def check_alone(self, upload: Upload) -> Upload:
        """The payload contract that needs no model: shapes, dtypes and labels agree with the
        metadata (docs/payload.md)."""
        payload = Payload(**upload.tensors, meta=upload.meta)
        check_payload(payload)
        return as_upload(payload)

    def check(self, upload: Upload, server: ServerJob) -> Upload:
        """The payload against the server's model and config (docs/payload.md), and the images
        its z(T) stand for within run config federation.max-images-per-client, as every upload's
        claimed images are."""
        own, payload = self.settings, upload.content
        check_expectations(payload, expectations(server.cfg, server.ldm(), server.class_names, own))
        rows, per_image = payload.meta.num_examples, own.latents_per_image
        what = f"num_examples {rows} ({per_image} z(T) per image)"
        check_image_count(-(-rows // per_image), server.cfg.federation.max_images_per_client, what)
        check_class_rows(payload.labels, server.class_names, server.cfg.class_cap, per_image)
        return upload

    def train_set(
        self,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> dict[str, list[Path]]:
        payloads = {client_id: upload.content for client_id, upload in uploads.items()}
        if self.settings.synthesis_start == "fresh-noise":
            return concept_only(payloads, server, self.settings, shard_path)
        return synthesize_all(
            server.ldm(), payloads, server.cfg, shard_path, server.shard_mode, self.settings
        )

    def work_units(self, uploads: Mapping[str, Upload], server: ServerJob) -> list[WorkUnit]:
        """One per (client, pass): the shards :meth:`train_set` writes, one by one."""
        payloads = {client_id: upload.content for client_id, upload in uploads.items()}
        return synthesis_units(payloads, self.settings.multiplier)

    def make_unit(
        self,
        unit: WorkUnit,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> list[Path]:
        payload = uploads[unit.client_id].content
        if self.settings.synthesis_start == "fresh-noise":
            return [concept_only_unit(payload, server, self.settings, unit, shard_path)]
        mode, own = server.shard_mode, self.settings
        return [synthesize_unit(server.ldm(), payload, server.cfg, own, unit, shard_path, mode)]


def concept_only(
    payloads: Mapping[str, Payload],
    server: ServerJob,
    own: PassSettings,
    shard_path: Callable[[str, int], Path],
) -> dict[str, list[Path]]:
    """The paper's concept-only ablation: each pass's images from fresh noise toward the
    client's learned concepts (S perturbed by that pass's eta, as in synthesis), never from
    its z(T); as many images as FedBiP makes, in the same (client, pass) units."""
    out: dict[str, list[Path]] = {}
    for unit in synthesis_units(payloads, own.multiplier):
        path = concept_only_unit(payloads[unit.client_id], server, own, unit, shard_path)
        out.setdefault(unit.client_id, []).append(path)
    return out


def concept_only_unit(
    payload: Payload,
    server: ServerJob,
    own: PassSettings,
    unit: WorkUnit,
    shard_path: Callable[[str, int], Path],
) -> Path:
    """One concept-only shard: pass ``unit.index``'s eta, noise of that pass's own."""
    settings, concepts = SynthesisSettings.from_config(server.cfg), payload.concepts
    eta = pass_eta(concepts, own, server.cfg.seed, unit)
    return fresh_noise_set(
        server,
        f"{unit.client_id}/pass{unit.index}",
        pass_conditioning(server.ldm(), concepts, settings, eta),
        payload.labels,
        shard_path(unit.client_id, unit.index),
        None if payload.latent_clusters is None else payload.concept_rows,
    )


def as_upload(payload: Payload) -> Upload:
    """A decoded (validated) payload as the server keeps every method's upload."""
    return Upload(meta=payload.meta, tensors=payload.tensors(), content=payload)


# --- denoising a client's z(T) (paper eq. 5) ------------------------------------------------------


def iter_pass(
    ldm: LDM,
    payload: Payload,
    settings: SynthesisSettings,
    eta: torch.Tensor,
    on_batch: Callable[[int], None] | None = None,
) -> Iterator[torch.Tensor]:
    """One pass over a client's z(T) with the domain concept shifted by scale * ``eta``
    (n_s, d), one batch at a time (images in [-1, 1], float32, CPU), in order.

    The server writes each batch to its shard as it comes, so a pass is never whole in memory.
    """
    cond_per_row = pass_conditioning(ldm, payload.concepts, settings, eta)
    uncond = unconditional_embedding(ldm)
    sampler = settings.sampler(ldm)
    rows = payload.concept_rows
    for batch in torch.arange(len(payload.labels)).split(settings.batch_size):
        cond = cond_per_row[rows[batch].to(cond_per_row.device)]
        z0 = denoise(
            ldm,
            payload.latents[batch].float(),
            cond,
            uncond,
            sampler,
            payload.meta.timestep,
            settings.guidance_scale,
            ldm.batch_bucket(settings.batch_size),
        )
        images = decode_latents(ldm, z0, settings.vae_batch_size)
        if on_batch is not None:
            on_batch(len(batch))
        yield images


def pass_eta(concepts: Concepts, own: PassSettings, seed: int, unit: WorkUnit) -> torch.Tensor:
    """The perturbation of S of pass ``unit.index`` over ``unit.client_id``'s z(T)."""
    return draw_etas(concepts, own.multiplier, own.eta_std, client_seed(seed, unit.client_id))[
        unit.index
    ]


# --- the server's work units and shards -----------------------------------------------------------


def payload_digest(payload: Payload) -> str:
    """sha256 over a payload's metadata and tensors: what its shards are made from."""
    digest = hashlib.sha256(payload.meta.model_dump_json().encode())
    for tensor in payload.tensors().values():
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def synthesis_units(payloads: Mapping[str, Payload], multiplier: int) -> list[WorkUnit]:
    """FedBiP's work: one unit per (client, pass), clients in name order, passes in order."""
    return [
        WorkUnit(client_id, index, len(payload.labels))
        for client_id, payload in sorted(payloads.items())
        for index in range(multiplier)
    ]


def synthesize_all(
    ldm: LDM,
    payloads: Mapping[str, Payload],
    cfg: FedBiPConfig,
    shard_path: Callable[[str, int], Path],
    mode: ShardMode = ShardMode.MAKE,
    own: PassSettings | None = None,
) -> dict[str, list[Path]]:
    """FedBiP's synthetic shards per client, in pass order (``own``'s passes; default: the
    run's ``fedbip`` table); shards on disk are reused.

    Each shard holds one pass over a client's z(T) as uint8 (what a PNG holds), written batch by
    batch as synthesis goes (a pass is never whole in memory) and atomically. The classifier
    reads the shards back (:class:`ShardImages`), so a resumed run trains on exactly the bytes
    an uninterrupted one would. Every shard depends only on its own payload, pass and seed,
    never on which shards were made before it, which is what lets `fedbip synthesize` make
    them in other processes (:func:`synthesis_units`). Under ``mode`` CHECK none is made
    (:class:`~fedbip_flwr.server.ShardMode`).
    """
    own = own or fedbip_settings(cfg)
    units = synthesis_units(payloads, own.multiplier)
    out: dict[str, list[Path]] = {}
    progress = Progress(log, "synthesis", sum(u.images for u in units), "images")
    for unit in units:
        payload = payloads[unit.client_id]
        path = synthesize_unit(ldm, payload, cfg, own, unit, shard_path, mode, progress.update)
        out.setdefault(unit.client_id, []).append(path)
    progress.finish()
    return out


def synthesize_unit(
    ldm: LDM,
    payload: Payload,
    cfg: FedBiPConfig,
    own: PassSettings,
    unit: WorkUnit,
    shard_path: Callable[[str, int], Path],
    mode: ShardMode,
    on_images: Callable[[int], None] | None = None,
) -> Path:
    """One FedBiP shard: pass ``unit.index`` over the client's z(T), with that pass's eta."""
    settings = SynthesisSettings.from_config(cfg)
    eta = pass_eta(payload.concepts, own, cfg.seed, unit)
    return keyed_shard(
        shard_path(unit.client_id, unit.index),
        shard_key((payload_digest(payload), *settings.sampling_knobs()), eta),
        payload.labels,
        functools.partial(iter_pass, ldm, payload, settings, eta, on_images),
        mode=mode,
        on_reuse=on_images,
    )

"""Espresso (Guiding Diffusion Models with Fine-Grained Conditions and Semantics-Preserving
Sampling for One-Shot FL; CVPR 2026), an instance-free peer: no per-image latent leaves a client.

Client:
1. each class's images are split into ``espresso.clusters`` sub-clusters, agglomerative (ward)
   clustering of a frozen public encoder's features (:mod:`fedbip_flwr.clusters`);
2. one cross-attention condition per (class, sub-cluster), learned with the frozen LDM's
   diffusion loss on that sub-cluster's latents (:mod:`fedbip_flwr.conditions`);
3. same-class latents mixed (FedBiP's gamma ~ N(gamma-mean, gamma-std^2)) and forward-noised
   to T ``espresso.noisings`` times with fresh noise; per class a diagonal Gaussian mixture of
   ``espresso.components`` components fitted to those z(T) (:mod:`fedbip_flwr.mixture`).
The upload: the conditions, the mixture and the per-class counts.

Server: as many images per client as FedBiP makes from it, each from a z(T) drawn from its
class's mixture and one of the class's conditions chosen uniformly, with classifier-free
guidance; with ``espresso.z-sampling`` Z-Sampling's zigzag at the timesteps above
``espresso.z-threshold`` (:class:`fedbip_flwr.synthesis.ZSampling`).

Checks: the mixture's (:func:`fedbip_flwr.methods.fedld.check_mixture_upload`), and every
condition within the distance of its starting point (tau of the plain prompt, which the server
rebuilds) that the client's Adam steps can cover: a condition aimed elsewhere is refused.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from ..clusters import cluster_images, condition_rows, public_encoder
from ..concepts import concept_scale
from ..conditions import SPACE, initial_conditions, learn_conditions
from ..expectations import expectations
from ..instance import personalize_instances
from ..method_settings import EspressoSettings
from ..mixture import MIXTURE_TENSOR_NAMES, LatentMixture, fit_mixture
from ..payload import ROUNDING, adam_step_bound
from ..policy import UploadKind
from ..progress import Progress
from ..results import SENT_CONCEPT_LOSSES
from ..seeds import client_seed
from ..synthesis import ZSampling
from ..upload import PayloadError, refuse_mismatch
from .base import (
    ClientJob,
    Method,
    ServerJob,
    Upload,
    check_tensor,
    class_counts,
    encode_upload,
    fresh_noise_labels,
    mixture_set,
    register,
)
from .fedld import (
    MixtureChecks,
    MixtureMeta,
    check_mixture_upload,
    first_timestep,
    mixture_meta,
    mixture_metrics,
)

log = logging.getLogger(__name__)
CONDITIONS = "conditions"


def zigzag(own: EspressoSettings) -> ZSampling | None:
    """Z-Sampling's zigzag as the settings ask for it, or None."""
    return ZSampling(own.z_threshold, own.z_inverse_guidance) if own.z_sampling else None


def condition_moves(own: EspressoSettings, images: int) -> float:
    """The most one coordinate of a condition can move in the client's learning, in units of
    the hidden space's scale: lr x Adam's largest step x the steps taken."""
    steps = own.epochs * math.ceil(images / own.batch_size)
    return own.lr * adam_step_bound() * steps


class EspressoMeta(MixtureMeta):
    method: Literal["espresso"] = "espresso"
    clusters: int = Field(ge=1)
    prompt_template: str


@dataclasses.dataclass(frozen=True)
class EspressoUpload:
    """What the server keeps of an accepted upload."""

    conditions: torch.Tensor  # (C, J, L, d)
    mixture: LatentMixture
    counts: torch.Tensor  # (C,) private images per class


@register
class Espresso(MixtureChecks, Method):
    name = "espresso"
    # uploads: per class a mixture of its z(T), conditions per sub-cluster, class counts
    uploads = frozenset({UploadKind.STATISTICS, UploadKind.CONCEPTS, UploadKind.COUNTS})
    settings: EspressoSettings
    meta_model = EspressoMeta
    tensor_names = ("class_counts", CONDITIONS, *MIXTURE_TENSOR_NAMES)

    def upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        own, cfg, data, ldm = self.settings, job.cfg, job.data, job.ldm()
        timestep, classes = first_timestep(cfg, ldm), list(data.classes)
        seconds: dict[str, float] = {}

        started = time.perf_counter()
        encoder = public_encoder(cfg.ldm.model, cfg.classifier.image_size, job.device)
        sub_clusters = cluster_images(data.images, data.labels, own.clusters, encoder)
        seconds["seconds-clusters"] = time.perf_counter() - started

        started = time.perf_counter()
        instances = personalize_instances(
            ldm.vae,
            ldm.scheduler,
            data.images,
            data.labels,
            timestep,
            gamma_mean=own.gamma_mean,
            gamma_std=own.gamma_std,
            vae_batch_size=cfg.ldm.vae_batch_size,
            draws=own.noisings,
            generator=job.generator,
        )
        mixture = fit_mixture(
            instances.zT,
            instances.zT_labels,
            len(classes),
            own.components,
            job.generator,
            rows_per_component=own.rows_per_component,
        )
        seconds["seconds-instance"] = time.perf_counter() - started

        started = time.perf_counter()
        start = initial_conditions(
            ldm, cfg.data.prompt_template, data.domain, classes, own.clusters
        )
        progress = Progress(log, f"[{data.client_id}] conditions", own.epochs, "epochs")
        learned = learn_conditions(
            ldm,
            start,
            instances.z0,
            data.labels,
            sub_clusters,
            timestep,
            epochs=own.epochs,
            batch_size=own.batch_size,
            lr=own.lr,
            generator=job.generator,
            on_epoch=lambda _epoch, loss: progress.update(note=f"loss {loss:.4f}"),
        )
        progress.finish(f"loss {learned.losses[0]:.4f} -> {learned.losses[-1]:.4f}")
        seconds["seconds-concept"] = time.perf_counter() - started

        meta = EspressoMeta(
            **mixture_meta(job, ldm, timestep, own.components),
            clusters=own.clusters,
            prompt_template=cfg.data.prompt_template,
        )
        tensors = {
            "class_counts": class_counts(data.labels, len(classes)),
            CONDITIONS: learned.conditions.contiguous(),
            **mixture.to_tensors(),
        }
        return encode_upload(meta, tensors), {
            **seconds,
            SENT_CONCEPT_LOSSES: learned.losses,
            "condition-drift": learned.drift,
            "sub-cluster-sizes": torch.bincount(
                data.labels * own.clusters + sub_clusters, minlength=len(classes) * own.clusters
            ).tolist(),
            **mixture_metrics(mixture, len(instances.zT)),
        }

    def check(self, upload: Upload, server: ServerJob) -> Upload:
        meta, own = upload.meta, self.settings
        refuse_mismatch(
            [
                (
                    "clusters",
                    meta.clusters,
                    own.clusters,
                    "clients and server must share run config espresso.clusters",
                ),
                (
                    "prompt template",
                    meta.prompt_template,
                    server.cfg.data.prompt_template,
                    "conditions start from its plain prompt",
                ),
            ]
        )
        expect = expectations(server.cfg, server.ldm(), server.class_names, None)
        mixture = check_mixture_upload(upload, server, own, expect)
        conditions = check_conditions(upload, server, own)
        return dataclasses.replace(
            upload, content=EspressoUpload(conditions, mixture, upload.tensors["class_counts"])
        )

    def train_set(
        self,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> dict[str, list[Path]]:
        out = {}
        for client_id, upload in sorted(uploads.items()):
            content: EspressoUpload = upload.content
            labels = fresh_noise_labels(content.counts, self.settings, server.cfg.class_cap)
            clusters = content.conditions.shape[1]
            rows = condition_rows(
                content.counts,
                clusters,
                labels,
                client_seed(server.cfg.seed, f"{client_id}/conditions"),
            )
            table = content.conditions.reshape(-1, *content.conditions.shape[2:])
            out[client_id] = [
                mixture_set(
                    server,
                    client_id,
                    table,
                    labels,
                    content.mixture,
                    upload.meta.timestep,
                    shard_path(client_id, 0),
                    rows,
                    zigzag(self.settings),
                )
            ]
        return out


def check_conditions(upload: Upload, server: ServerJob, own: EspressoSettings) -> torch.Tensor:
    """(C, J, L, d) conditions, each coordinate within reach of its start c0 (tau of the plain
    prompt, rebuilt here) in the client's learning; ``PayloadError`` otherwise. The reach grows with
    num_examples, so this runs after :func:`check_mixture_upload` has held it to run config
    federation.max-images-per-client. The steps counted are those of the images the server credits
    (at most run config federation.max-images-per-class of each class), never more for a larger
    claim."""
    meta, ldm = upload.meta, server.ldm()
    images = min(meta.num_examples, server.cfg.class_cap * len(server.class_names))
    start = initial_conditions(
        ldm, server.cfg.data.prompt_template, meta.domain, server.class_names, own.clusters
    )
    conditions = check_tensor(upload, CONDITIONS, torch.float32, tuple(start.shape))
    scale = concept_scale(ldm, SPACE)
    # The client's text encoder may run at another precision: allow c0's rounding besides the steps.
    reach = scale * condition_moves(own, images) * (1 + ROUNDING) + ROUNDING * float(
        start.abs().max()
    )
    moved = (conditions - start).abs().amax(dim=(-2, -1))
    if bool((moved > reach).any()):
        k, j = (int(i) for i in (moved > reach).nonzero()[0])
        raise PayloadError(
            f"condition of class {server.class_names[k]!r}, sub-cluster {j} moved {float(moved[k, j]):.4g} "
            f"from its plain prompt's states, beyond the {reach:.4g} its learning can cover "
            f"({own.epochs} epochs of {math.ceil(images / own.batch_size)} Adam steps at lr "
            f"{own.lr:g} x the hidden space's scale {scale:.3g}); were the conditions learned with the "
            "server's base model, prompt template and espresso settings?"
        )
    return conditions

"""FedBiP's instance level without per-image latents: the same two-level personalization,
but the z(T) of a class are summarized by a diagonal Gaussian mixture, and only the mixture
leaves the client (``method = "fedbip-mixture"``).

Client: FedBiP's whole client step (:func:`fedbip_flwr.methods.fedbip.personalize`: mixed same-class
latents forward-noised to T, ``latents-per-image`` per image; S and V learned with the
diffusion loss), then per class a mixture of ``fedbip-mixture.components`` Gaussians fitted to
those z(T). The upload is S, V, the mixture and the per-class counts; the z(T) stay home.

Server: as FedBiP, ``multiplier`` passes per client, each with its own eta on S; in pass k every
uploaded z(T) is replaced by a fresh draw from its class's mixture (seeded by the server's seed,
the client id and k), so a pass makes as many images as FedBiP's.

Checks: FedBiP's concept contract (shapes, the server's model, n-s, n-v, template, the concept
scale) and FedLD's mixture checks (:func:`fedbip_flwr.methods.fedld.check_mixture_upload`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from ..clusters import condition_rows
from ..config import MAX_CLASS_CLUSTERS
from ..expectations import expectations
from ..mixture import MIXTURE_TENSOR_NAMES, LatentMixture, fit_mixture
from ..payload import Expectations, Payload, PayloadMeta, check_concept_scale, check_expectations
from ..seeds import client_seed
from ..server import WorkUnit
from ..synthesis import SynthesisSettings, draw_etas, pass_conditioning
from .base import (
    ClientJob,
    Method,
    ServerJob,
    Upload,
    check_tensor,
    class_counts,
    encode_upload,
    mixture_set,
    register,
)
from .fedbip import personalize
from .fedld import MixtureMeta, MixtureSettings, check_mixture_upload, mixture_meta, mixture_metrics

CONCEPTS = ("domain_concept", "class_concepts")


class FedBiPMixtureSettings(MixtureSettings):
    """FedBiP's mixture mode's own run-config keys (table ``fedbip-mixture``)."""

    WHAT: ClassVar[str] = "fedbip-mixture settings"


class FedBiPMixtureMeta(MixtureMeta):
    method: Literal["fedbip-mixture"] = "fedbip-mixture"
    n_s: int = Field(ge=1)
    n_v: int = Field(ge=1)
    concept_space: Literal["token", "hidden"]
    prompt_template: str
    class_clusters: int = Field(ge=1, le=MAX_CLASS_CLUSTERS)


@dataclasses.dataclass(frozen=True)
class MixtureUpload:
    """What the server keeps of an accepted upload: the client's concepts (as FedBiP's payload
    without latents, which the conditioning code reads) and its mixture."""

    concepts: Payload
    mixture: LatentMixture
    counts: torch.Tensor  # (C,) private images per class


@register
class FedBiPMixture(Method):
    name = "fedbip-mixture"
    Settings = FedBiPMixtureSettings
    settings: FedBiPMixtureSettings
    meta_model = FedBiPMixtureMeta
    tensor_names = ("class_counts", *CONCEPTS, *MIXTURE_TENSOR_NAMES)

    def upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        own, data, ldm = self.settings, job.data, job.ldm()
        payload, report = personalize(
            ldm, data.images, data.labels, list(data.classes), data.domain, data.client_id,
            job.cfg, job.generator,
        )  # fmt: skip
        mixture = fit_mixture(payload.latents.float(), payload.labels, len(data.classes), own.components,
                              job.generator, rows_per_component=own.rows_per_component)  # fmt: skip
        meta = FedBiPMixtureMeta(
            **mixture_meta(job, ldm, payload.meta.timestep, own.components),
            n_s=payload.meta.n_s, n_v=payload.meta.n_v, concept_space=payload.meta.concept_space,
            prompt_template=payload.meta.prompt_template, class_clusters=payload.meta.class_clusters,
        )  # fmt: skip
        tensors = {
            "class_counts": class_counts(data.labels, len(data.classes)),
            "domain_concept": payload.domain_concept,
            "class_concepts": payload.class_concepts,
            **mixture.to_tensors(),
        }
        return encode_upload(meta, tensors), {
            "seconds-instance": report.seconds["instance"],
            "seconds-concept": report.seconds["concept"],
            "concept-losses": report.concept_losses,
            **mixture_metrics(mixture, len(payload.latents)),
        }

    def check(self, upload: Upload, server: ServerJob) -> Upload:
        expect = expectations(server.cfg, server.ldm(), server.class_names)
        mixture = check_mixture_upload(upload, server, self.settings.components, expect)
        concepts = concept_payload(upload, server, expect)
        return dataclasses.replace(upload, content=MixtureUpload(concepts, mixture, upload.tensors["class_counts"]))

    def work_units(self, uploads: Mapping[str, Upload], server: ServerJob) -> list[WorkUnit]:
        """One per (client, pass), as FedBiP's."""
        per_pass = {cid: len(pass_labels(u.content, server)) for cid, u in uploads.items()}
        return [WorkUnit(cid, k, per_pass[cid]) for cid in sorted(uploads) for k in range(server.cfg.multiplier)]

    def train_set(
        self, uploads: Mapping[str, Upload], server: ServerJob, shard_path: Callable[[str, int], Path]
    ) -> dict[str, list[Path]]:
        out: dict[str, list[Path]] = {}
        for unit in self.work_units(uploads, server):
            out.setdefault(unit.client_id, []).extend(self.make_unit(unit, uploads, server, shard_path))
        return out

    def make_unit(
        self, unit: WorkUnit, uploads: Mapping[str, Upload], server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> list[Path]:  # fmt: skip
        content: MixtureUpload = uploads[unit.client_id].content
        settings = SynthesisSettings.from_config(server.cfg)
        eta = draw_etas(content.concepts, settings, client_seed(server.cfg.seed, unit.client_id))[unit.index]
        cond = pass_conditioning(server.ldm(), content.concepts, settings, eta)
        stream, labels = f"{unit.client_id}/pass{unit.index}", pass_labels(content, server)
        clusters = content.concepts.meta.class_clusters
        rows = None if clusters == 1 else condition_rows(content.counts, clusters, labels, client_seed(server.cfg.seed, stream))
        return [mixture_set(server, stream, cond, labels, content.mixture, content.concepts.meta.timestep,
                            shard_path(unit.client_id, unit.index), rows)]  # fmt: skip


def pass_labels(content: MixtureUpload, server: ServerJob) -> torch.Tensor:
    """One pass's labels: as many per class as the client had z(T) (images x latents-per-image)."""
    per_class = content.counts * server.cfg.latents_per_image
    return torch.repeat_interleave(torch.arange(len(per_class)), per_class)


def concept_payload(upload: Upload, server: ServerJob, expect: Expectations) -> Payload:
    """S and V checked by FedBiP's concept contract (``expect``), as a payload without latents."""
    meta, ldm = upload.meta, server.ldm()
    n_s, n_v = expect.concept_sizes(meta.domain)
    d, classes = ldm.concept_dim, len(meta.class_names)
    concepts = {
        "domain_concept": check_tensor(upload, "domain_concept", torch.float32, (meta.n_s, d)),
        "class_concepts": check_tensor(upload, "class_concepts", torch.float32,
                                       (classes * meta.class_clusters, meta.n_v, d)),
    }
    fields = meta.model_dump(include=set(PayloadMeta.model_fields) - {"method"})
    fields["num_examples"] = meta.num_examples * server.cfg.latents_per_image  # as FedBiP's z(T) rows
    payload = Payload(
        latents=torch.empty(0, *meta.latent_shape), labels=torch.empty(0, dtype=torch.int64),
        meta=PayloadMeta(**fields, latent_dtype="float32"), **concepts,
        latent_clusters=torch.empty(0, dtype=torch.int64) if meta.class_clusters > 1 else None,
    )  # fmt: skip
    check_expectations(payload, dataclasses.replace(expect, plausibility=None))
    check_concept_scale(payload, payload.meta.per_concept(n_v), expect.plausibility)
    return payload

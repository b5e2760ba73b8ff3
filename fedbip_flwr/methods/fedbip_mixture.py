"""FedBiP's instance level without per-image latents: the same two-level personalization,
but the z(T) of a class are summarized by a diagonal Gaussian mixture, and only the mixture
leaves the client (``method = "fedbip-mixture"``).

Client: FedBiP's whole client step (:func:`fedbip_flwr.methods.fedbip.personalize`: mixed same-class
latents forward-noised to T, ``fedbip.latents-per-image`` per image; S and V learned with the
diffusion loss), then per class a mixture of ``fedbip-mixture.components`` Gaussians fitted to
those z(T). The upload is S, V, the mixture and the per-class counts; the z(T) stay home.

Server: as FedBiP, ``fedbip.multiplier`` passes per client, each with its own eta on S; in pass k
every uploaded z(T) is replaced by a fresh draw from its class's mixture (seeded by the server's
seed, the client id and k), so a pass makes as many images as FedBiP's.

Checks: FedBiP's concept contract (shapes, the server's model, data.n-s, data.n-v, template, the
concept scale) and FedLD's mixture checks (:func:`fedbip_flwr.methods.fedld.check_mixture_upload`).

DP (``fedbip-mixture.dp-epsilon`` > 0, :meth:`FedBiPMixture.private_upload`): one
(epsilon, delta) per private image for everything the upload derives from the images. The
mixture is FedLD's DP release (one z(T) per image, unmixed, clipped; per class a noisy sum and
a noisy count), S and V are learned by DP-SGD (:class:`fedbip_flwr.concepts.DPSGD`), and
:func:`fedbip_flwr.dp.split_budget` calibrates the two so that their composition meets the
budget; the header states every parameter, and the server recomputes the epsilon from them
(:func:`check_private_release`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..clusters import condition_rows
from ..concepts import DPSGD
from ..dp import (
    EPSILON_METRIC,
    DPGuarantee,
    SplitBudget,
    composed_epsilon,
    dp_sgd_event,
    dp_sgd_steps_per_epoch,
    gaussian_releases,
    split_budget,
)
from ..expectations import expectations
from ..instance import encode_images, forward_noise
from ..method_settings import MAX_CLASS_CLUSTERS, FedBiPMixtureSettings
from ..mixture import MIXTURE_TENSOR_NAMES, LatentMixture, fit_mixture
from ..payload import (
    Expectations,
    Payload,
    PayloadMeta,
    check_concept_scale,
    check_expectations,
    refuse_mismatch,
)
from ..policy import UploadKind
from ..results import SENT_CONCEPT_LOSSES
from ..seeds import client_seed
from ..server import WorkUnit
from ..shared_concepts import Concepts
from ..synthesis import SynthesisSettings, pass_conditioning
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
from .fedbip import client_concepts, pass_eta, personalize
from .fedld import (
    MIN_NOISE_MULTIPLIER,
    STATS_RELEASES,
    DPRelease,
    MixtureChecks,
    MixtureMeta,
    check_claimed_epsilon,
    check_mixture_upload,
    check_stats_release,
    first_timestep,
    mixture_meta,
    mixture_metrics,
    private_mixture,
    stats_guarantee,
)

log = logging.getLogger(__name__)
CONCEPTS = ("domain_concept", "class_concepts")


def dp_budget(own: FedBiPMixtureSettings) -> SplitBudget:
    """The DP upload's two releases, DP-SGD on the concepts and the class statistics,
    calibrated together to (dp-epsilon, dp-delta)."""
    return split_budget(
        own.dp_epsilon,
        own.dp_delta,
        own.dp_concept_share,
        own.dp_sample_rate,
        own.concept_epochs * dp_sgd_steps_per_epoch(own.dp_sample_rate),
        STATS_RELEASES,
    )


def dp_stats_guarantee(
    own: FedBiPMixtureSettings, latent_numel: int, budget: SplitBudget | None = None
) -> DPGuarantee:
    """The class statistics' guarantee at their share of the DP upload's budget."""
    budget = budget or dp_budget(own)
    return stats_guarantee(
        own, budget.epsilon, budget.delta, budget.stats_noise_multiplier, latent_numel
    )


class ConceptDPRelease(BaseModel):
    """DP-SGD's parameters, as a DP upload's header states them."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    sample_rate: float = Field(gt=0, le=1)  # q, Poisson sampling
    steps: int = Field(ge=1)
    noise_multiplier: float = Field(ge=MIN_NOISE_MULTIPLIER)  # noise std / clip
    clip: float = Field(gt=0)  # L2 norm of one image's gradient w.r.t. the concept shifts
    covers: list[str]


class MixtureDPRelease(DPRelease):
    """A DP fedbip-mixture upload's guarantee: (``epsilon``, ``delta``) for all ``covers``,
    the accountant's epsilon for the statistics' ``releases`` Gaussian mechanisms
    (``noise_multiplier``, ``clip`` on z(T)) composed with the ``concepts``' DP-SGD."""

    concepts: ConceptDPRelease


class FedBiPMixtureMeta(MixtureMeta):
    method: Literal["fedbip-mixture"] = "fedbip-mixture"
    n_s: int = Field(ge=1)
    n_v: int = Field(ge=1)
    concept_space: Literal["token", "hidden"]
    prompt_template: str
    class_clusters: int = Field(ge=1, le=MAX_CLASS_CLUSTERS)
    # absent from a non-DP upload's header, which stays as it was before DP existed
    dp: MixtureDPRelease | None = Field(None, exclude_if=lambda value: value is None)


@dataclasses.dataclass(frozen=True)
class MixtureUpload:
    """What the server keeps of an accepted upload: the client's concepts, what places them in
    the prompt, and its mixture of z(T) at ``timestep``."""

    concepts: Concepts
    class_clusters: int  # V's rows per class
    timestep: int
    mixture: LatentMixture
    counts: torch.Tensor  # (C,) private images per class


@register
class FedBiPMixture(MixtureChecks, Method):
    name = "fedbip-mixture"
    # uploads: per class a mixture of its z(T), S and V, class counts
    uploads = frozenset({UploadKind.STATISTICS, UploadKind.CONCEPTS, UploadKind.COUNTS})
    settings: FedBiPMixtureSettings
    meta_model = FedBiPMixtureMeta
    tensor_names = ("class_counts", *CONCEPTS, *MIXTURE_TENSOR_NAMES)

    def upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        if self.settings.dp_epsilon:
            return self.private_upload(job)
        own, data, ldm = self.settings, job.data, job.ldm()
        payload, report = personalize(
            ldm,
            data.images,
            data.labels,
            list(data.classes),
            data.domain,
            data.client_id,
            job.cfg,
            job.generator,
            own,
        )
        mixture = fit_mixture(
            payload.latents.float(),
            payload.labels,
            len(data.classes),
            own.components,
            job.generator,
            rows_per_component=own.rows_per_component,
        )
        meta = FedBiPMixtureMeta(
            **mixture_meta(job, ldm, payload.meta.timestep, own.components),
            n_s=payload.meta.n_s,
            n_v=payload.meta.n_v,
            concept_space=payload.meta.concept_space,
            prompt_template=payload.meta.prompt_template,
            class_clusters=payload.meta.class_clusters,
        )
        tensors = {
            "class_counts": class_counts(data.labels, len(data.classes)),
            "domain_concept": payload.domain_concept,
            "class_concepts": payload.class_concepts,
            **mixture.to_tensors(),
        }
        return encode_upload(meta, tensors), {
            "seconds-instance": report.seconds["instance"],
            "seconds-concept": report.seconds["concept"],
            SENT_CONCEPT_LOSSES: report.concept_losses,
            **mixture_metrics(mixture, len(payload.latents)),
        }

    def private_upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        """The (dp-epsilon, dp-delta)-DP upload: the mixture from FedLD's DP release on one
        unmixed z(T) per image, S and V by DP-SGD on the images' latents, both calibrated
        together (:func:`fedbip_flwr.dp.split_budget`). Its metrics say nothing about the images."""
        own, data, ldm, cfg, generator = self.settings, job.data, job.ldm(), job.cfg, job.generator
        if own.class_clusters != 1:
            raise ValueError(
                "fedbip-mixture.dp-epsilon needs fedbip.class-clusters = 1: sub-clusters come from "
                "all of a class's images together, so one image can move every other image's "
                "sub-cluster"
            )
        if own.concept_epochs < 1:
            raise ValueError(
                "fedbip-mixture.dp-epsilon needs fedbip.concept-epochs >= 1 (without concepts: "
                "fedld.dp-epsilon)"
            )
        budget = dp_budget(own)
        timestep = first_timestep(cfg, ldm)
        z0 = encode_images(ldm.vae, data.images, cfg.ldm.vae_batch_size)
        z_t = forward_noise(ldm.scheduler, z0, timestep, torch.randn(z0.shape, generator=generator))
        stats = dp_stats_guarantee(own, z0[0].numel(), budget)
        alpha_bar = float(ldm.scheduler.alphas_cumprod[timestep])
        mixture, counts, statistics = private_mixture(
            z_t,
            data.labels,
            len(data.classes),
            stats,
            own.components,
            alpha_bar,
            generator,
            cfg.federation.replayable_client_noise,
        )
        privacy = DPSGD(
            own.dp_sample_rate,
            dp_sgd_steps_per_epoch(own.dp_sample_rate),
            budget.sgd_noise_multiplier,
            own.dp_grad_clip,
        )
        layout, concepts = client_concepts(
            ldm,
            z0,
            data.labels,
            list(data.classes),
            data.domain,
            data.client_id,
            cfg,
            own,
            timestep,
            generator,
            privacy,
        )
        release = MixtureDPRelease(
            **{**statistics.model_dump(), "covers": list(self.tensor_names)},
            concepts=ConceptDPRelease(
                sample_rate=own.dp_sample_rate,
                steps=budget.steps,
                noise_multiplier=budget.sgd_noise_multiplier,
                clip=own.dp_grad_clip,
                covers=list(CONCEPTS),
            ),
        )
        meta = FedBiPMixtureMeta(
            **{
                **mixture_meta(job, ldm, timestep, own.components),
                "num_examples": max(1, int(counts.sum())),
            },
            n_s=layout.n_s,
            n_v=layout.n_v,
            concept_space=own.concept_space,
            prompt_template=cfg.data.prompt_template,
            class_clusters=1,
            dp=release,
        )
        tensors = {
            "class_counts": counts,
            "domain_concept": concepts.domain,
            "class_concepts": concepts.classes,
            **mixture.to_tensors(),
        }
        return encode_upload(meta, tensors), {EPSILON_METRIC: release.epsilon}

    def check(self, upload: Upload, server: ServerJob) -> Upload:
        expect = expectations(server.cfg, server.ldm(), server.class_names, self.settings)
        mixture = check_mixture_upload(upload, server, self.settings, expect)
        check_private_release(upload.meta, self.settings, mixture)
        concepts = checked_concepts(upload, server, self.settings, expect)
        meta, counts = upload.meta, upload.tensors["class_counts"]
        content = MixtureUpload(concepts, meta.class_clusters, meta.timestep, mixture, counts)
        return dataclasses.replace(upload, content=content)

    def work_units(self, uploads: Mapping[str, Upload], server: ServerJob) -> list[WorkUnit]:
        """One per (client, pass), as FedBiP's."""
        per_pass = {cid: len(pass_labels(u.content, self.settings)) for cid, u in uploads.items()}
        return [
            WorkUnit(cid, k, per_pass[cid])
            for cid in sorted(uploads)
            for k in range(self.settings.multiplier)
        ]

    def train_set(
        self,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> dict[str, list[Path]]:
        out: dict[str, list[Path]] = {}
        for unit in self.work_units(uploads, server):
            out.setdefault(unit.client_id, []).extend(
                self.make_unit(unit, uploads, server, shard_path)
            )
        return out

    def make_unit(
        self,
        unit: WorkUnit,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> list[Path]:
        content: MixtureUpload = uploads[unit.client_id].content
        settings = SynthesisSettings.from_config(server.cfg)
        concepts = content.concepts
        eta = pass_eta(concepts, self.settings, server.cfg.seed, unit)
        cond = pass_conditioning(server.ldm(), concepts, settings, eta)
        stream, labels = f"{unit.client_id}/pass{unit.index}", pass_labels(content, self.settings)
        clusters = content.class_clusters
        rows = (
            None
            if clusters == 1
            else condition_rows(
                content.counts, clusters, labels, client_seed(server.cfg.seed, stream)
            )
        )
        return [
            mixture_set(
                server,
                stream,
                cond,
                labels,
                content.mixture,
                content.timestep,
                shard_path(unit.client_id, unit.index),
                rows,
            )
        ]


def pass_labels(content: MixtureUpload, own: FedBiPMixtureSettings) -> torch.Tensor:
    """One pass's labels: as many per class as the client had z(T) (images x latents-per-image)."""
    per_class = content.counts * own.latents_per_image
    return torch.repeat_interleave(torch.arange(len(per_class)), per_class)


def check_private_release(
    meta: FedBiPMixtureMeta, own: FedBiPMixtureSettings, mixture: LatentMixture
) -> None:
    """The class statistics' release as FedLD's is checked (:func:`check_stats_release`), then
    that DP-SGD ran with the run's schedule (sample rate, and the steps concept-epochs make of
    it) and that the epsilon is what the accountant gives for both noise multipliers composed."""
    check_stats_release(meta.dp, own, FedBiPMixture.tensor_names, mixture)
    if (release := meta.dp) is None:
        return
    sgd = release.concepts
    q, steps = sgd.sample_rate, own.concept_epochs * dp_sgd_steps_per_epoch(sgd.sample_rate)
    refuse_mismatch(
        [
            (
                "DP-SGD covers",
                sorted(sgd.covers),
                sorted(CONCEPTS),
                "S and V are what DP-SGD learns",
            ),
            (
                "DP-SGD sample rate",
                q,
                own.dp_sample_rate,
                "clients and server must share fedbip-mixture.dp-sample-rate",
            ),
            (
                "DP-SGD steps",
                sgd.steps,
                steps,
                f"fedbip.concept-epochs {own.concept_epochs} x ceil(1 / sample rate)",
            ),
        ]
    )
    epsilon = composed_epsilon(
        release.delta,
        dp_sgd_event(q, sgd.noise_multiplier, steps),
        gaussian_releases(release.noise_multiplier, release.releases),
    )
    noise = (
        f"noise multipliers ({release.noise_multiplier:.6g} on the statistics, {sgd.noise_multiplier:.6g} "
        f"over {steps} DP-SGD steps at sample rate {q:g})"
    )
    check_claimed_epsilon(release.epsilon, epsilon, release.delta, noise)


def checked_concepts(
    upload: Upload, server: ServerJob, own: FedBiPMixtureSettings, expect: Expectations
) -> Concepts:
    """S and V checked by FedBiP's concept contract (``expect``, on a payload without
    latents); a DP upload's concepts within the reach of its DP-SGD's steps (checked before)."""
    meta, ldm = upload.meta, server.ldm()
    if meta.dp is not None and expect.plausibility is not None:
        plausibility = dataclasses.replace(
            expect.plausibility, concept_steps=meta.dp.concepts.steps
        )
        expect = dataclasses.replace(expect, plausibility=plausibility)
    n_s, n_v = expect.concept_sizes(meta.domain)
    d, classes = ldm.concept_dim, len(meta.class_names)
    concepts = {
        "domain_concept": check_tensor(upload, "domain_concept", torch.float32, (meta.n_s, d)),
        "class_concepts": check_tensor(
            upload, "class_concepts", torch.float32, (classes * meta.class_clusters, meta.n_v, d)
        ),
    }
    fields = meta.model_dump(include=set(PayloadMeta.model_fields) - {"method"})
    fields["num_examples"] = meta.num_examples * own.latents_per_image  # as FedBiP's z(T) rows
    payload = Payload(
        latents=torch.empty(0, *meta.latent_shape),
        labels=torch.empty(0, dtype=torch.int64),
        meta=PayloadMeta(**fields, latent_dtype="float32"),
        **concepts,
        latent_clusters=torch.empty(0, dtype=torch.int64) if meta.class_clusters > 1 else None,
    )
    check_expectations(payload, dataclasses.replace(expect, plausibility=None))
    check_concept_scale(payload, payload.meta.per_concept(n_v), expect.plausibility)
    return payload.concepts

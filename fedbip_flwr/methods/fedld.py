"""FedLD (Local Distribution-Conditioned Image Synthesis for One-Shot FL; an ICLR 2026
submission), an instance-free peer: clients train nothing and upload no per-image latent.

Client: VAE latents of its images, forward-noised to the first timestep T ``fedld.noisings``
times with fresh noise from its own generator; per class, a diagonal Gaussian mixture of
``fedld.components`` components fitted to those z(T) (:mod:`fedbip_flwr.mixture`, scikit-learn's
EM), and its per-class counts. The paper leaves K, T and the covariance type open: here K is
``fedld.components``, T is FedBiP's (the sampler's first timestep, or
``synthesis.start-timestep``), the covariance diagonal (a full one has D^2 entries per component:
1,048,576 on the miniature, 2.7e8 on SD v1-4's latents), and no mixing of pairs (that is
FedBiP's and Espresso's instance step).

Server: per client, as many images as FedBiP makes from it, each from a z(T) drawn from its
class's mixture, denoised from T with the plain prompt (Prompts-only's "a {domain} of a
{class}"); the draws are seeded by the server's seed and the client id.

The upload's mixture is checked like z(T) itself: draws from it must have the moments that z(T)
at T can have (:func:`fedbip_flwr.payload.check_latent_moments`), so a mixture scaled or shifted
to poison the synthesis is refused. Mixture-based methods (FedBiP's mixture mode) share
:class:`MixtureMeta` and :func:`check_mixture_upload`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..concepts import plain_prompt
from ..config import FedBiPConfig
from ..dp import (
    EPSILON_METRIC,
    DPGaussianEstimate,
    DPGuarantee,
    composed_epsilon,
    gaussian_releases,
    noise_multiplier_for,
    noisy_estimate,
)
from ..expectations import expectations
from ..instance import encode_images, forward_noise
from ..ldm import LDM
from ..method_settings import (
    DPMixtureSettings,
    FedLDSettings,
    FreshNoiseSettings,
    MixtureSettings,
)
from ..mixture import (
    DEFAULT_REG_COVAR,
    MIXTURE_TENSOR_NAMES,
    LatentMixture,
    draw,
    fit_mixture,
    from_tensors,
)
from ..payload import (
    LATENT_RMS,
    ROUNDING,
    Expectations,
    Plausibility,
    check_latent_moments,
    coordinate_bound,
    latent_bounds,
    sampling_checks,
)
from ..policy import UploadKind
from ..seeds import client_seed
from ..synthesis import SynthesisSettings, encode_texts
from ..upload import PayloadError, UploadMeta, refuse_mismatch
from .base import (
    ClientJob,
    Method,
    ServerJob,
    Upload,
    check_class_counts,
    check_counts,
    class_counts,
    common_meta,
    encode_upload,
    fresh_noise_labels,
    mixture_set,
    register,
)

log = logging.getLogger(__name__)
PLAUSIBILITY_DRAWS = 64  # draws per held class whose moments must be those of z(T)


# A header's noise multipliers must be at least this: the server recomputes the epsilon they
# give, and the accountant's grid grows as 1 / sigma^2 (0.05 takes seconds). The defaults at
# dp-epsilon's cap of 100 give 0.36 (DP-SGD) and 0.19 (fedbip-mixture's statistics); a client
# whose settings would go below is refused when it builds its header.
MIN_NOISE_MULTIPLIER = 0.05
# How far a header's epsilon may lie from the server's recomputation of it (the same
# accountant on another machine may round a grid point the other way).
EPSILON_TOLERANCE = 1e-3


class DPRelease(BaseModel):
    """What a DP upload's header says it guarantees (:mod:`fedbip_flwr.dp`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    epsilon: float = Field(gt=0)
    delta: float = Field(gt=0, lt=1)
    noise_multiplier: float = Field(ge=MIN_NOISE_MULTIPLIER)
    clip: float = Field(gt=0)
    releases: int = Field(ge=1)
    covers: list[str]  # which tensors the guarantee covers
    unit: str  # whose presence it hides
    replayable_noise: bool  # true: a server that replays the client's noise voids it


class MixtureMeta(UploadMeta):
    """What a server needs to denoise draws from a client's mixture as the client meant."""

    timestep: int = Field(ge=0)
    scheduler: str = Field(min_length=1)
    num_inference_steps: int = Field(ge=1)
    base_model: str = Field(min_length=1)
    latent_shape: list[int] = Field(min_length=3, max_length=3)
    components: int = Field(ge=1)


class FedLDMeta(MixtureMeta):
    method: Literal["fedld"] = "fedld"
    dp: DPRelease | None = None


def mixture_meta(job: ClientJob, ldm: LDM, timestep: int, components: int) -> dict[str, Any]:
    """The :class:`MixtureMeta` fields, as the client's run config and model give them."""
    return {
        **common_meta(job),
        "timestep": timestep,
        "scheduler": SynthesisSettings.from_config(job.cfg).sampler(ldm).name,
        "num_inference_steps": job.cfg.synthesis.num_inference_steps,
        "base_model": ldm.fingerprint,
        "latent_shape": list(ldm.latent_shape(job.cfg.data.image_size)),
        "components": components,
    }


def first_timestep(cfg: FedBiPConfig, ldm: LDM) -> int:
    return (
        SynthesisSettings.from_config(cfg).sampler(ldm).first_timestep(cfg.synthesis.start_timestep)
    )


def stated_mixture(upload: Upload) -> LatentMixture:
    """The mixture of a :class:`MixtureMeta` upload as its own header states it, which needs no
    model or run config: weights (classes, components), each class's a distribution; means and
    variances (classes, components, D) for its latent shape, every variance > 0; all finite
    float32. PayloadError otherwise."""
    meta = upload.meta
    try:
        mixture = from_tensors(upload.tensors, tuple(meta.latent_shape))
    except ValueError as err:
        raise PayloadError(str(err).rstrip(".")) from None
    stated = (len(meta.class_names), meta.components)
    if tuple(mixture.weights.shape) != stated:
        raise PayloadError(
            f"the mixture has {tuple(mixture.weights.shape)} (classes, components); its header's "
            f"{stated[0]} classes and {stated[1]} components need {stated}"
        )
    return mixture


class MixtureChecks:
    """``check_alone`` of every method that uploads a :class:`MixtureMeta` mixture (FedLD,
    fedbip-mixture, Espresso): its class counts and :func:`stated_mixture`, so an upload
    audited without a run config (``fedbip inspect``) is held to them too."""

    def check_alone(self, upload: Upload) -> Upload:
        check_counts(upload)
        stated_mixture(upload)
        return upload


def check_mixture_upload(
    upload: Upload, server: ServerJob, own: MixtureSettings, expect: Expectations
) -> LatentMixture:
    """The mixture of a :class:`MixtureMeta` upload, checked against the server's model and
    run config (``expect``, :func:`fedbip_flwr.expectations.expectations`), and for plausibility:
    draws from every held class must look like z(T) at T. Its class counts, which decide how
    many images the server makes, are held to run config federation.max-images-per-client, and so is
    num_examples, their sum."""
    meta = upload.meta
    if expect.domains and meta.domain not in expect.domains:
        raise PayloadError(
            f"domain {meta.domain!r} is not one of the server's domains {list(expect.domains)} "
            "(clients and server must share run config data.domains)"
        )
    refuse_mismatch(
        [
            *sampling_checks(meta, expect),
            (
                "components",
                meta.components,
                own.components,
                "clients and server must share the method's components",
            ),
        ]
    )
    counts = check_class_counts(upload, server)
    mixture = stated_mixture(upload)  # of the server's classes and components, checked above
    # every class the server will draw from: the held ones, or all with images-per-class > 0
    every_class = isinstance(own, FreshNoiseSettings) and own.images_per_class > 0
    synthesized = torch.ones_like(counts, dtype=torch.bool) if every_class else counts > 0
    check_mixture_moments(mixture, synthesized, meta.timestep, expect.plausibility)
    held = torch.arange(len(counts))[synthesized].repeat_interleave(PLAUSIBILITY_DRAWS)
    try:
        check = torch.Generator().manual_seed(
            client_seed(server.cfg.seed, f"{meta.client_id}/check")
        )
        check_latent_moments(draw(mixture, held, check), meta.timestep, expect.plausibility)
    except PayloadError as err:
        raise PayloadError(f"draws from the mixture: {err.reason}") from None
    return mixture


@register
class FedLD(MixtureChecks, Method):
    name = "fedld"
    # uploads: per class a mixture of its z(T), and class counts
    uploads = frozenset({UploadKind.STATISTICS, UploadKind.COUNTS})
    settings: FedLDSettings
    meta_model = FedLDMeta
    tensor_names = ("class_counts", *MIXTURE_TENSOR_NAMES)

    def upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        own, data, ldm = self.settings, job.data, job.ldm()
        timestep = first_timestep(job.cfg, ldm)
        z0 = encode_images(ldm.vae, data.images, job.cfg.ldm.vae_batch_size)
        noisings = 1 if own.dp_epsilon else own.noisings  # DP: one z(T) per image, so C bounds it
        z_t = torch.cat(
            [
                forward_noise(
                    ldm.scheduler, z0, timestep, torch.randn(z0.shape, generator=job.generator)
                )
                for _ in range(noisings)
            ]
        )
        labels, classes = data.labels.repeat(noisings), len(data.classes)
        meta = mixture_meta(job, ldm, timestep, own.components)
        if own.dp_epsilon:
            alpha_bar = float(ldm.scheduler.alphas_cumprod[timestep])
            mixture, counts, release = private_mixture(
                z_t,
                labels,
                classes,
                dp_stats_guarantee(own, z_t[0].numel()),
                own.components,
                alpha_bar,
                job.generator,
                job.cfg.federation.replayable_client_noise,
            )
            meta["num_examples"] = max(1, int(counts.sum()))
            tensors = {"class_counts": counts, **mixture.to_tensors()}
            return encode_upload(FedLDMeta(**meta, dp=release), tensors), {
                EPSILON_METRIC: release.epsilon
            }
        mixture = fit_mixture(
            z_t,
            labels,
            classes,
            own.components,
            job.generator,
            rows_per_component=own.rows_per_component,
        )
        tensors = {"class_counts": class_counts(data.labels, classes), **mixture.to_tensors()}
        return encode_upload(FedLDMeta(**meta), tensors), mixture_metrics(mixture, len(z_t))

    def check(self, upload: Upload, server: ServerJob) -> Upload:
        expect = expectations(server.cfg, server.ldm(), server.class_names, None)
        mixture = check_mixture_upload(upload, server, self.settings, expect)
        check_stats_release(upload.meta.dp, self.settings, self.tensor_names, mixture)
        if upload.meta.dp is not None:
            check_gaussian_epsilon(upload.meta.dp)
        return dataclasses.replace(upload, content=mixture)

    def train_set(
        self,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> dict[str, list[Path]]:
        out = {}
        for client_id, upload in sorted(uploads.items()):
            prompts = [
                plain_prompt(server.cfg.data.prompt_template, upload.domain, c)
                for c in server.class_names
            ]
            cond = encode_texts(server.ldm(), prompts)
            labels = fresh_noise_labels(
                upload.tensors["class_counts"], self.settings, server.cfg.class_cap
            )
            out[client_id] = [
                mixture_set(
                    server,
                    client_id,
                    cond,
                    labels,
                    upload.content,
                    upload.meta.timestep,
                    shard_path(client_id, 0),
                )
            ]
        return out


# Per class a noisy sum of the clipped z(T) and a noisy count: two Gaussian mechanisms.
STATS_RELEASES = 2


def check_mixture_moments(
    mixture: LatentMixture, synthesized: torch.Tensor, timestep: int, plaus: Plausibility | None
) -> None:
    """Analytic bounds on every component a draw can come from (weight > 0, of a class the
    server will ``synthesize``), which no choice of draws can step around. An honest component
    is fitted by EM to honest z(T) rows: its mean is a responsibility-weighted average of rows and its variance their spread plus
    reg_covar, so mean^2 + variance = that average of the rows' squares + reg_covar. Hence:
    the variance is at least reg_covar; the mean's average lies within the per-image mean
    bound; mean^2 + variance averaged over the coordinates is at most the largest RMS^2 a row
    can have (std_high^2 + abs_mean^2), and on each coordinate at most the largest square one
    coordinate can have (:func:`fedbip_flwr.payload.coordinate_bound`), plus reg_covar."""
    if plaus is None:
        return
    dim = mixture.means.shape[-1]
    bounds = latent_bounds(plaus.alpha_bar, dim, plaus.latent_rms, plaus.sigmas)
    used = (mixture.weights > 0) & synthesized.unsqueeze(1)
    means, variances = mixture.means.double(), mixture.variances.double()
    second = means.square() + variances
    row_square, coordinate_square = (
        bounds.std_high**2 + bounds.abs_mean**2,
        coordinate_bound(plaus.alpha_bar, dim, plaus.sigmas) ** 2,
    )
    limits = {
        "a variance below the fit's floor reg_covar": (
            variances.amin(-1) < DEFAULT_REG_COVAR * (1 - ROUNDING),
            DEFAULT_REG_COVAR,
        ),
        "a mean whose average exceeds a z(T)'s": (
            means.mean(-1).abs() > bounds.abs_mean,
            bounds.abs_mean,
        ),
        "mean^2 + variance above a z(T)'s mean square": (
            second.mean(-1) > row_square * (1 + ROUNDING) + DEFAULT_REG_COVAR,
            row_square,
        ),
        "mean^2 + variance on one coordinate above one z(T) coordinate's square": (
            second.amax(-1) > coordinate_square + DEFAULT_REG_COVAR,
            coordinate_square,
        ),
    }
    for what, (outside, limit) in limits.items():
        if bool((outside & used).any()):
            c, k = (int(i) for i in (outside & used).nonzero()[0])
            raise PayloadError(
                f"the mixture's class {c}, component {k} (weight {float(mixture.weights[c, k]):.3g}) has {what} "
                f"({limit:.3g}) at timestep {timestep}: no EM fit to z(T) rows noised to T gives it"
            )


def check_stats_release(
    release: DPRelease | None,
    own: DPMixtureSettings,
    tensor_names: Sequence[str],
    mixture: LatentMixture,
) -> None:
    """What the server can check of a class-statistics DP upload before its epsilon: the
    header as :func:`check_release_header` has it, the two releases at the run's clip, and the
    tensors have a release's structure (a fitted mixture under a DP header would carry what
    the guarantee does not cover)."""
    check_release_header(release, own.dp_epsilon, own.dp_delta, tensor_names)
    if release is None:
        return
    clip = own.dp_clip * math.sqrt(mixture.means.shape[-1])
    refuse_mismatch(
        [
            (
                "statistics releases",
                release.releases,
                STATS_RELEASES,
                "per class a noisy sum and a noisy count",
            ),
            (
                "DP clip",
                release.clip,
                clip,
                "clients and server must share dp-clip (times sqrt(D))",
            ),
        ]
    )
    one = torch.zeros_like(mixture.weights)
    one[:, 0] = 1.0
    copies = mixture.means[:, :1].expand_as(mixture.means)
    if not (
        torch.equal(mixture.weights, one)
        and bool(mixture.variances.eq(1).all())
        and torch.equal(mixture.means, copies)
    ):
        raise PayloadError(
            "its tensors are not a DP release's: per class one component of weight 1 and variance 1 "
            "(the others its copies at weight 0), which is all the guarantee covers"
        )


def check_release_header(
    release: DPRelease | None, epsilon: float, delta: float, tensor_names: Sequence[str]
) -> None:
    """A DP header where the run asks for (``epsilon``, ``delta``)-DP (``epsilon`` 0: none
    asked), no weaker than that, covering every tensor the upload holds."""
    if release is None:
        if epsilon:
            raise PayloadError(
                f"the run asks for ({epsilon:g}, {delta:g})-DP uploads (dp-epsilon) "
                "and this one states no guarantee"
            )
        return
    if epsilon and (release.epsilon > epsilon or release.delta > delta):
        raise PayloadError(
            f"its guarantee, ({release.epsilon:g}, {release.delta:g})-DP, is weaker than the run's "
            f"({epsilon:g}, {delta:g}) (dp-epsilon, dp-delta)"
        )
    if uncovered := sorted(set(tensor_names) - set(release.covers)):
        raise PayloadError(f"its guarantee does not cover {uncovered}, which the upload holds")


def check_claimed_epsilon(claimed: float, accounted: float, delta: float, noise: str) -> None:
    """The header's epsilon is what the server's accountant gives for its noise."""
    if not math.isclose(claimed, accounted, rel_tol=EPSILON_TOLERANCE):
        raise PayloadError(
            f"its guarantee claims epsilon {claimed:.6g}, but its {noise} give {accounted:.6g} at delta {delta:g}"
        )


def check_gaussian_epsilon(release: DPRelease) -> None:
    """A release of Gaussian noise alone claims the epsilon the server's accountant gives it."""
    accounted = composed_epsilon(
        release.delta, gaussian_releases(release.noise_multiplier, release.releases)
    )
    check_claimed_epsilon(
        release.epsilon,
        accounted,
        release.delta,
        f"noise multiplier {release.noise_multiplier:.6g}",
    )


def stats_guarantee(
    own: DPMixtureSettings, epsilon: float, delta: float, noise_multiplier: float, latent_numel: int
) -> DPGuarantee:
    """The class statistics' guarantee at ``noise_multiplier`` (calibrated to (``epsilon``,
    ``delta``) for these releases alone, or with others: :func:`fedbip_flwr.dp.split_budget`),
    rows clipped to ``dp-clip`` sqrt(D) for latents of D = ``latent_numel`` values."""
    clip = own.dp_clip * math.sqrt(latent_numel)
    return DPGuarantee(epsilon, delta, noise_multiplier, clip, STATS_RELEASES, ("sum", "count"))


def dp_stats_guarantee(own: FedLDSettings, latent_numel: int) -> DPGuarantee:
    """FedLD's DP upload: the class statistics are its only release, so they take the budget."""
    sigma = noise_multiplier_for(own.dp_epsilon, own.dp_delta, STATS_RELEASES)
    return stats_guarantee(own, own.dp_epsilon, own.dp_delta, sigma, latent_numel)


def private_mixture(
    z_t: torch.Tensor,
    labels: torch.Tensor,
    classes: int,
    guarantee: DPGuarantee,
    components: int,
    alpha_bar: float,
    generator: torch.Generator,
    replayable: bool,
) -> tuple[LatentMixture, torch.Tensor, DPRelease]:
    """Per class one Gaussian from a DP release (:func:`fedbip_flwr.dp.noisy_estimate` under
    ``guarantee``, without second moments): the noisy sum of the class's z(T) clipped to the
    guarantee's clip, and the noisy count, for every class (a class the client lacks too: which
    classes it holds is protected as well). The variance is not released: z(T) =
    sqrt(abar_T) z(0) + sqrt(1 - abar_T) eps of unit-variance latents has variance 1 per
    coordinate. Then, as post-processing (which keeps the guarantee), each mean is shrunk to the
    RMS the mean of z(T) can have, sqrt(abar_T) times the latents' largest plausible RMS."""
    estimates = [noisy_estimate(z_t[labels == c], guarantee, generator) for c in range(classes)]
    mixture, counts = mixture_of_estimates(estimates, components, alpha_bar, tuple(z_t.shape[1:]))
    release = DPRelease(
        epsilon=guarantee.epsilon,
        delta=guarantee.delta,
        noise_multiplier=guarantee.noise_multiplier,
        clip=guarantee.clip,
        releases=guarantee.releases,
        covers=["class_counts", *MIXTURE_TENSOR_NAMES],
        unit=f"one private image ({guarantee.adjacency})",
        replayable_noise=replayable,
    )
    return mixture, counts, release


def mixture_of_estimates(
    estimates: list[DPGaussianEstimate],
    components: int,
    alpha_bar: float,
    latent_shape: tuple[int, ...],
) -> tuple[LatentMixture, torch.Tensor]:
    """Per class (one estimate each, of its z(T) at abar_T = ``alpha_bar``) one Gaussian: the
    noisy mean shrunk to the RMS a mean of z(T) can have, variance 1 (as :func:`private_mixture`
    says), in the first of ``components``; and the rounded noisy counts. Post-processing only."""
    dim, classes = math.prod(latent_shape), len(estimates)
    means = torch.stack([e.mean() for e in estimates])
    largest = math.sqrt(alpha_bar) * LATENT_RMS * math.sqrt(dim)
    means = means * (largest / means.norm(dim=1, keepdim=True)).clamp(max=1.0)
    weights = torch.zeros(classes, components)
    weights[:, 0] = 1.0
    mixture = LatentMixture(
        weights=weights,
        means=means.unsqueeze(1).repeat(1, components, 1).contiguous(),
        variances=torch.ones(classes, components, dim),
        latent_shape=latent_shape,
    )
    counts = torch.tensor([max(0, round(e.count)) for e in estimates], dtype=torch.int64)
    return mixture, counts


def mixture_metrics(mixture: LatentMixture, rows: int) -> dict[str, Any]:
    """What the client reports beside its mixture: how many z(T) it summarized and the
    smallest share of a class any fitted component holds (one row's share means a component
    is that one z(T))."""
    fitted = mixture.weights[mixture.weights > 0]
    return {"mixture-rows": rows, "mixture-smallest-weight": float(fitted.min())}

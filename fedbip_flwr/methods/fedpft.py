"""FedPFT (Beitollahi et al., 2024, "Parametric Feature Transfer: One-shot Federated Learning
with Foundation Models"): clients upload per-class Gaussian mixtures of a frozen public
encoder's features; the server trains a classifier head on features drawn from them.

Encoder: the ResNet-18 backbone shipped with the base model (:func:`fedbip_flwr.classifier.
backbone_path`, what run config ``classifier.init = "pretrained"`` starts from; pretrained on
public data only, never on a client's or a test image), its 512-d penultimate output (``fc``
replaced by the identity) on images resized to ``classifier.image-size`` exactly as the
classifier sees them (:func:`fedbip_flwr.clusters.public_encoder`). It stays frozen everywhere.

Client: features of its private images (no augmentation); per class scikit-learn's
``GaussianMixture`` with ``fedpft.components`` components of ``fedpft.covariance-type``
(spherical or diag), ``tol`` and ``max_iter`` (the Flower baseline's defaults: 1, spherical,
1e-12, 1000), its k-means start seeded from the client's own generator. A class with fewer
images than components gets one component per image, padded with weight-0 copies of the first
(never drawn) so the upload's shape is fixed; a class it lacks is a placeholder of weight 1 at
0 with the fit's variance floor, and a count of 0 (nothing is drawn from it). The upload:
``class_counts`` (C,) int64 and ``gmm_weights`` (C, K), ``gmm_means`` (C, K, D),
``gmm_covariances`` (C, K) spherical or (C, K, D) diag, float32.

Server: per client and class, ``fedpft.draws-per-image`` features per claimed image (the count
clipped to federation.max-images-per-class), drawn from the class's mixture (seeded by the run
seed and the client id); one ``nn.Linear(512, C)`` trained on all of them with AdamW (the baseline's
optimiser; ``head-*`` keys); then :meth:`FedPFT.final_models` returns the frozen backbone with
that head as the global classifier, scored like any other (no synthetic images, no ResNet
training).

Opt-in DP (``fedpft.dp-epsilon``, one component): per class :func:`fedbip_flwr.dp.noisy_estimate`
of the clipped features (sum, sum of squares, count: three Gaussian mechanisms), the DP header
as FedLD's (:class:`~fedbip_flwr.methods.fedld.DPRelease`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ..classifier import backbone_path, load_backbone
from ..clusters import public_encoder
from ..dp import (
    EPSILON_METRIC,
    gaussian_guarantee,
    noisy_estimate,
)
from ..ldm import fingerprint
from ..method_settings import FEDPFT_COVARIANCES, FedPFTSettings
from ..mixture import WEIGHT_SUM_TOLERANCE
from ..payload import ROUNDING
from ..policy import UploadKind
from ..seeds import client_seed
from ..storage import read_tensors
from ..upload import PayloadError, UploadMeta, refuse_mismatch
from .base import (
    ClientJob,
    Method,
    ServerJob,
    Upload,
    check_class_counts,
    check_counts,
    check_tensor,
    class_counts,
    common_meta,
    encode_upload,
    register,
)
from .fedld import DPRelease, check_gaussian_epsilon, check_release_header

WEIGHTS, MEANS, COVARIANCES = "gmm_weights", "gmm_means", "gmm_covariances"
# scikit-learn's default reg_covar (the baseline keeps it): added to every fitted variance, so
# no honest variance is below it.
REG_COVAR = 1e-6
# Features are averages of ReLU outputs: >= 0, and so is every EM mean of them (a weighted
# average of non-negative rows); this only absorbs float32 rounding.
MEAN_TOLERANCE = 1e-6
# The largest value one honest feature coordinate may have. An analytic bound from the input
# range exists (interval arithmetic through the network from images in [-1, 1]), but on the
# shipped backbone it is 1e15 at 32 px and 1e18 at 64 px: sound and useless. The backbone's
# BatchNorm keeps its activations near unit scale (the miniature's largest feature on uniform
# noise images is 4.4, its mean 0.7), so 1,000 is a generous cap: it refuses only a mixture
# scaled far beyond any feature (to dominate the head's training), never an honest one.
FEATURE_CEILING = 1e3
# Per class a noisy sum, a noisy sum of squares and a noisy count (dp.gaussian_guarantee).
DP_RELEASES = 3
_SEED_BOUND = 2**31 - 1  # sklearn's random_state is a 32-bit seed
GLOBAL = "global"  # the one model final_models returns, scored as the global classifier


class FedPFTMeta(UploadMeta):
    method: Literal["fedpft"] = "fedpft"
    encoder: str = Field(min_length=1)  # fingerprint of the backbone the features came from
    image_size: int = Field(ge=1)  # the classifier.image-size the features were computed at
    feature_dim: int = Field(ge=1)
    components: int = Field(ge=1)
    covariance_type: str = Field(min_length=1)
    dp: DPRelease | None = None


@dataclasses.dataclass(frozen=True)
class FeatureMixture:
    """C classes' Gaussian mixtures over D features, as uploaded (float32): ``weights`` (C, K),
    ``means`` (C, K, D), ``covariances`` (C, K) spherical or (C, K, D) diag."""

    weights: torch.Tensor
    means: torch.Tensor
    covariances: torch.Tensor

    def variances(self) -> torch.Tensor:
        """(C, K, D) per-feature variances (a spherical component's one variance repeated)."""
        if self.covariances.ndim == 2:
            return self.covariances.unsqueeze(-1).expand_as(self.means)
        return self.covariances

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {
            WEIGHTS: self.weights.contiguous(),
            MEANS: self.means.contiguous(),
            COVARIANCES: self.covariances.contiguous(),
        }


@functools.lru_cache(maxsize=8)
def _encoder_identity(path: str, mtime_ns: int, size: int) -> tuple[str, int]:
    state = read_tensors(Path(path))
    return fingerprint(state.values()), int(state["fc.weight"].shape[1])


def encoder_identity(model: str | Path) -> tuple[str, int]:
    """(fingerprint, feature dimension) of the backbone shipped with the base ``model``; cached
    while its file is unchanged."""
    path = backbone_path(model)
    if not path.is_file():
        load_backbone(path)  # raises the project's one message for a missing backbone
    stat = path.stat()
    return _encoder_identity(str(path), stat.st_mtime_ns, stat.st_size)


def fit_class_mixtures(
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    own: FedPFTSettings,
    generator: torch.Generator,
) -> FeatureMixture:
    """Per class a ``GaussianMixture`` of ``own.components`` (fewer for a class with fewer
    rows: one per row), padded to ``own.components`` with weight-0 copies of the first; a class
    with no rows a placeholder (weight 1 at 0, variance ``REG_COVAR``). Each class's seed is
    drawn from ``generator``."""
    from sklearn.mixture import GaussianMixture

    rows = features.detach().cpu().double().numpy()
    labels = labels.cpu().long().numpy()
    seeds = torch.randint(_SEED_BOUND, (num_classes,), generator=generator).tolist()
    dim, k = rows.shape[1], own.components
    spherical = own.covariance_type == "spherical"
    fits = []
    for c in range(num_classes):
        mine = rows[labels == c]
        if not len(mine):
            cov = np.full(1, REG_COVAR) if spherical else np.full((1, dim), REG_COVAR)
            fits.append(_pad(np.ones(1), np.zeros((1, dim)), cov, k))
            continue
        fitted = GaussianMixture(
            n_components=min(k, len(mine)),
            covariance_type=own.covariance_type,
            tol=own.tol,
            max_iter=own.max_iter,
            reg_covar=REG_COVAR,
            random_state=seeds[c],
        ).fit(mine)
        fits.append(_pad(fitted.weights_, fitted.means_, fitted.covariances_, k))
    weights, means, covariances = (torch.from_numpy(np.stack(part)).float() for part in zip(*fits))
    # sklearn's weights sum to 1 in float64; renormalised, they do in float32 too
    return FeatureMixture(weights / weights.sum(dim=1, keepdim=True), means, covariances)


def _pad(
    weights: np.ndarray, means: np.ndarray, covariances: np.ndarray, k: int
) -> tuple[np.ndarray, ...]:
    pad = k - len(weights)
    return (
        np.concatenate([weights, np.zeros(pad)]),
        np.concatenate([means, np.repeat(means[:1], pad, axis=0)]),
        np.concatenate([covariances, np.repeat(covariances[:1], pad, axis=0)]),
    )


def private_mixture(
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    own: FedPFTSettings,
    generator: torch.Generator,
    replayable: bool,
) -> tuple[FeatureMixture, torch.Tensor, DPRelease]:
    """Per class, for every class of the run (which classes a client holds is protected too),
    one Gaussian from :func:`fedbip_flwr.dp.noisy_estimate` of its features clipped to
    ``dp-clip`` sqrt(D): the noisy mean, the noisy per-feature variance (spherical: their
    average) and the rounded noisy count. Then, as post-processing (which keeps the guarantee),
    each is projected onto what honest features allow (:func:`project`)."""
    dim = features.shape[1]
    guarantee = gaussian_guarantee(own.dp_clip * math.sqrt(dim), own.dp_epsilon, own.dp_delta)
    estimates = [
        noisy_estimate(features[labels == c], guarantee, generator) for c in range(num_classes)
    ]
    means = torch.stack([e.mean() for e in estimates]).unsqueeze(1).cpu()
    variances = torch.stack([e.variance(floor=-math.inf) for e in estimates]).unsqueeze(1).cpu()
    means, variances = project(means, variances, own.covariance_type)
    mixture = FeatureMixture(torch.ones(num_classes, 1), means, variances)
    counts = torch.tensor([max(0, round(e.count)) for e in estimates], dtype=torch.int64)
    release = DPRelease(
        epsilon=guarantee.epsilon,
        delta=guarantee.delta,
        noise_multiplier=guarantee.noise_multiplier,
        clip=guarantee.clip,
        releases=guarantee.releases,
        covers=["class_counts", WEIGHTS, MEANS, COVARIANCES],
        unit=f"one private image ({guarantee.adjacency})",
        replayable_noise=replayable,
    )
    return mixture, counts, release


def project(
    means: torch.Tensor, variances: torch.Tensor, covariance_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy (C, K, D) means and per-feature variances moved to the nearest moments features in
    [0, FEATURE_CEILING] can have (what :func:`check_moments` holds an upload to): each mean
    into that range, each variance into [REG_COVAR, mean (ceiling - mean) + REG_COVAR]; a
    spherical one is the average over features, bounded likewise."""
    means = means.clamp(0.0, FEATURE_CEILING)
    room = means * (FEATURE_CEILING - means) + REG_COVAR
    if covariance_type == "spherical":
        return means, torch.minimum(variances.mean(-1), room.mean(-1)).clamp(min=REG_COVAR)
    return means, torch.minimum(variances, room).clamp(min=REG_COVAR)


def check_moments(mixture: FeatureMixture) -> None:
    """What EM fitted to honest features gives, analytically: weights a distribution per class;
    means of features that are >= 0 (ReLU) and at most FEATURE_CEILING; every variance at least
    the fit's floor REG_COVAR; and, since each row lies in [0, U] (x^2 <= U x), a component's
    mean m and variance v on a feature have v <= m (U - m) + REG_COVAR (for a spherical
    variance: averaged over the features)."""
    weights, means, covs = (
        mixture.weights.double(),
        mixture.means.double(),
        mixture.covariances.double(),
    )
    if bool((weights < 0).any()):
        raise PayloadError(f"{WEIGHTS} holds a negative weight")
    error = float((weights.sum(dim=1) - 1.0).abs().max())
    if error > WEIGHT_SUM_TOLERANCE:
        raise PayloadError(
            f"a class's {WEIGHTS} sum to 1 +- {error:.3g}, beyond {WEIGHT_SUM_TOLERANCE}"
        )
    if bool((covs < REG_COVAR * (1 - ROUNDING)).any()):
        raise PayloadError(
            f"{COVARIANCES} holds a variance below the fit's floor {REG_COVAR:g} (or <= 0)"
        )
    if float(means.min()) < -MEAN_TOLERANCE:
        raise PayloadError(
            f"{MEANS} holds {float(means.min()):.3g}: features are ReLU outputs, never negative"
        )
    if float(means.max()) > FEATURE_CEILING:
        raise PayloadError(
            f"{MEANS} holds {float(means.max()):.3g}, above any feature's {FEATURE_CEILING:g}"
        )
    room = (means.clamp(min=0) * (FEATURE_CEILING - means)).clamp(min=0)
    room = room.mean(-1) if covs.ndim == 2 else room
    if bool((covs > room * (1 + ROUNDING) + REG_COVAR * (1 + ROUNDING)).any()):
        c, k = (
            int(i)
            for i in (covs > room * (1 + ROUNDING) + REG_COVAR * (1 + ROUNDING)).nonzero()[0][:2]
        )
        raise PayloadError(
            f"class {c}, component {k} has a variance above mean x ({FEATURE_CEILING:g} - mean) + "
            f"{REG_COVAR:g}, the most features in [0, {FEATURE_CEILING:g}] can spread about that mean"
        )


@register
class FedPFT(Method):
    name = "fedpft"
    # uploads: per class a mixture of its features, and class counts
    uploads = frozenset({UploadKind.STATISTICS, UploadKind.COUNTS})
    settings: FedPFTSettings
    meta_model = FedPFTMeta
    tensor_names = ("class_counts", WEIGHTS, MEANS, COVARIANCES)

    def upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        own, cfg, data = self.settings, job.cfg, job.data
        encoder = public_encoder(cfg.ldm.model, cfg.classifier.image_size, job.device)
        features = encoder(data.images)
        identity, dim = encoder_identity(cfg.ldm.model)
        meta = {
            **common_meta(job),
            "encoder": identity,
            "image_size": cfg.classifier.image_size,
            "feature_dim": dim,
            "components": own.components,
            "covariance_type": own.covariance_type,
        }
        classes = len(data.classes)
        if own.dp_epsilon:
            mixture, counts, release = private_mixture(
                features,
                data.labels,
                classes,
                own,
                job.generator,
                cfg.federation.replayable_client_noise,
            )
            meta["num_examples"] = max(1, int(counts.sum()))
            tensors = {"class_counts": counts, **mixture.to_tensors()}
            return encode_upload(FedPFTMeta(**meta, dp=release), tensors), {
                EPSILON_METRIC: release.epsilon
            }
        mixture = fit_class_mixtures(features, data.labels, classes, own, job.generator)
        tensors = {"class_counts": class_counts(data.labels, classes), **mixture.to_tensors()}
        fitted = mixture.weights[mixture.weights > 0]
        return encode_upload(FedPFTMeta(**meta), tensors), {
            "mixture-smallest-weight": float(fitted.min())
        }

    def check(self, upload: Upload, server: ServerJob) -> Upload:
        own, meta, cfg = self.settings, upload.meta, server.cfg
        identity, dim = encoder_identity(cfg.ldm.model)
        refuse_mismatch(
            [
                (
                    "encoder",
                    meta.encoder,
                    identity,
                    "features must come from the server's backbone",
                ),
                (
                    "image size",
                    meta.image_size,
                    cfg.classifier.image_size,
                    "run config classifier.image-size",
                ),
                ("feature dimension", meta.feature_dim, dim, "the backbone's"),
                (
                    "components",
                    meta.components,
                    own.components,
                    "clients and server must share fedpft.components",
                ),
                (
                    "covariance type",
                    meta.covariance_type,
                    own.covariance_type,
                    "fedpft.covariance-type",
                ),
            ]
        )
        check_class_counts(upload, server)
        # check_alone built it from the header's shapes, which now are the server's
        mixture = upload.content
        self._check_release(meta.dp, mixture, dim)
        return upload

    def check_alone(self, upload: Upload) -> Upload:
        """Counts and mixture as the header states them, which needs no server: the tensors of
        its classes, components and feature width, and the mixture's :func:`check_moments`."""
        meta = upload.meta
        check_counts(upload)
        if meta.covariance_type not in FEDPFT_COVARIANCES:
            raise PayloadError(
                f"covariance type {meta.covariance_type!r} is not one of {list(FEDPFT_COVARIANCES)}"
            )
        shape = (len(meta.class_names), meta.components)
        spherical = meta.covariance_type == "spherical"
        cov_shape = shape if spherical else (*shape, meta.feature_dim)
        mixture = FeatureMixture(
            check_tensor(upload, WEIGHTS, torch.float32, shape, "(classes, components)"),
            check_tensor(
                upload,
                MEANS,
                torch.float32,
                (*shape, meta.feature_dim),
                "(classes, components, features)",
            ),
            check_tensor(
                upload, COVARIANCES, torch.float32, cov_shape, f"{meta.covariance_type} covariances"
            ),
        )
        check_moments(mixture)
        return dataclasses.replace(upload, content=mixture)

    def _check_release(self, release: DPRelease | None, mixture: FeatureMixture, dim: int) -> None:
        """A DP header where the run asks for one, no weaker, covering every tensor, the three
        releases at the run's clip, one component per class, and the epsilon its noise gives."""
        own = self.settings
        check_release_header(release, own.dp_epsilon, own.dp_delta, self.tensor_names)
        if release is None:
            return
        refuse_mismatch(
            [
                (
                    "statistics releases",
                    release.releases,
                    DP_RELEASES,
                    "per class a noisy sum, sum of squares and count",
                ),
                (
                    "DP clip",
                    release.clip,
                    own.dp_clip * math.sqrt(dim),
                    "fedpft.dp-clip times sqrt(D)",
                ),
                (
                    "components",
                    mixture.weights.shape[1],
                    1,
                    "a DP release is one Gaussian per class",
                ),
            ]
        )
        check_gaussian_epsilon(release)

    def train_set(
        self,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> dict[str, list[Path]]:
        return {}  # no images: the head is trained on drawn features in final_models

    def final_models(
        self, uploads: Mapping[str, Upload], server: ServerJob
    ) -> dict[str, nn.Module]:
        features, labels = drawn_features(uploads, server, self.settings.draws_per_image)
        head = train_head(
            features, labels, len(server.class_names), self.settings, server.cfg.seed, server.device
        )
        model = load_backbone(backbone_path(server.cfg.ldm.model))
        model.fc = head.cpu()
        return {GLOBAL: model.eval()}


def drawn_features(
    uploads: Mapping[str, Upload], server: ServerJob, per_image: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every client's draws, clients in id order: per class its count clipped to run config
    federation.max-images-per-class x ``per_image``, each from a component chosen by weight,
    seeded by the run seed and the client id."""
    parts, part_labels = [], []
    for client_id, upload in sorted(uploads.items()):
        counts = upload.tensors["class_counts"].clamp(max=server.cfg.class_cap) * per_image
        labels = torch.repeat_interleave(torch.arange(len(counts)), counts)
        generator = torch.Generator().manual_seed(
            client_seed(server.cfg.seed, f"{client_id}/fedpft")
        )
        parts.append(draw(upload.content, labels, generator))
        part_labels.append(labels)
    return torch.cat(parts), torch.cat(part_labels)


def draw(mixture: FeatureMixture, labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One (D,) feature per label from its class's mixture: a component by weight, then its
    Gaussian."""
    if not len(labels):
        return torch.empty(0, mixture.means.shape[-1])
    chosen = torch.multinomial(mixture.weights[labels], 1, generator=generator).squeeze(1)
    means, variances = mixture.means[labels, chosen], mixture.variances()[labels, chosen]
    return means + variances.sqrt() * torch.randn(means.shape, generator=generator)


def train_head(
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    own: FedPFTSettings,
    seed: int,
    device: torch.device | str = "cpu",
) -> nn.Linear:
    """``nn.Linear(D, C)`` initialised from ``seed`` and trained by :func:`fit_head` for
    ``head-epochs``; initialised and shuffled from ``seed`` alone."""
    generator = torch.Generator().manual_seed(seed)
    head = nn.Linear(features.shape[1], num_classes)
    bound = 1 / math.sqrt(features.shape[1])  # nn.Linear's own init, from this generator
    with torch.no_grad():
        head.weight.uniform_(-bound, bound, generator=generator)
        head.bias.uniform_(-bound, bound, generator=generator)
    return fit_head(head, features, labels, own.head_epochs, own, generator, device)


def fit_head(
    head: nn.Linear,
    features: torch.Tensor,
    labels: torch.Tensor,
    epochs: int,
    own: FedPFTSettings,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> nn.Linear:
    """``head`` trained in place from where it stands: AdamW at ``head-lr``, cross-entropy,
    ``epochs`` over (``features``, ``labels``) in batches of ``head-batch-size`` shuffled by
    ``generator``. FedPFT's server and FedAvg's head-only clients both train with it."""
    head.to(device).train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=own.head_lr)
    x, y = features.to(device), labels.to(device)
    for _ in range(epochs if len(y) else 0):
        for rows in torch.randperm(len(y), generator=generator).split(own.head_batch_size):
            rows = rows.to(device)
            loss = F.cross_entropy(head(x[rows]), y[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return head.eval()

"""Privacy measurements a benchmark runs on a finished federation.

Three questions, each asked of what an outsider (or the server) ends up holding:

* **Do the synthetic images give away which images a client held?** Distance to closest record
  (DCR): every real image's distance to its nearest synthetic image, for the client's own images
  (members) and for unseen images of the same domain and classes (non-members). Members closer
  than non-members means the synthetic set remembers them; the membership AUC says how much
  (0.5: nothing leaks, 1: members are told apart perfectly).
* **Can the server rebuild a private image?** PSNR and SSIM of its reconstruction against the
  true image, next to the same scores against an unrelated image of the same class: a
  reconstruction only counts as one where it beats that baseline.
* **Does the global classifier remember its training images?** A loss-threshold membership
  attack (lower loss = member): AUC and true-positive rate at a low false-positive rate.
* **Does the upload itself give away which images a client held?** The server holds every
  client's upload and the base model: it encodes a candidate image and tests it against the
  z(T) rows of its class (:func:`zT_membership_scores`), against the class's uploaded mixture
  (:func:`mixture_membership_scores`), or asks whether the learned concepts lower the
  candidate's diffusion loss (:func:`conditioning_loss_ratio_scores`: FedBiP's concepts,
  Espresso's conditions), before anything is synthesized.
* **Does the synthetic set give away more than its distances show?** A density ratio between
  the synthetic set and public reference images in a feature space (DOMIAS,
  :func:`density_ratio_membership`): where synthetic images crowd beyond what the domain
  explains, a member sits.

Images are float tensors (N, 3, H, W) in [-1, 1].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats
from sklearn.decomposition import PCA
from sklearn.metrics import roc_auc_score, roc_curve
from torch import nn
from torch.distributions import Categorical, Independent, MixtureSameFamily, Normal

from fedbip_flwr.classifier import backbone_path, fit_to_classifier, load_backbone
from fedbip_flwr.concepts import PromptLayout, conditioned_loss, encode_prompts, initial_concepts
from fedbip_flwr.config import ClassifierConfig
from fedbip_flwr.ldm import LDM
from fedbip_flwr.mixture import LatentMixture
from fedbip_flwr.shared_concepts import Concepts

Features = Callable[[torch.Tensor], torch.Tensor]  # images (N, 3, H, W) -> features (N, D)
Space = Literal["pixels", "features"]

CLASSIFIER_IMAGE_SIZE: int = ClassifierConfig.model_fields["image_size"].default
DATA_RANGE = 2.0  # images span [-1, 1]
FEATURE_BATCH = 256  # images per forward pass of a feature extractor
# SSIM as Wang et al. 2004 define it: an 11 x 11 Gaussian window of std 1.5, K1 = 0.01, K2 = 0.03.
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03
LOW_FPR = 0.01


def _auc_with_stderr(
    member_scores: torch.Tensor, non_member_scores: torch.Tensor
) -> tuple[float, float]:
    """ROC AUC of telling members (higher score) from non-members, and its standard error by
    Hanley & McNeil (1982): closed form, no resampling; at AUC 0.5 it is the exact null
    standard error of the Mann-Whitney statistic."""
    if not len(member_scores) or not len(non_member_scores):
        raise ValueError("membership needs at least one member and one non-member")
    labels = [1] * len(member_scores) + [0] * len(non_member_scores)
    scores = torch.cat([member_scores, non_member_scores]).double().numpy()
    auc = float(roc_auc_score(labels, scores))
    n1, n2 = len(member_scores), len(non_member_scores)
    q1, q2 = auc / (2 - auc), 2 * auc**2 / (1 + auc)
    variance = (auc * (1 - auc) + (n1 - 1) * (q1 - auc**2) + (n2 - 1) * (q2 - auc**2)) / (n1 * n2)
    return auc, math.sqrt(max(variance, 0.0))


# --------------------------------------------------------------------------------------------
# distance to closest record
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DCRResult:
    """The DCR membership test in one ``space``. ``share_closer``: members nearer the synthetic
    set than every non-member, which a synthetic set that copies some images shows even where
    the AUC, an average over all members, barely moves."""

    space: Space
    auc: float
    auc_stderr: float
    share_closer: float
    member_distances: torch.Tensor  # (members,) to the nearest synthetic image
    non_member_distances: torch.Tensor


def nearest_distances(
    queries: torch.Tensor, references: torch.Tensor, chunk: int = 1024
) -> torch.Tensor:
    """Each query row's Euclidean distance to its nearest reference row.

    Both sides go through ``torch.cdist`` a chunk at a time, so the extra memory is a few
    chunk-sized blocks: cdist's matrix-product path copies its inputs, and a whole synthetic
    set copied is what would not fit. That path finds the neighbour but loses float32 digits
    to cancellation (|a|^2 + |b|^2 - 2ab) exactly where DCR looks, at close pairs, by amounts
    that differ between CPU kinds; the distance to the neighbour it finds is recomputed as a
    difference.
    """
    queries, references = queries.flatten(1), references.flatten(1)
    if not len(references):
        raise ValueError("no reference rows to measure distances to")
    nearest = []
    for block in queries.split(chunk):
        found = [torch.cdist(block, part).min(dim=1) for part in references.split(chunk)]
        distance = torch.stack([f.values for f in found], dim=1)
        index = torch.stack([f.indices + k * chunk for k, f in enumerate(found)], dim=1)
        best = index.gather(1, distance.argmin(dim=1, keepdim=True)).squeeze(1)
        nearest.append((block - references[best]).norm(dim=1))
    return torch.cat(nearest) if nearest else queries.new_empty(0)


def _unit_features(features: Features, images: torch.Tensor) -> torch.Tensor:
    """Features L2-normalised, so their Euclidean distance sqrt(2 - 2 cos) orders pairs as
    cosine distance does, whatever the scale of the feature space."""
    with torch.no_grad():
        out = torch.cat([features(part) for part in images.split(FEATURE_BATCH)])
    return F.normalize(out.float().flatten(1), dim=1)


def dcr_membership(
    members: torch.Tensor,
    non_members: torch.Tensor,
    synthetic: torch.Tensor,
    features: Features | None = None,
) -> DCRResult:
    """DCR membership test of a client's ``members`` against ``non_members`` (unseen images of
    the same domain, class-balanced like the members, so that only membership differs) and the
    ``synthetic`` images made from the client's upload.

    Without ``features``: root-mean-square difference over the 3 * H * W values (the Euclidean
    distance over sqrt(3 H W)), in the images' [-1, 1] units. With ``features``: Euclidean
    distance between L2-normalised features. Score = -distance (members should be closer).
    """
    if features is None:
        space: Space = "pixels"
        scale = 1 / math.sqrt(math.prod(members.shape[1:]))
        member_d = nearest_distances(members, synthetic) * scale
        non_member_d = nearest_distances(non_members, synthetic) * scale
    else:
        space = "features"
        reference = _unit_features(features, synthetic)
        member_d = nearest_distances(_unit_features(features, members), reference)
        non_member_d = nearest_distances(_unit_features(features, non_members), reference)
    auc, stderr = _auc_with_stderr(-member_d, -non_member_d)
    share = float((member_d < non_member_d.min()).float().mean())
    return DCRResult(space, auc, stderr, share, member_d, non_member_d)


# DOMIAS's density estimates are kernel densities: in the backbone's 512 feature dimensions a
# few hundred synthetic images leave a KDE all bandwidth, so the features are first projected
# onto the reference's leading principal components.
DOMIAS_DIMENSIONS = 8


def density_ratio_membership(
    members: torch.Tensor,
    non_members: torch.Tensor,
    synthetic: torch.Tensor,
    reference: torch.Tensor,
    features: Features,
    dimensions: int = DOMIAS_DIMENSIONS,
) -> AttackResult:
    """DOMIAS (van Breugel et al., AISTATS 2023) on a synthetic set: score a candidate by
    ``log p_syn(x) - log p_ref(x)``, the synthetic set's density over the density of public
    ``reference`` images of the same domain (which the attacker has, as the server has the base
    model's corpus), both Gaussian KDEs (scipy, Scott's bandwidth) of L2-normalised features
    projected onto the reference's top ``dimensions`` principal components. Where synthetic
    images crowd beyond what the domain explains, the set remembers someone: DCR sees only
    the nearest synthetic image, this the set's whole local density."""
    unit = {
        name: _unit_features(features, images).double().numpy()
        for name, images in (
            ("members", members),
            ("non_members", non_members),
            ("synthetic", synthetic),
            ("reference", reference),
        )
    }
    # a KDE of n points spans at most n - 1 dimensions (a tiny synthetic set: fewer)
    dimensions = min(dimensions, len(synthetic) - 1, len(reference) - 1)
    projection = PCA(dimensions, random_state=0).fit(unit["reference"])
    z = {name: projection.transform(f) for name, f in unit.items()}
    synthetic_density = stats.gaussian_kde(z["synthetic"].T)
    reference_density = stats.gaussian_kde(z["reference"].T)

    def score(points: np.ndarray) -> torch.Tensor:
        ratio = synthetic_density.logpdf(points.T) - reference_density.logpdf(points.T)
        return torch.from_numpy(ratio)

    return membership_result(
        score(z["members"]), score(z["non_members"]), statistic="density-ratio"
    )


def backbone_features(
    model_folder: str | Path, image_size: int = CLASSIFIER_IMAGE_SIZE
) -> Features:
    """The penultimate (512-d, after average pooling) features of the ResNet-18 backbone shipped
    with the base model, on images resized as the classifier sees them (``image_size``).

    The backbone was trained on the LDM's public pretraining corpus only, never on a client's or
    a test image: distances in its space measure no knowledge of the private data themselves.
    """
    net = load_backbone(backbone_path(model_folder))
    net.fc = nn.Identity()
    net.eval()

    @torch.no_grad()
    def features(images: torch.Tensor) -> torch.Tensor:
        return net(fit_to_classifier(images, image_size))

    return features


# --------------------------------------------------------------------------------------------
# reconstruction
# --------------------------------------------------------------------------------------------
def _check_pairs(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape or a.dim() != 4:
        raise ValueError(
            f"need two (N, C, H, W) sets of the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB for data range 2 ([-1, 1]): 10 log10(4 / MSE), inf where identical."""
    _check_pairs(a, b)
    mse = (a.double() - b.double()).square().flatten(1).mean(1)
    return 10 * torch.log10(DATA_RANGE**2 / mse)


def _gaussian_window(channels: int) -> torch.Tensor:
    """The normalised 2-D Gaussian window, one copy per channel for a grouped convolution."""
    offsets = torch.arange(SSIM_WINDOW, dtype=torch.float64) - (SSIM_WINDOW - 1) / 2
    line = torch.exp(-offsets.square() / (2 * SSIM_SIGMA**2))
    line = line / line.sum()
    return torch.outer(line, line).repeat(channels, 1, 1, 1)


def ssim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-image SSIM (Wang et al. 2004) for data range 2, computed per channel and averaged
    over channels and over every window position that fits inside the image (no padding).

    Float64: the local variances are differences of moments, which cancel in flat regions.
    """
    _check_pairs(a, b)
    if min(a.shape[-2:]) < SSIM_WINDOW:
        raise ValueError(
            f"SSIM needs images of at least {SSIM_WINDOW} px, got {tuple(a.shape[-2:])}"
        )
    x, y = a.double(), b.double()
    window = _gaussian_window(x.shape[1])

    def local_mean(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, window, groups=x.shape[1])

    mu_x, mu_y = local_mean(x), local_mean(y)
    var_x = local_mean(x * x) - mu_x.square()
    var_y = local_mean(y * y) - mu_y.square()
    cov = local_mean(x * y) - mu_x * mu_y
    c1, c2 = (SSIM_K1 * DATA_RANGE) ** 2, (SSIM_K2 * DATA_RANGE) ** 2
    index = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / (
        (mu_x.square() + mu_y.square() + c1) * (var_x + var_y + c2)
    )
    return index.flatten(1).mean(1)


@dataclass(frozen=True)
class ReconstructionScore:
    """Mean PSNR (dB) and SSIM of the reconstructions against the true images, and against
    unrelated images of the same class (what a reconstruction that knows only the class gets)."""

    psnr: float
    ssim: float
    baseline_psnr: float
    baseline_ssim: float


def reconstruction_score(
    reconstructions: torch.Tensor, originals: torch.Tensor, unrelated: torch.Tensor
) -> ReconstructionScore:
    """Scores of the server's ``reconstructions`` of the private ``originals`` (same order),
    with ``unrelated`` (row i: an image of row i's class the client never held) as baseline.
    A mean PSNR is inf where any reconstruction is exact."""
    return ReconstructionScore(
        psnr=float(psnr(reconstructions, originals).mean()),
        ssim=float(ssim(reconstructions, originals).mean()),
        baseline_psnr=float(psnr(reconstructions, unrelated).mean()),
        baseline_ssim=float(ssim(reconstructions, unrelated).mean()),
    )


def averaged_reconstructions(images: torch.Tensor, sources: torch.Tensor, n: int) -> torch.Tensor:
    """The mean of the server's images of each of ``n`` private images, where ``images[j]``
    comes from private image ``sources[j]`` (every z(T) of it, every pass): what differs between
    them (the partner, gamma, the noise, the pass's concept shift) averages out, what they share
    (image i) does not. Every image needs at least one row."""
    if sources.shape != (len(images),):
        raise ValueError(f"{len(sources)} sources for {len(images)} images")
    if not torch.equal(sources.unique(), torch.arange(n)):
        raise ValueError(f"the sources must name each of the {n} private images, and only them")
    return group_rows(images, torch.zeros_like(sources), sources)[0].float()


# --------------------------------------------------------------------------------------------
# membership inference on a classifier
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossAttackResult:
    """A loss-threshold membership attack: AUC (0.5: nothing leaks) and the true-positive rate
    at false-positive rate at most ``max_fpr``, the regime where an attack is believed."""

    auc: float
    auc_stderr: float
    tpr_at_max_fpr: float
    max_fpr: float


def loss_membership_inference(
    member_losses: torch.Tensor | Sequence[float],
    non_member_losses: torch.Tensor | Sequence[float],
    max_fpr: float = LOW_FPR,
) -> LossAttackResult:
    """Members are guessed where the per-example loss is low.

    The TPR is that of the best threshold whose FPR is at most ``max_fpr``, an operating point
    the attacker can actually pick, not an interpolation between two. Every threshold is kept
    (``drop_intermediate=False``): dropped collinear points can be exactly that threshold.
    """
    members = -torch.as_tensor(member_losses, dtype=torch.float64).flatten()
    non_members = -torch.as_tensor(non_member_losses, dtype=torch.float64).flatten()
    auc, stderr = _auc_with_stderr(members, non_members)
    return LossAttackResult(auc, stderr, tpr_at_fpr(members, non_members, max_fpr), max_fpr)


def confidence_logit(losses: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of the true class from cross-entropy losses (p = exp(-loss)): the
    scale on which a model's confidence on one example is close to Gaussian over models
    (LiRA, Carlini et al. 2022)."""
    losses = losses.double()
    return -losses - torch.log((-torch.expm1(-losses)).clamp_min(1e-300))


def lira_offline_scores(
    target_losses: torch.Tensor, reference_losses: torch.Tensor
) -> torch.Tensor:
    """Offline LiRA (higher = member): how far the target model's confidence on each candidate
    lies above that of R reference models trained without it, ``(phi - mean_r) / sigma``.
    ``target_losses`` (N,), ``reference_losses`` (R, N); with few references sigma is the
    references' spread pooled over candidates (the paper's fixed-variance form), so one
    candidate's R values set only its mean: what is hard or easy for any model of the
    domain is taken away, what only training on the candidate gives is left."""
    if reference_losses.dim() != 2 or reference_losses.shape[1] != len(target_losses):
        raise ValueError(
            f"reference losses {tuple(reference_losses.shape)} are not (R, {len(target_losses)})"
        )
    if len(reference_losses) < 2:
        raise ValueError("LiRA needs at least two reference models for their spread")
    phi = confidence_logit(reference_losses)
    sigma = phi.std(dim=0).pow(2).mean().sqrt().clamp_min(1e-12)
    return (confidence_logit(target_losses) - phi.mean(dim=0)) / sigma


def loss_drop_scores(sent_losses: torch.Tensor, returned_losses: torch.Tensor) -> torch.Tensor:
    """A multi-round server's test on one client's replies (higher = member): how far each
    round's reply lowered a candidate's loss below that of the global model the server sent it,
    summed over the rounds, ``sum_r loss(global_r) - loss(reply_r)``. Both (R, N). How hard any
    model of the round finds a candidate is in both terms and cancels, as LiRA's references
    take it away (here the server trained the reference itself: it sent it); what the round's
    local training on the candidate gives is left."""
    if sent_losses.dim() != 2 or sent_losses.shape != returned_losses.shape:
        raise ValueError(
            f"losses under the sent models {tuple(sent_losses.shape)} and the replies "
            f"{tuple(returned_losses.shape)} are not both (rounds, candidates)"
        )
    return (sent_losses.double() - returned_losses.double()).sum(dim=0)


def tpr_at_fpr(
    member_scores: torch.Tensor | Sequence[float],
    non_member_scores: torch.Tensor | Sequence[float],
    fpr: float = LOW_FPR,
) -> float:
    """The true-positive rate of the best threshold (higher score = member) whose false-positive
    rate is at most ``fpr``: an operating point the attacker can actually pick, not an
    interpolation between two. Every threshold is kept (``drop_intermediate=False``): dropped
    collinear points can be exactly that threshold. With n non-members, an ``fpr`` below 1/n
    allows no false positive at all."""
    members = torch.as_tensor(member_scores, dtype=torch.float64).flatten()
    non_members = torch.as_tensor(non_member_scores, dtype=torch.float64).flatten()
    if not len(members) or not len(non_members):
        raise ValueError("membership needs at least one member and one non-member")
    labels = [1] * len(members) + [0] * len(non_members)
    rates, tpr, _ = roc_curve(
        labels, torch.cat([members, non_members]).numpy(), drop_intermediate=False
    )
    return float(tpr[rates <= fpr].max())


# --------------------------------------------------------------------------------------------
# membership inference on the z(T) upload (the server, before any synthesis)
# --------------------------------------------------------------------------------------------
ZTStatistic = Literal["likelihood-ratio", "max-correlation"]


def class_means(latents: torch.Tensor, labels: torch.Tensor) -> dict[int, torch.Tensor]:
    """The mean latent of every label present (float64, flattened)."""
    return {int(y): latents[labels == y].double().flatten(1).mean(0) for y in labels.unique()}


@dataclass(frozen=True)
class LatentReference:
    """What the server learns from reference latents it encoded itself (public images of the
    domain and classes, none of them a candidate): each class's centre, and the class-centred
    latents pooled over classes, scaled so that ``spread.T @ spread`` is the within-class
    covariance (rank at most the reference's size less its classes)."""

    centres: dict[int, torch.Tensor]
    spread: torch.Tensor  # (references, values)

    @classmethod
    def of(cls, latents: torch.Tensor, labels: torch.Tensor) -> LatentReference:
        centres = class_means(latents, labels)
        flat = latents.double().flatten(1)
        centred = flat - torch.stack([centres[int(y)] for y in labels])
        dof = max(1, len(flat) - len(centres))
        return cls(centres, centred / math.sqrt(dof))


def group_rows(
    rows: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean of each group's rows, its label and its row count, groups in ascending id.
    A group is what an oracle (or an upload in image order) says are one image's rows: their
    independent noise averages down by sqrt(count), the image they share does not."""
    if len(groups) != len(rows) or len(labels) != len(rows):
        raise ValueError(f"{len(rows)} rows, {len(labels)} labels and {len(groups)} group ids")
    ids, index, counts = groups.unique(return_inverse=True, return_counts=True)
    sums = torch.zeros(len(ids), *rows.shape[1:], dtype=torch.float64).index_add_(
        0, index, rows.double()
    )
    group_labels = torch.full((len(ids),), -1, dtype=labels.dtype).scatter_(0, index, labels)
    if (group_labels[index] != labels).any():
        raise ValueError("a group mixes rows of different labels")
    return sums / counts.view(-1, *[1] * (rows.dim() - 1)), group_labels, counts


def zT_membership_scores(
    candidate_latents: torch.Tensor,
    candidate_labels: torch.Tensor,
    upload_rows: torch.Tensor,
    upload_labels: torch.Tensor,
    *,
    signal_scale: float,
    reference: LatentReference | None = None,
    groups: torch.Tensor | None = None,
    latents_per_image: int = 1,
    gamma_mean: float = 0.5,
    gamma_std: float = 0.1,
    statistic: ZTStatistic = "likelihood-ratio",
    whiten: bool = True,
) -> torch.Tensor:
    """Membership scores (higher = member) of candidate latents z(0) against a z(T) upload.

    Every upload row is ``r = a (g z_i + (1 - g) z_i') + s eps`` (``a = signal_scale`` =
    sqrt(abar_T), ``s = sqrt(1 - a^2)``, g ~ N(``gamma_mean``, ``gamma_std``^2), i' a
    same-class partner). The candidate's latent centred by its class's centre is ``u = c - m``,
    a row centred likewise ``v = r - a m``. A row that does not carry the candidate is
    ``v ~ N(0, S)``, ``S = s^2 I + a^2 k C`` (C the within-class covariance of latents,
    k = E[g^2 + (1 - g)^2]); one that carries it, as image or as partner (g and 1 - g are both
    ~``gamma_mean``), has mean ``gamma_mean a u``. The matched filter ``w = S^-1 u`` gives
    ``t = <w, v> / sqrt(u' S^-1 u)``: N(0, 1), or N(mu, 1) with
    ``mu = gamma_mean a sqrt(u' S^-1 u)``, and a row's log likelihood ratio (it carries the
    candidate / it does not) ``x = mu t - mu^2 / 2``. The eps part of S is white; the other
    images' part, a^2 k C, is small per value at T near 1000 but not along the few directions
    in which images of a class vary most, where it is of the order of s^2 once latents are
    large (4x64x64): ``whiten`` (with a ``reference``) takes C from the reference's spread
    (Woodbury: an n x n solve). Without it, S = sigma^2 I with sigma the class's centred rows'
    spread per value.

    ``statistic``:

    * ``"max-correlation"``: the largest cosine between u and the class's v (the first
      measurement's test, never whitened); with ``groups``, each group's rows averaged first.
    * ``"likelihood-ratio"`` (default): the log likelihood ratio of "the candidate is one of the
      client's images". Rows as given (order unknown): each row of the class carries it
      independently with probability p = 2 / n (n = rows of the class / ``latents_per_image``
      images; per draw a member is one row's image and, on average, one row's partner), so the
      score is ``sum_r log(1 - p + p e^x_r)``: it adds up every row that carries the candidate,
      where the max keeps one, and weighs candidates by the signal mu their own u promises.
      With ``groups`` (one id per row: rows known to be one image's, an oracle or an upload in
      image order): the candidate is the image of exactly one of the class's n groups (its
      rows' x summed: the averaged rows' matched filter) and the partner of any other row with
      probability q = 1 / (n - 1): ``log((1/n) sum_j exp(X_j - P_j)) + P``, with X_j the sum
      of group j's x, P_j of its rows' ``log(1 - q + q e^x)``, P of every row's. The order
      then only ever adds to what the rows as given tell.

    ``reference``: the server's class centres and spread (:meth:`LatentReference.of`); without
    it, a class is centred by its upload rows' mean over ``a``, whose noise s / (a sqrt(M)) per
    value swamps the centre at T near 1000. ``latents_per_image`` (K, a public run setting) is
    only read for the rows as given.
    """
    if candidate_latents.shape[1:] != upload_rows.shape[1:]:
        raise ValueError(
            f"candidates {tuple(candidate_latents.shape[1:])} and rows {tuple(upload_rows.shape[1:])} differ in shape"
        )
    if not 0 < signal_scale <= 1:
        raise ValueError(f"signal_scale is sqrt(abar_T), in (0, 1]; got {signal_scale}")
    if latents_per_image < 1:
        raise ValueError(f"latents_per_image must be >= 1, got {latents_per_image}")
    if statistic not in ("likelihood-ratio", "max-correlation"):
        raise ValueError(f"unknown statistic {statistic!r}")
    if groups is not None and len(groups) != len(upload_rows):
        raise ValueError(f"{len(groups)} group ids for {len(upload_rows)} rows")
    a = signal_scale
    candidates = candidate_latents.double().flatten(1)
    rows = upload_rows.double().flatten(1)
    noise = (
        _row_noise(a, gamma_mean, gamma_std, reference)
        if whiten and reference is not None
        else None
    )
    scores = torch.empty(len(candidates), dtype=torch.float64)
    for y in candidate_labels.unique().tolist():
        mine, theirs = candidate_labels == y, upload_labels == y
        if not theirs.any():
            raise ValueError(f"the upload holds no row of class {y}")
        centre = reference.centres[y] if reference is not None else rows[theirs].mean(0) / a
        u = candidates[mine] - centre
        v = rows[theirs] - a * centre
        class_groups = groups[theirs] if groups is not None else None
        tiny = torch.finfo(torch.float64).tiny
        if statistic == "max-correlation":
            if class_groups is not None:
                v = group_rows(v, torch.zeros(len(v), dtype=torch.long), class_groups)[0]
            scores[mine] = (F.normalize(u, dim=1, eps=tiny) @ F.normalize(v, dim=1).T).amax(dim=1)
            continue
        if noise is None:
            w = u / v.square().mean()  # S = sigma^2 I
        else:
            w = noise(u)
        energy = (u * w).sum(dim=1, keepdim=True).clamp_min(tiny)  # u' S^-1 u
        mu = gamma_mean * a * energy.sqrt()
        x = mu * (w @ v.T) / energy.sqrt() - mu.square() / 2  # (candidates, rows)
        if class_groups is None:
            scores[mine] = _carried(x, 2 * latents_per_image / len(v)).sum(dim=1)
            continue
        ids, index = class_groups.unique(return_inverse=True)
        n = len(ids)
        partner = _carried(x, 1 / (n - 1)) if n > 1 else torch.zeros_like(x)
        per_group = torch.zeros(len(x), n, dtype=torch.float64)
        per_group.index_add_(1, index, x - partner)
        scores[mine] = per_group.logsumexp(dim=1) - math.log(n) + partner.sum(dim=1)
    return scores


def _row_noise(
    a: float, gamma_mean: float, gamma_std: float, reference: LatentReference
) -> Callable[[torch.Tensor], torch.Tensor]:
    """u -> S^-1 u for S = s^2 I + a^2 k R'R (R the reference's spread), by Woodbury:
    S^-1 = (I - R' (s^2 / (a^2 k) I + R R')^-1 R) / s^2."""
    s2 = 1 - a * a
    k = gamma_mean**2 + (1 - gamma_mean) ** 2 + 2 * gamma_std**2
    spread = reference.spread
    if s2 <= 0:  # no noise at all: the images' spread is all there is
        s2 = torch.finfo(torch.float64).eps * float(spread.square().sum(1).mean())
    inner = torch.eye(len(spread), dtype=torch.float64) * (s2 / (a * a * k)) + spread @ spread.T
    factor = torch.linalg.cholesky(inner)

    def solve(u: torch.Tensor) -> torch.Tensor:
        return (u - torch.cholesky_solve(spread @ u.T, factor).T @ spread) / s2

    return solve


def _carried(x: torch.Tensor, p: float) -> torch.Tensor:
    """log(1 - p + p e^x): a row's log likelihood ratio where it carries the candidate with
    probability p (x: its log likelihood ratio if it surely does), without overflow."""
    if p >= 1:
        return x
    return torch.logaddexp(torch.full_like(x, math.log1p(-p)), math.log(p) + x)


@dataclass(frozen=True)
class AttackResult:
    """A membership test's AUC (0.5: nothing leaks), its standard error, and the true-positive
    rate at false-positive rate at most ``max_fpr``; ``grouped``: a z(T) test that knew which
    rows are one image's."""

    statistic: str
    grouped: bool
    auc: float
    auc_stderr: float
    tpr_at_max_fpr: float
    max_fpr: float
    member_scores: torch.Tensor
    non_member_scores: torch.Tensor

    def summary(self) -> dict[str, float | str | bool]:
        return {
            "statistic": self.statistic,
            "grouped": self.grouped,
            "auc": self.auc,
            "auc_stderr": self.auc_stderr,
            "tpr_at_max_fpr": self.tpr_at_max_fpr,
            "max_fpr": self.max_fpr,
            "members": len(self.member_scores),
            "non_members": len(self.non_member_scores),
        }


def membership_result(
    member_scores: torch.Tensor,
    non_member_scores: torch.Tensor,
    *,
    statistic: str = "likelihood-ratio",
    grouped: bool = False,
    max_fpr: float = LOW_FPR,
) -> AttackResult:
    """AUC (Hanley-McNeil standard error) and TPR at ``max_fpr`` of any attack's scores
    (higher = member), members' and non-members' (pooled over uploads as wished)."""
    members, non_members = member_scores.double().flatten(), non_member_scores.double().flatten()
    auc, stderr = _auc_with_stderr(members, non_members)
    tpr = tpr_at_fpr(members, non_members, max_fpr)
    return AttackResult(statistic, grouped, auc, stderr, tpr, max_fpr, members, non_members)


# --------------------------------------------------------------------------------------------
# membership inference on a mixture upload (fedbip-mixture, FedLD): the server, before synthesis
# --------------------------------------------------------------------------------------------
MixtureStatistic = Literal["likelihood-ratio", "mean-filter"]


def mixture_log_density(
    mixture: LatentMixture, points: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """log p(x | y) of each point under its label's diagonal Gaussian mixture (float64);
    weight-0 components (padding) count for nothing."""
    components = Independent(
        Normal(mixture.means.double()[labels], mixture.variances.double()[labels].sqrt()), 1
    )
    density = MixtureSameFamily(
        Categorical(logits=mixture.weights.double()[labels].log()), components
    )
    return density.log_prob(points.double().flatten(1))


def mixture_membership_scores(
    candidate_latents: torch.Tensor,
    candidate_labels: torch.Tensor,
    uploaded: LatentMixture,
    *,
    signal_scale: float,
    reference: LatentReference,
    reference_mixture: LatentMixture | None = None,
    gamma_mean: float = 0.5,
    gamma_std: float = 0.1,
    statistic: MixtureStatistic = "likelihood-ratio",
) -> torch.Tensor:
    """Membership scores (higher = member) of candidate latents z(0) against a client's
    uploaded per-class mixtures over its z(T) rows.

    A row that carries the candidate as image or partner has mean ``gamma_mean a c +
    (1 - gamma_mean) a m`` (m the class centre; FedLD mixes nothing: ``gamma_mean = 1``,
    ``gamma_std = 0``), and the mixture's components are fitted to such rows, so a member pulls
    its class's fit towards ``a c``.

    * ``"likelihood-ratio"``: ``log p_up(x | y) - log p_ref(x | y)`` at that mean x, where
      ``reference_mixture`` is what the server fits the same way (same T, mixing, components)
      to z(T) it makes from public images: the issue's test; the reference takes away what any
      mixture of the class gives x.
    * ``"mean-filter"``: the class mixture's mean (its weights over its means, the mean of the
      class's rows) against the matched filter of the z(T) test
      (:func:`zT_membership_scores`): ``<S^-1 u, mean - a m> / sqrt(u' S^-1 u)``, u = c - m,
      S the row noise whitened by the reference's spread.
    """
    if candidate_latents.shape[1:].numel() != uploaded.means.shape[-1]:
        raise ValueError(
            f"candidates of {candidate_latents.shape[1:].numel()} values against a mixture "
            f"over {uploaded.means.shape[-1]}"
        )
    if not 0 < signal_scale <= 1:
        raise ValueError(f"signal_scale is sqrt(abar_T), in (0, 1]; got {signal_scale}")
    a = signal_scale
    candidates = candidate_latents.double().flatten(1)
    centres = torch.stack([reference.centres[int(y)] for y in candidate_labels])
    if statistic == "likelihood-ratio":
        if reference_mixture is None:
            raise ValueError("the likelihood ratio needs the server's reference_mixture")
        x = a * (gamma_mean * candidates + (1 - gamma_mean) * centres)
        return mixture_log_density(uploaded, x, candidate_labels) - mixture_log_density(
            reference_mixture, x, candidate_labels
        )
    if statistic != "mean-filter":
        raise ValueError(f"unknown statistic {statistic!r}")
    class_means = torch.einsum("cm,cmd->cd", uploaded.weights.double(), uploaded.means.double())
    u = candidates - centres
    w = _row_noise(a, gamma_mean, gamma_std, reference)(u)
    energy = (u * w).sum(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    return (w * (class_means[candidate_labels] - a * centres)).sum(dim=1) / energy.sqrt()


# --------------------------------------------------------------------------------------------
# membership inference on learned conditioning (FedBiP's S and V, Espresso's conditions): the
# server, before synthesis
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def concept_conditionings(
    ldm: LDM, concepts: Concepts, layout: PromptLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain prompt's and the learned concepts' cross-attention states (C, J, L, d), what
    :func:`conditioning_loss_ratio_scores` tests: the plain prompt holds the words S and V start
    from, which the server knows; with several concepts per class (class-clusters, class-major
    rows of V) each is one of the class's J conditionings."""
    classes = len(dict.fromkeys(concepts.concept_names))
    rows = torch.arange(len(concepts.concept_names))
    start = initial_concepts(ldm, layout, concepts.space)
    plain = encode_prompts(ldm, layout, concepts.space, *start, rows)
    learned = encode_prompts(ldm, layout, concepts.space, concepts.domain, concepts.classes, rows)
    return plain.unflatten(0, (classes, -1)), learned.unflatten(0, (classes, -1))


@torch.no_grad()
def conditioning_loss_ratio_scores(
    ldm: LDM,
    plain: torch.Tensor,
    learned: torch.Tensor,
    candidate_latents: torch.Tensor,
    candidate_labels: torch.Tensor,
    *,
    max_timestep: int,
    draws: int,
    generator: torch.Generator,
    batch_size: int = 64,
) -> torch.Tensor:
    """Membership scores (higher = member): how much a client's learned conditioning lowers a
    candidate's diffusion loss below the plain prompt's, ``L(c | plain_k) - min_j L(c |
    learned_kj)``, each averaged over ``draws`` pairs (t, eps) shared by all conditionings,
    t ~ U{1..max_timestep} as they were learned. ``plain`` and ``learned`` are (C, J, L, d)
    cross-attention states, J per class; the reference model is the frozen LDM under the plain
    prompt ``plain[k, 0]``, and the candidate's best of its class's J counts (the server does
    not know its sub-cluster). The conditioning was fitted to the members' losses."""
    per_class = learned.shape[1]
    z0 = candidate_latents.float()
    own = torch.zeros(per_class, len(z0), dtype=torch.float64)
    reference = torch.zeros(len(z0), dtype=torch.float64)
    for _ in range(draws):
        t = torch.randint(1, max_timestep + 1, (len(z0),), generator=generator)
        noise = torch.randn(z0.shape, generator=generator)
        for batch in torch.arange(len(z0)).split(batch_size):
            k = candidate_labels[batch]
            shared = (z0[batch], t[batch], noise[batch])
            reference[batch] += _losses(ldm, plain[k, 0], *shared)
            for j in range(per_class):
                own[j, batch] += _losses(ldm, learned[k, j], *shared)
    return (reference - own.amin(dim=0)) / draws


def _losses(
    ldm: LDM, cond: torch.Tensor, z0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """Each example's diffusion loss under its conditioning (float64, on the CPU)."""
    return conditioned_loss(ldm, cond, z0, t, noise, per_example=True).double().cpu()


# --------------------------------------------------------------------------------------------
# membership inference on per-class means (FedPFT's feature mixtures, OSCAR's conditioning)
# --------------------------------------------------------------------------------------------


def class_mean_scores(
    candidates: torch.Tensor,
    candidate_labels: torch.Tensor,
    uploaded_means: torch.Tensor,
    centres: dict[int, torch.Tensor],
) -> torch.Tensor:
    """Membership scores (higher = member) against an upload that holds a mean per class of
    something the server can compute for any candidate (FedPFT: the public backbone's features,
    whose class mixture's weighted mean is the class's feature mean; OSCAR: the text encoder's
    states of captions the server's own copy of the captioner writes). A member is one of the
    n_y images averaged, so it pulls its class's mean towards itself by 1 / n_y of its offset
    from the class centre (``centres``: what the server computes from public images): the
    matched filter ``<mean_y - r_y, x - r_y> / |x - r_y|`` (isotropic noise)."""
    x = candidates.double().flatten(1)
    means = uploaded_means.double().flatten(1)
    r = torch.stack([centres[int(y)] for y in candidate_labels]).double().flatten(1)
    offset = x - r
    norm = offset.norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    return ((means[candidate_labels] - r) * offset).sum(dim=1) / norm

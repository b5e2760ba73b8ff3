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

Images are float tensors (N, 3, H, W) in [-1, 1].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score, roc_curve
from torch import nn

from fedbip_flwr.classifier import backbone_path, fit_to_classifier, load_backbone
from fedbip_flwr.config import FedBiPConfig

Features = Callable[[torch.Tensor], torch.Tensor]  # images (N, 3, H, W) -> features (N, D)
Space = Literal["pixels", "features"]

CLASSIFIER_IMAGE_SIZE: int = FedBiPConfig.model_fields["classifier_image_size"].default
DATA_RANGE = 2.0  # images span [-1, 1]
FEATURE_BATCH = 256  # images per forward pass of a feature extractor
# SSIM as Wang et al. 2004 define it: an 11 x 11 Gaussian window of std 1.5, K1 = 0.01, K2 = 0.03.
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03
LOW_FPR = 0.01


def _auc_with_stderr(member_scores: torch.Tensor, non_member_scores: torch.Tensor) -> tuple[float, float]:
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


def nearest_distances(queries: torch.Tensor, references: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Each query row's Euclidean distance to its nearest reference row.

    Both sides go through ``torch.cdist`` a chunk at a time, so the extra memory is a few
    chunk-sized blocks: cdist's matrix-product path copies its inputs, and a whole synthetic
    set copied is what would not fit.
    """
    queries, references = queries.flatten(1), references.flatten(1)
    if not len(references):
        raise ValueError("no reference rows to measure distances to")
    nearest = []
    for block in queries.split(chunk):
        per_chunk = [torch.cdist(block, part).amin(dim=1) for part in references.split(chunk)]
        nearest.append(torch.stack(per_chunk, dim=1).amin(dim=1))
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


def backbone_features(model_folder: str | Path, image_size: int = CLASSIFIER_IMAGE_SIZE) -> Features:
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
        raise ValueError(f"need two (N, C, H, W) sets of the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")


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
        raise ValueError(f"SSIM needs images of at least {SSIM_WINDOW} px, got {tuple(a.shape[-2:])}")
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


def averaged_reconstructions(images: torch.Tensor, n: int) -> torch.Tensor:
    """The mean of the server's images of each of ``n`` private images, where row ``j * n + i``
    of ``images`` comes from private image i (every z(T) of it, every pass): what differs
    between them (the partner, gamma, the noise, the pass's concept shift) averages out,
    what they share (image i) does not."""
    if n < 1 or len(images) % n:
        raise ValueError(f"{len(images)} images are not whole sets of {n} private images")
    return images.reshape(len(images) // n, n, *images.shape[1:]).float().mean(0)


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
    labels = [1] * len(members) + [0] * len(non_members)
    fpr, tpr, _ = roc_curve(labels, torch.cat([members, non_members]).numpy(), drop_intermediate=False)
    return LossAttackResult(auc, stderr, float(tpr[fpr <= max_fpr].max()), max_fpr)

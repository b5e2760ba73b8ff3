"""Sub-clusters of each class's images in a public encoder's feature space.

Espresso learns one condition embedding per sub-cluster: J per class, found by hierarchical
(agglomerative) clustering of the class's images. The encoder must be public, trained on
nothing a client holds, so the features reveal nothing beyond the client's own images; for the
miniature LDM that is the ResNet-18 backbone shipped with the base model
(:func:`public_encoder`), trained on the LDM's public pretraining corpus only. Clustering takes
features, or an :data:`Encoder` (:func:`cluster_images`), so the Stable Diffusion path can bring
another public encoder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# _prepare is the classifier's own input step (train_classifier and evaluate both call it);
# classifier.py has no public name for it.
from .classifier import BACKBONE_SCRIPT, _prepare, backbone_path, load_backbone

Linkage = Literal["ward", "complete", "average", "single"]
# Images (N, 3, H, W) in [-1, 1] -> features (N, F), float32 on the CPU.
Encoder = Callable[[torch.Tensor], torch.Tensor]
# Images per forward pass: bounds the encoder's activations whatever the class's size.
ENCODER_BATCH = 64


def public_encoder(
    model: str | Path,
    image_size: int,
    device: torch.device | str = "cpu",
    batch_size: int = ENCODER_BATCH,
) -> Encoder:
    """Penultimate (512-d) features of the ResNet-18 backbone shipped with the base ``model``.

    ``image_size`` is the run config's classifier.image-size, the size the backbone was
    trained at: images are resized to it exactly as the classifier's training and evaluation
    resize theirs. (:func:`~fedbip_flwr.classifier.fit_to_classifier` would add nothing for
    float images: it never enlarges, and shrinks by the same resize.)
    """
    path = backbone_path(model)
    if not path.is_file():
        raise FileNotFoundError(
            f"sub-clustering needs a public image encoder: the ResNet-18 backbone shipped with the "
            f"base model at {path} is missing (make it with `python {BACKBONE_SCRIPT} --out {path.parent}`)."
        )
    net = load_backbone(path)
    net.fc = nn.Identity()  # the features the head would read, not its pretraining classes
    net.requires_grad_(False).eval().to(device)

    @torch.no_grad()
    def encode(images: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [
                net(_prepare(part.to(device), image_size)).float().cpu()
                for part in images.split(batch_size)
            ]
        )

    return encode


def cluster_images(
    images: torch.Tensor,
    labels: torch.Tensor,
    clusters: int,
    encoder: Encoder,
    linkage: Linkage = "ward",
) -> torch.Tensor:
    """:func:`cluster_classes` of the ``encoder``'s features of ``images``."""
    return cluster_classes(encoder(images), labels, clusters, linkage)


def cluster_classes(
    features: torch.Tensor, labels: torch.Tensor, clusters: int, linkage: Linkage = "ward"
) -> torch.Tensor:
    """Each image's sub-cluster within its class (N,), int64 in [0, J_eff) for its class.

    Agglomerative clustering of each class's L2-normalised features (N, F): distances then
    compare directions (cosine similarity, the usual measure between deep features), so an
    image's overall activation strength does not decide its sub-cluster. A class of n images
    gets J_eff = min(``clusters``, n) sub-clusters (:func:`effective_clusters`); at n <= J each
    image is its own. Deterministic: agglomerative clustering draws nothing, and sub-clusters
    are numbered in order of their first image, not by sklearn's tree internals.
    """
    if features.ndim != 2 or labels.shape != (len(features),):
        raise ValueError(
            f"features {tuple(features.shape)} and labels {tuple(labels.shape)} are not (N, F) and (N,)."
        )
    if clusters < 1:
        raise ValueError(f"clusters is {clusters}; a class needs at least 1.")
    unit = F.normalize(features.detach().cpu().double(), dim=1).numpy()
    labels = labels.cpu().long()
    assignment = torch.zeros(len(labels), dtype=torch.long)
    for c in labels.unique().tolist():
        rows = (labels == c).nonzero().squeeze(1)
        assignment[rows] = _cluster_class(unit[rows.numpy()], clusters, linkage)
    return assignment


def effective_clusters(labels: torch.Tensor, num_classes: int, clusters: int) -> torch.Tensor:
    """J_eff per class (C,): how many sub-clusters (and embeddings) :func:`cluster_classes`
    gives each class, known before clustering so embeddings can be allocated first."""
    return torch.bincount(labels.cpu().long(), minlength=num_classes).clamp(max=clusters)


def condition_rows(
    counts: torch.Tensor, clusters: int, labels: torch.Tensor, seed: int
) -> torch.Tensor:
    """For each image a server makes without a per-image latent, the row of its conditioning
    in a class-major (C J) table: one of its class's sub-clusters, uniformly. A class of n < J
    private images has n sub-clusters (:func:`effective_clusters`); one without images only
    its first, never learned, row."""
    usable = counts.clamp(min=1, max=clusters)[labels]
    chosen = (
        torch.rand(len(labels), generator=torch.Generator().manual_seed(seed)) * usable
    ).long()
    return labels * clusters + chosen


def _cluster_class(points: np.ndarray, clusters: int, linkage: Linkage) -> torch.Tensor:
    # sklearn refuses a single point, and n <= J points have only one partition into n clusters.
    if len(points) <= clusters:
        return torch.arange(len(points))
    from sklearn.cluster import AgglomerativeClustering

    found = AgglomerativeClustering(n_clusters=clusters, linkage=linkage).fit_predict(points)
    return torch.from_numpy(_in_order_of_appearance(found))


def _in_order_of_appearance(ids: np.ndarray) -> np.ndarray:
    """Renumber so cluster k is the k-th to appear: the ids then depend on the partition and
    the image order alone."""
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first)] = np.arange(len(first))
    return rank[inverse]

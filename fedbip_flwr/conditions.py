"""Fine-grained conditions: one cross-attention condition per sub-cluster of a class (Espresso).

A condition is a whole (L, d) sequence of cross-attention states, fed to the UNet as the text
encoder's output would be, never through the text encoder. Class k's J sub-clusters
(:mod:`fedbip_flwr.clusters`) each get one, learned with the frozen LDM's diffusion loss on
that sub-cluster's latents:

    min_c  E_{t ~ U{1..T}, eps} || eps - eps_theta(sqrt(abar_t) E(x) + sqrt(1 - abar_t) eps, t, c) ||^2

Every condition starts from tau of the plain prompt ("a {domain} of a {class}", the run's
template with the words S and V start from), so a sub-cluster without images keeps exactly
Prompts-only's conditioning, and moves as ``c0 + scale * u`` in the hidden space's coordinate
scale (:func:`fedbip_flwr.concepts.concept_scale`), so the learning rate means what it means
for FedBiP's concepts. The sources leave the initialisation and parametrisation open; these
are this project's choices (docs/peers.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .concepts import (
    concept_scale,
    conditioned_loss,
    optimise_embeddings,
    plain_prompt,
    relative_drift,
)
from .ldm import LDM
from .synthesis import encode_texts

SPACE = "hidden"  # conditions live where the UNet reads them: the text encoder's output


@dataclass(frozen=True)
class LearnedConditions:
    conditions: torch.Tensor  # (C, J, L, d) float32
    losses: list[float]  # mean loss per epoch
    drift: float  # mean over used conditions of ||c - c0|| / ||c0||


def initial_conditions(
    ldm: LDM, template: str, domain: str, class_names: Sequence[str], clusters: int
) -> torch.Tensor:
    """c0 (C, J, L, d): tau of each class's plain prompt, once per sub-cluster (float32, CPU).

    The server rebuilds the same c0 from an upload's domain and its own template and class
    list, and bounds how far each learned condition can have moved from it."""
    prompts = [plain_prompt(template, domain, name) for name in class_names]
    states = encode_texts(ldm, prompts).float().cpu()
    return states.unsqueeze(1).repeat(1, clusters, 1, 1)


def learn_conditions(
    ldm: LDM,
    start: torch.Tensor,
    z0: torch.Tensor,
    labels: torch.Tensor,
    clusters: torch.Tensor,
    max_timestep: int,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    on_epoch: Callable[[int, float], None] | None = None,
) -> LearnedConditions:
    """Learn every (class, sub-cluster) condition at once: image i's latent ``z0[i]`` trains
    ``start[labels[i], clusters[i]]`` and nothing else. A condition with no image keeps c0."""
    flat = start.reshape(-1, *start.shape[2:])
    index = labels.long() * start.shape[1] + clusters.long()

    def batch_loss(
        current: list[torch.Tensor], batch: torch.Tensor, t: torch.Tensor, noise: torch.Tensor
    ) -> torch.Tensor:
        return conditioned_loss(
            ldm, current[0][index[batch].to(current[0].device)], z0[batch], t, noise
        )

    (learned,), losses = optimise_embeddings(
        ldm,
        [flat],
        batch_loss,
        z0.shape,
        max_timestep,
        concept_scale(ldm, SPACE),
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        generator=generator,
        on_epoch=on_epoch,
    )
    used = index.unique()
    drift = sum(relative_drift(learned[i], flat[i].cpu()) for i in used.tolist()) / max(
        1, len(used)
    )
    return LearnedConditions(learned.reshape(start.shape), losses, drift)

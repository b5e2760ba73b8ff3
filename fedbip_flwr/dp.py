"""The Gaussian mechanism for an opt-in differentially private upload of per-class statistics.

A client that opts in uploads, per class, a noisy sum of its clipped per-image vectors and of
their elementwise squares (and optionally a noisy count) instead of anything computed from one
image alone; the server derives a diagonal Gaussian from them. Privacy is accounted with
dp-accounting's privacy loss distribution (PLD) accountant under add/remove-one adjacency, the
relation under which the sensitivities below hold.

Each statistic gets noise of std ``noise_multiplier * sensitivity``, so every statistic is one
Gaussian mechanism of the same noise multiplier, and a release of k statistics is k of them
composed (``dp_accounting.SelfComposedDpEvent``). Classes hold disjoint images, so one image
changes one class's statistics only: the guarantee of one class's release holds for all
classes' releases together (parallel composition). Whatever else a payload carries (latents,
concepts, labels) is outside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import dp_accounting
import torch
from dp_accounting.pld import PLDAccountant

Adjacency = Literal["add/remove one image"]
Statistic = Literal["sum", "sum of squares", "count"]
ADJACENCY: Adjacency = "add/remove one image"
# The accountant's epsilon is a pessimistic (valid) bound at any discretisation; 1e-3 instead of
# dp-accounting's 1e-4 builds each PLD ten times faster, and for one Gaussian was measured within
# 1e-7 relative of the exact epsilon (Balle & Wang 2018).
PLD_INTERVAL = 1e-3
# Noise can push the variance estimate to zero or below; a variance must stay positive to be
# sampled from or divided by.
VARIANCE_FLOOR = 1e-6


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie strictly between 0 and 1, got {delta!r}")


def _check_releases(releases: int) -> None:
    if isinstance(releases, bool) or not isinstance(releases, int) or releases < 1:
        raise ValueError(f"releases must be a positive integer, got {releases!r}")


def gaussian_releases(noise_multiplier: float, releases: int = 1) -> dp_accounting.DpEvent:
    """``releases`` Gaussian mechanisms on the same data, each of noise std ``noise_multiplier``
    times its sensitivity."""
    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier), releases)


def _accountant() -> PLDAccountant:
    return PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=PLD_INTERVAL
    )


def epsilon_for(noise_multiplier: float, delta: float, releases: int = 1) -> float:
    """The epsilon at ``delta`` of ``releases`` Gaussian mechanisms of this noise multiplier."""
    _check_positive("noise_multiplier", noise_multiplier)
    _check_delta(delta)
    _check_releases(releases)
    return _accountant().compose(gaussian_releases(noise_multiplier, releases)).get_epsilon(delta)


# Cached: a client calibrates once per class with the same budget, and one calibration builds
# about fifteen PLDs.
@lru_cache(maxsize=64)
def noise_multiplier_for(epsilon: float, delta: float, releases: int = 1) -> float:
    """The smallest noise multiplier (within 1e-6) at which ``releases`` Gaussian mechanisms are
    (``epsilon``, ``delta``)-DP; dp-accounting guarantees the result never exceeds ``epsilon``."""
    _check_positive("epsilon", epsilon)
    _check_delta(delta)
    _check_releases(releases)
    return float(dp_accounting.calibrate_dp_mechanism(
        _accountant, lambda sigma: gaussian_releases(sigma, releases), epsilon, delta
    ))  # fmt: skip


def clip_rows(x: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``x`` with each example (row, flattened) scaled down to L2 norm at most ``max_norm``, which
    bounds what one example can add to a sum; shorter rows are left as they are."""
    _check_positive("max_norm", max_norm)
    rows = x.flatten(1)
    scale = (max_norm / rows.norm(dim=1, keepdim=True)).clamp(max=1.0)  # a zero row: inf -> 1
    return (rows * scale).view_as(x)


@dataclass(frozen=True)
class DPGuarantee:
    """What a release guarantees: (``epsilon``, ``delta``)-DP for the ``covers`` statistics,
    under ``adjacency``, each with noise std ``noise_multiplier`` times its sensitivity, rows
    clipped to L2 norm ``clip``, accounted as ``releases`` composed Gaussian mechanisms."""

    epsilon: float
    delta: float
    noise_multiplier: float
    clip: float
    releases: int
    covers: tuple[Statistic, ...]
    adjacency: Adjacency = ADJACENCY


@dataclass(frozen=True)
class DPGaussianEstimate:
    """One class's released statistics and the diagonal Gaussian they give. ``count`` is noisy
    when the guarantee covers it; otherwise it is the exact count, which the guarantee does not
    protect (the server knows it anyway where it sees the labels)."""

    sum_rows: torch.Tensor  # (D,) noisy sum of the clipped rows
    sum_squares: torch.Tensor | None  # (D,) noisy sum of their elementwise squares, if released
    count: float
    guarantee: DPGuarantee

    def _count(self) -> float:
        """The count to divide by: a noisy count may be below 1, and a class has an image."""
        return max(self.count, 1.0)

    def mean(self) -> torch.Tensor:
        return self.sum_rows / self._count()

    def variance(self, floor: float = VARIANCE_FLOOR) -> torch.Tensor:
        """E[x^2] - E[x]^2 per coordinate, floored at ``floor``."""
        if self.sum_squares is None:
            raise ValueError("the release holds no sum of squares: its variance is not estimated")
        return (self.sum_squares / self._count() - self.mean().square()).clamp(min=floor)


def _noise(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, device=generator.device) * std


def dp_gaussian_estimate(
    rows: torch.Tensor,
    clip: float,
    epsilon: float,
    delta: float,
    generator: torch.Generator,
    *,
    noise_count: bool = True,
    squares: bool = True,
) -> DPGaussianEstimate:
    """A (``epsilon``, ``delta``)-DP diagonal Gaussian of one class's per-example ``rows``
    ((n, ...), each flattened to D values), noise drawn from the client's ``generator``.

    Rows are clipped to L2 norm ``clip`` (C). Under add/remove one image the sum of rows has L2
    sensitivity C, the sum of elementwise squares C^2 (||x * x||_2 <= ||x||_2^2 <= C^2) and the
    count 1; each gets Gaussian noise of std sigma times its sensitivity, with sigma calibrated
    so the 3 releases (one fewer for each of ``noise_count=False``, ``squares=False``) compose
    to (``epsilon``, ``delta``). Without ``squares`` only the mean is estimated, which is worth
    it where the second moment's noise (sigma C^2 / n per coordinate) would bury the variance.
    """
    _check_positive("clip", clip)
    if rows.dim() < 2:
        raise ValueError(f"rows must be (n, ...) with one example per row, got shape {tuple(rows.shape)}")
    wanted: tuple[tuple[Statistic, bool], ...] = (("sum", True), ("sum of squares", squares), ("count", noise_count))
    covers = tuple(name for name, on in wanted if on)
    sigma = noise_multiplier_for(epsilon, delta, len(covers))
    clipped = clip_rows(rows.flatten(1).float(), clip)
    width = (clipped.shape[1],)
    sum_rows = clipped.sum(0) + _noise(width, sigma * clip, generator).to(clipped.device)
    sum_squares = (
        clipped.square().sum(0) + _noise(width, sigma * clip**2, generator).to(clipped.device) if squares else None
    )
    count = float(len(clipped)) + (float(_noise((), sigma, generator)) if noise_count else 0.0)
    guarantee = DPGuarantee(epsilon, delta, sigma, clip, len(covers), covers)
    return DPGaussianEstimate(sum_rows, sum_squares, count, guarantee)

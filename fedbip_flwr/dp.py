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

DP-SGD (Abadi et al. 2016) learns embeddings under the same adjacency: every step takes each
image with probability q (Poisson sampling), clips each image's gradient to L2 norm C and adds
noise of std sigma C to the sum, one Poisson-sampled Gaussian mechanism per step
(:func:`dp_sgd_event`). :func:`split_budget` calibrates DP-SGD and a statistics release
together, so that their composition (``dp_accounting.ComposedDpEvent``, the same PLD
accountant) meets one (epsilon, delta).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:  # dp-accounting (scipy) takes a second to import; only DP uploads account
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

Adjacency = Literal["add/remove one image"]
Statistic = Literal["sum", "sum of squares", "count"]
ADJACENCY: Adjacency = "add/remove one image"
# The accountant's epsilon is a pessimistic (valid) bound at any discretisation; 1e-3 instead of
# dp-accounting's 1e-4 builds each PLD ten times faster, and for one Gaussian was measured within
# 1e-7 relative of the exact epsilon (Balle & Wang 2018).
PLD_INTERVAL = 1e-3
# The metric a DP upload sends beside it, and the only one: the count of images, the files
# skipped and the client's seconds would each say what the guarantee hides.
EPSILON_METRIC = "dp-epsilon"
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
    import dp_accounting

    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(noise_multiplier), releases
    )


def _accountant() -> PLDAccountant:
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    return PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=PLD_INTERVAL,
    )


# Cached: a client calibrates once per class with the same budget, and one calibration builds
# about fifteen PLDs.
@lru_cache(maxsize=64)
def noise_multiplier_for(epsilon: float, delta: float, releases: int = 1) -> float:
    """The smallest noise multiplier (within 1e-6) at which ``releases`` Gaussian mechanisms are
    (``epsilon``, ``delta``)-DP; dp-accounting guarantees the result never exceeds ``epsilon``."""
    import dp_accounting

    _check_positive("epsilon", epsilon)
    _check_delta(delta)
    _check_releases(releases)
    return float(
        dp_accounting.calibrate_dp_mechanism(
            _accountant, lambda sigma: gaussian_releases(sigma, releases), epsilon, delta
        )
    )


def dp_sgd_steps_per_epoch(sample_rate: float) -> int:
    """Poisson-sampled steps that take each image once in expectation: ceil(1 / q)."""
    if not (math.isfinite(sample_rate) and 0 < sample_rate <= 1):
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate!r}")
    return math.ceil(1 / sample_rate - 1e-9)  # 1 / 0.1 is 10, not a hair above


def dp_sgd_event(sample_rate: float, noise_multiplier: float, steps: int) -> dp_accounting.DpEvent:
    """``steps`` steps of DP-SGD: each a Gaussian mechanism of this noise multiplier on a batch
    that holds each image with probability ``sample_rate``."""
    import dp_accounting

    sampled = dp_accounting.PoissonSampledDpEvent(
        sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
    )
    return dp_accounting.SelfComposedDpEvent(sampled, steps)


def composed_epsilon(delta: float, *events: dp_accounting.DpEvent) -> float:
    """The epsilon at ``delta`` of ``events`` all made on the same data."""
    import dp_accounting

    _check_delta(delta)
    return _accountant().compose(dp_accounting.ComposedDpEvent(list(events))).get_epsilon(delta)


@dataclass(frozen=True)
class SplitBudget:
    """DP-SGD's and a statistics release's noise multipliers, and the accountant's epsilon for
    the two composed (never above the one asked for)."""

    epsilon: float
    delta: float
    sgd_noise_multiplier: float
    stats_noise_multiplier: float
    sample_rate: float
    steps: int
    stats_releases: int

    def events(self) -> tuple[dp_accounting.DpEvent, dp_accounting.DpEvent]:
        return (
            dp_sgd_event(self.sample_rate, self.sgd_noise_multiplier, self.steps),
            gaussian_releases(self.stats_noise_multiplier, self.stats_releases),
        )


# Cached: three calibrations of about fifteen PLDs each (about 2 s at epsilon 16).
@lru_cache(maxsize=64)
def split_budget(
    epsilon: float,
    delta: float,
    sgd_share: float,
    sample_rate: float,
    steps: int,
    stats_releases: int,
) -> SplitBudget:
    """Noise multipliers for ``steps`` DP-SGD steps at ``sample_rate`` and ``stats_releases``
    Gaussian mechanisms, composed to (``epsilon``, ``delta``).

    Each part is first calibrated on its own, DP-SGD to ``sgd_share`` x epsilon and the
    statistics to the rest, both at ``delta``; which fixes the ratio of the two noise
    multipliers. Both are then scaled by the one factor at which the composition is
    (``epsilon``, ``delta``)-DP (below 1: composing is cheaper than adding epsilons).
    """
    import dp_accounting

    _check_positive("epsilon", epsilon)
    _check_delta(delta)
    _check_releases(stats_releases)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if not 0 < sgd_share < 1:
        raise ValueError(f"sgd_share must lie strictly between 0 and 1, got {sgd_share!r}")
    dp_sgd_steps_per_epoch(sample_rate)  # checks it

    def calibrate(event, target: float) -> float:
        return float(dp_accounting.calibrate_dp_mechanism(_accountant, event, target, delta))

    sgd = calibrate(lambda sigma: dp_sgd_event(sample_rate, sigma, steps), sgd_share * epsilon)
    stats = noise_multiplier_for((1 - sgd_share) * epsilon, delta, stats_releases)
    factor = calibrate(
        lambda k: dp_accounting.ComposedDpEvent(
            [
                dp_sgd_event(sample_rate, k * sgd, steps),
                gaussian_releases(k * stats, stats_releases),
            ]
        ),
        epsilon,
    )
    budget = SplitBudget(
        0.0, delta, factor * sgd, factor * stats, sample_rate, steps, stats_releases
    )
    return dataclasses.replace(budget, epsilon=composed_epsilon(delta, *budget.events()))


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


def gaussian_guarantee(
    clip: float, epsilon: float, delta: float, *, noise_count: bool = True, squares: bool = True
) -> DPGuarantee:
    """The guarantee under which :func:`noisy_estimate` makes an (``epsilon``, ``delta``)-DP
    diagonal Gaussian of one class's per-example rows, its releases alone.

    Rows are clipped to L2 norm ``clip`` (C). Under add/remove one image the sum of rows has L2
    sensitivity C, the sum of elementwise squares C^2 (||x * x||_2 <= ||x||_2^2 <= C^2) and the
    count 1; each gets Gaussian noise of std sigma times its sensitivity, with sigma calibrated
    so the 3 releases (one fewer for each of ``noise_count=False``, ``squares=False``) compose
    to (``epsilon``, ``delta``). Without ``squares`` only the mean is estimated, which is worth
    it where the second moment's noise (sigma C^2 / n per coordinate) would bury the variance.
    """
    _check_positive("clip", clip)
    wanted: tuple[tuple[Statistic, bool], ...] = (
        ("sum", True),
        ("sum of squares", squares),
        ("count", noise_count),
    )
    covers = tuple(name for name, on in wanted if on)
    sigma = noise_multiplier_for(epsilon, delta, len(covers))
    return DPGuarantee(epsilon, delta, sigma, clip, len(covers), covers)


def _check_rows(rows: torch.Tensor) -> None:
    if rows.dim() < 2:
        raise ValueError(
            f"rows must be (n, ...) with one example per row, got shape {tuple(rows.shape)}"
        )


def finite_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` without those holding a non-finite value. Dropping one is removing its image,
    which the add/remove adjacency covers; kept, one NaN would make its class's sum NaN and the
    upload a refusal that says something about that one image."""
    keep = rows.isfinite().all(1)
    return rows if bool(keep.all()) else rows[keep]


def noisy_estimate(
    rows: torch.Tensor, guarantee: DPGuarantee, generator: torch.Generator
) -> DPGaussianEstimate:
    """A diagonal Gaussian of one class's per-example ``rows`` ((n, ...), each flattened to D
    values): the statistics ``guarantee.covers`` of the finite rows (:func:`finite_rows`)
    clipped to ``guarantee.clip``, each
    with Gaussian noise of std ``guarantee.noise_multiplier`` times its sensitivity, drawn from
    the client's ``generator``. The noise multiplier is calibrated by the caller, for these
    releases alone (:func:`gaussian_guarantee`) or with others (:func:`split_budget`)."""
    _check_positive("clip", guarantee.clip)
    _check_rows(rows)
    sigma, clip, covers = guarantee.noise_multiplier, guarantee.clip, guarantee.covers
    clipped = clip_rows(finite_rows(rows.flatten(1).float()), clip)
    width = (clipped.shape[1],)
    sum_rows = clipped.sum(0) + _noise(width, sigma * clip, generator).to(clipped.device)
    sum_squares = (
        clipped.square().sum(0) + _noise(width, sigma * clip**2, generator).to(clipped.device)
        if "sum of squares" in covers
        else None
    )
    count = float(len(clipped)) + (
        float(_noise((), sigma, generator)) if "count" in covers else 0.0
    )
    return DPGaussianEstimate(sum_rows, sum_squares, count, guarantee)

"""The Gaussian mechanism of the opt-in DP upload (fedbip_flwr.dp) against its definitions.

The accountant is checked against the exact privacy profile of the Gaussian mechanism (Balle &
Wang 2018, Theorem 8), the noise against the std it must have, and the estimate against the
clipped moments it converges to when noise vanishes.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import norm

from fedbip_flwr.dp import (
    ADJACENCY,
    VARIANCE_FLOOR,
    clip_rows,
    dp_gaussian_estimate,
    epsilon_for,
    noise_multiplier_for,
)

DELTA = 1e-5


def balle_wang_delta(epsilon: float, sigma: float) -> float:
    """delta(eps) of one Gaussian mechanism, sensitivity 1, noise std sigma."""
    return norm.cdf(-epsilon * sigma + 1 / (2 * sigma)) - math.exp(epsilon) * norm.cdf(-epsilon * sigma - 1 / (2 * sigma))


@pytest.mark.parametrize("sigma", [0.8, 1.5, 4.0])
@pytest.mark.parametrize("epsilon", [0.25, 1.0])  # deltas 3e-6 .. 0.4
def test_epsilon_matches_the_closed_form_of_the_gaussian_mechanism(sigma: float, epsilon: float) -> None:
    delta = balle_wang_delta(epsilon, sigma)
    assert epsilon_for(sigma, delta) == pytest.approx(epsilon, rel=1e-3)


@pytest.mark.parametrize("releases", [1, 3])
@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_noise_multiplier_for_inverts_epsilon_for(epsilon: float, releases: int) -> None:
    sigma = noise_multiplier_for(epsilon, DELTA, releases)
    achieved = epsilon_for(sigma, DELTA, releases)
    assert achieved == pytest.approx(epsilon, rel=1e-3)
    assert achieved <= epsilon * (1 + 1e-9)  # calibrated noise never spends more than asked


def test_epsilon_decreases_as_noise_grows() -> None:
    epsilons = [epsilon_for(sigma, DELTA) for sigma in (0.7, 1.0, 2.0, 5.0)]
    assert all(later < earlier for earlier, later in zip(epsilons, epsilons[1:]))


def test_k_releases_cost_more_than_one_and_compose_as_one_gaussian() -> None:
    one, three = epsilon_for(2.0, DELTA), epsilon_for(2.0, DELTA, releases=3)
    assert three > one
    # k Gaussian mechanisms of noise multiplier s are exactly one of s / sqrt(k) (Gaussian DP)
    assert three == pytest.approx(epsilon_for(2.0 / math.sqrt(3), DELTA), rel=1e-4)
    assert noise_multiplier_for(1.0, DELTA, 3) > noise_multiplier_for(1.0, DELTA, 1)


def test_clip_rows_leaves_short_rows_and_scales_long_ones_to_the_clip() -> None:
    x = torch.zeros(3, 2, 2, 2)
    x[0, 0, 0, 0] = 0.5  # norm 0.5: short
    x[1] = 3.0  # norm 3 * sqrt(8): long
    clipped = clip_rows(x, 1.0)
    assert clipped.shape == x.shape
    assert torch.equal(clipped[0], x[0])
    assert clipped[1].norm().item() == pytest.approx(1.0, rel=1e-6)
    torch.testing.assert_close(clipped[1] / clipped[1].norm(), x[1] / x[1].norm())  # same direction
    assert torch.equal(clipped[2], x[2])  # a zero row stays zero


def test_noise_std_follows_the_clip_and_the_budget() -> None:
    clip, epsilon, width, draws = 2.0, 3.0, 4000, 5  # C^2 != C tells the two sums' noise apart
    rows = clip_rows(torch.randn(6, width, generator=torch.Generator().manual_seed(0)), clip)
    generator = torch.Generator().manual_seed(1)
    estimates = [dp_gaussian_estimate(rows, clip, epsilon, DELTA, generator) for _ in range(draws)]
    sigma = noise_multiplier_for(epsilon, DELTA, 3)
    guarantee = estimates[0].guarantee
    assert (guarantee.noise_multiplier, guarantee.releases, guarantee.clip) == (sigma, 3, clip)
    assert (guarantee.epsilon, guarantee.delta, guarantee.adjacency) == (epsilon, DELTA, ADJACENCY)
    assert guarantee.covers == ("sum", "sum of squares", "count")
    # 20,000 noise draws per statistic: the sample std is within 1/sqrt(2 * 20000) = 0.5 % of the
    # true std per standard error; 3 % is 6 of them
    sum_noise = torch.stack([e.sum_rows - rows.sum(0) for e in estimates])
    square_noise = torch.stack([e.sum_squares - rows.square().sum(0) for e in estimates])
    assert sum_noise.std().item() == pytest.approx(sigma * clip, rel=0.03)
    assert square_noise.std().item() == pytest.approx(sigma * clip**2, rel=0.03)
    # the count's noise, one draw per release: 2,000 draws, 1.6 % per standard error, 5 % is 3
    few = rows[:, :1]
    counts = torch.tensor([dp_gaussian_estimate(few, clip, epsilon, DELTA, generator).count for _ in range(2000)])
    assert (counts - len(rows)).std().item() == pytest.approx(sigma, rel=0.05)


def test_exact_count_is_left_out_of_the_guarantee() -> None:
    rows = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    estimate = dp_gaussian_estimate(rows, 1.0, 3.0, DELTA, torch.Generator().manual_seed(1), noise_count=False)
    assert estimate.count == 6.0
    assert estimate.guarantee.covers == ("sum", "sum of squares")
    assert estimate.guarantee.releases == 2
    assert estimate.guarantee.noise_multiplier == noise_multiplier_for(3.0, DELTA, 2) < noise_multiplier_for(3.0, DELTA, 3)


def test_huge_epsilon_gives_the_clipped_moments() -> None:
    clip = 1.0
    rows = 0.5 * torch.randn(4000, 8, generator=torch.Generator().manual_seed(0))  # norms ~1.4: most clipped
    clipped = clip_rows(rows, clip)
    estimate = dp_gaussian_estimate(rows, clip, 20.0, DELTA, torch.Generator().manual_seed(1))
    # noise on the mean and on E[x^2]: sigma * C / n and sigma * C^2 / n, about 1.3e-4 here
    tolerance = 2e-3
    assert (estimate.mean() - clipped.mean(0)).abs().max() < tolerance
    assert (estimate.variance() - clipped.var(0, correction=0)).abs().max() < tolerance
    # clipping must show: the unclipped variance is far off
    assert (estimate.variance() - rows.var(0, correction=0)).abs().min() > 10 * tolerance


def test_variance_is_floored_where_noise_makes_it_negative() -> None:
    rows = torch.full((4, 500), 0.1)  # true variance 0: noise sends about half the coordinates below
    variance = dp_gaussian_estimate(rows, 1.0, 1.0, DELTA, torch.Generator().manual_seed(0)).variance()
    assert (variance >= VARIANCE_FLOOR).all()
    assert (variance == VARIANCE_FLOOR).any()


@pytest.mark.parametrize(
    ("clip", "epsilon", "delta"),
    [(0.0, 1.0, DELTA), (-1.0, 1.0, DELTA), (1.0, 0.0, DELTA), (1.0, -2.0, DELTA),
     (1.0, math.inf, DELTA), (1.0, 1.0, 0.0), (1.0, 1.0, 1.0), (1.0, 1.0, -0.1)],
)  # fmt: skip
def test_bad_arguments_raise(clip: float, epsilon: float, delta: float) -> None:
    with pytest.raises(ValueError, match="must"):
        dp_gaussian_estimate(torch.ones(2, 3), clip, epsilon, delta, torch.Generator())


def test_bad_accounting_arguments_raise() -> None:
    with pytest.raises(ValueError, match="noise_multiplier"):
        epsilon_for(0.0, DELTA)
    with pytest.raises(ValueError, match="releases"):
        noise_multiplier_for(1.0, DELTA, 0)
    with pytest.raises(ValueError, match="max_norm"):
        clip_rows(torch.ones(2, 3), 0.0)
    with pytest.raises(ValueError, match="rows"):
        dp_gaussian_estimate(torch.ones(3), 1.0, 1.0, DELTA, torch.Generator())


def test_a_mean_only_release_composes_two_mechanisms_and_has_no_variance():
    rows = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    estimate = dp_gaussian_estimate(rows, 2.0, 4.0, 1e-5, torch.Generator().manual_seed(1), squares=False)
    assert estimate.sum_squares is None and estimate.guarantee.covers == ("sum", "count")
    assert estimate.guarantee.noise_multiplier == pytest.approx(noise_multiplier_for(4.0, 1e-5, 2))
    with pytest.raises(ValueError, match="no sum of squares"):
        estimate.variance()

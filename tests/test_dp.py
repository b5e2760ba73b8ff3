"""The Gaussian mechanism of the opt-in DP upload (fedbip_flwr.dp) against its definitions.

The accountant is checked against the exact privacy profile of the Gaussian mechanism (Balle &
Wang 2018, Theorem 8), the noise against the std it must have, and the estimate against the
clipped moments it converges to when noise vanishes. DP-SGD (fedbip_flwr.concepts.DPSGD):
its accounting against the exact profile of one Poisson-sampled Gaussian step and against
dp-accounting's RDP accountant over many, its per-image clipping and noise on the tiny model.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from scipy.stats import norm

from fedbip_flwr.concepts import (
    DPSGD,
    add_gradient_noise,
    concept_batch_loss,
    concept_scale,
    initial_concepts,
    private_gradient,
    prompt_layout,
)
from fedbip_flwr.dp import (
    ADJACENCY,
    VARIANCE_FLOOR,
    clip_rows,
    composed_epsilon,
    dp_sgd_event,
    dp_sgd_steps_per_epoch,
    gaussian_guarantee,
    gaussian_releases,
    noise_multiplier_for,
    noisy_estimate,
    split_budget,
)

DELTA = 1e-5


def epsilon_for(sigma: float, delta: float, releases: int = 1) -> float:
    """The accountant's epsilon for ``releases`` Gaussian mechanisms, as a server recomputes a
    DP header's (:mod:`fedbip_flwr.methods.fedld`)."""
    return composed_epsilon(delta, gaussian_releases(sigma, releases))


def balle_wang_delta(epsilon: float, sigma: float) -> float:
    """delta(eps) of one Gaussian mechanism, sensitivity 1, noise std sigma."""
    return norm.cdf(-epsilon * sigma + 1 / (2 * sigma)) - math.exp(epsilon) * norm.cdf(
        -epsilon * sigma - 1 / (2 * sigma)
    )


@pytest.mark.parametrize("sigma", [0.8, 1.5, 4.0])
@pytest.mark.parametrize("epsilon", [0.25, 1.0])  # deltas 3e-6 .. 0.4
def test_epsilon_matches_the_closed_form_of_the_gaussian_mechanism(
    sigma: float, epsilon: float
) -> None:
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
    estimates = [
        noisy_estimate(rows, gaussian_guarantee(clip, epsilon, DELTA), generator)
        for _ in range(draws)
    ]
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
    counts = torch.tensor(
        [
            noisy_estimate(few, gaussian_guarantee(clip, epsilon, DELTA), generator).count
            for _ in range(2000)
        ]
    )
    assert (counts - len(rows)).std().item() == pytest.approx(sigma, rel=0.05)


def test_exact_count_is_left_out_of_the_guarantee() -> None:
    rows = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    estimate = noisy_estimate(
        rows,
        gaussian_guarantee(1.0, 3.0, DELTA, noise_count=False),
        torch.Generator().manual_seed(1),
    )
    assert estimate.count == 6.0
    assert estimate.guarantee.covers == ("sum", "sum of squares")
    assert estimate.guarantee.releases == 2
    assert (
        estimate.guarantee.noise_multiplier
        == noise_multiplier_for(3.0, DELTA, 2)
        < noise_multiplier_for(3.0, DELTA, 3)
    )


def test_huge_epsilon_gives_the_clipped_moments() -> None:
    clip = 1.0
    rows = 0.5 * torch.randn(
        4000, 8, generator=torch.Generator().manual_seed(0)
    )  # norms ~1.4: most clipped
    clipped = clip_rows(rows, clip)
    estimate = noisy_estimate(
        rows, gaussian_guarantee(clip, 20.0, DELTA), torch.Generator().manual_seed(1)
    )
    # noise on the mean and on E[x^2]: sigma * C / n and sigma * C^2 / n, about 1.3e-4 here
    tolerance = 2e-3
    assert (estimate.mean() - clipped.mean(0)).abs().max() < tolerance
    assert (estimate.variance() - clipped.var(0, correction=0)).abs().max() < tolerance
    # clipping must show: the unclipped variance is far off
    assert (estimate.variance() - rows.var(0, correction=0)).abs().min() > 10 * tolerance


def test_variance_is_floored_where_noise_makes_it_negative() -> None:
    rows = torch.full(
        (4, 500), 0.1
    )  # true variance 0: noise sends about half the coordinates below
    variance = noisy_estimate(
        rows, gaussian_guarantee(1.0, 1.0, DELTA), torch.Generator().manual_seed(0)
    ).variance()
    assert (variance >= VARIANCE_FLOOR).all()
    assert (variance == VARIANCE_FLOOR).any()


@pytest.mark.parametrize(
    ("clip", "epsilon", "delta"),
    [
        (0.0, 1.0, DELTA),
        (-1.0, 1.0, DELTA),
        (1.0, 0.0, DELTA),
        (1.0, -2.0, DELTA),
        (1.0, math.inf, DELTA),
        (1.0, 1.0, 0.0),
        (1.0, 1.0, 1.0),
        (1.0, 1.0, -0.1),
    ],
)
def test_bad_arguments_raise(clip: float, epsilon: float, delta: float) -> None:
    with pytest.raises(ValueError, match="must"):
        noisy_estimate(
            torch.ones(2, 3), gaussian_guarantee(clip, epsilon, delta), torch.Generator()
        )


def test_bad_accounting_arguments_raise() -> None:
    with pytest.raises(ValueError, match="epsilon"):
        noise_multiplier_for(0.0, DELTA)
    with pytest.raises(ValueError, match="releases"):
        noise_multiplier_for(1.0, DELTA, 0)
    with pytest.raises(ValueError, match="max_norm"):
        clip_rows(torch.ones(2, 3), 0.0)
    with pytest.raises(ValueError, match="rows"):
        noisy_estimate(torch.ones(3), gaussian_guarantee(1.0, 1.0, DELTA), torch.Generator())


def test_a_mean_only_release_composes_two_mechanisms_and_has_no_variance():
    rows = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    estimate = noisy_estimate(
        rows, gaussian_guarantee(2.0, 4.0, 1e-5, squares=False), torch.Generator().manual_seed(1)
    )
    assert estimate.sum_squares is None and estimate.guarantee.covers == ("sum", "count")
    assert estimate.guarantee.noise_multiplier == pytest.approx(noise_multiplier_for(4.0, 1e-5, 2))
    with pytest.raises(ValueError, match="no sum of squares"):
        estimate.variance()


# --- DP-SGD: accounting -----------------------------------------------------------------------


def poisson_gaussian_delta(epsilon: float, q: float, sigma: float) -> float:
    """delta(eps) of one Poisson-sampled Gaussian step, sensitivity 1, noise std sigma, under
    add/remove one: the larger hockey-stick divergence of P = (1-q) N(0, s^2) + q N(1, s^2)
    (with the example) and Q = N(0, s^2) (without), in either order. p/q rises in x, so each
    divergence is an integral over a half-line, in closed form."""
    e = math.exp(epsilon)

    def mixture_tail(x: float) -> float:  # P(X > x) under P
        return (1 - q) * norm.sf(x / sigma) + q * norm.sf((x - 1) / sigma)

    x_high = sigma**2 * math.log((e - (1 - q)) / q) + 0.5  # p/q > e^eps above it
    remove = mixture_tail(x_high) - e * norm.sf(x_high / sigma)
    add = 0.0
    if math.exp(-epsilon) > 1 - q:  # q/p > e^eps below x_low
        x_low = sigma**2 * math.log((math.exp(-epsilon) - (1 - q)) / q) + 0.5
        add = norm.cdf(x_low / sigma) - e * (1 - mixture_tail(x_low))
    return max(remove, add)


@pytest.mark.parametrize(
    ("q", "sigma", "epsilon"), [(0.08, 1.0, 0.5), (0.01, 0.8, 1.0), (0.5, 2.0, 0.3)]
)
def test_one_dp_sgd_step_matches_the_exact_profile_of_the_poisson_sampled_gaussian(
    q, sigma, epsilon
) -> None:
    delta = poisson_gaussian_delta(epsilon, q, sigma)
    assert 1e-12 < delta < 0.5
    # the accountant's epsilon is a pessimistic bound: at or a hair above the exact one
    assert composed_epsilon(delta, dp_sgd_event(q, sigma, 1)) == pytest.approx(
        epsilon, rel=1e-2, abs=2e-3
    )
    assert composed_epsilon(delta, dp_sgd_event(q, sigma, 1)) >= epsilon * (1 - 1e-3)


def test_full_batch_dp_sgd_is_composed_gaussians() -> None:
    """q = 1 takes every image every step: k steps are k Gaussian mechanisms, that is one of
    noise multiplier sigma / sqrt(k) (closed form above)."""
    sigma, steps, epsilon = 4.0, 16, 1.0
    delta = balle_wang_delta(epsilon, sigma / math.sqrt(steps))
    assert composed_epsilon(delta, dp_sgd_event(1.0, sigma, steps)) == pytest.approx(
        epsilon, rel=1e-3
    )


def test_dp_sgd_over_many_steps_is_below_rdp_and_abadi_et_al() -> None:
    """Abadi et al. (2016): q = 0.01, sigma = 4, 10,000 steps give epsilon 1.26 at delta 1e-5
    with their moments accountant; dp-accounting's RDP accountant (finer orders) says 1.04. The
    PLD accountant is near exact (0.96 here): never above RDP's bound, and not far below it."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    event = dp_sgd_event(0.01, 4.0, 10_000)
    rdp = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    rdp_epsilon = rdp.compose(event).get_epsilon(1e-5)
    pld_epsilon = composed_epsilon(1e-5, event)
    assert rdp_epsilon == pytest.approx(1.04, abs=0.01)
    assert 0.85 * rdp_epsilon < pld_epsilon <= rdp_epsilon < 1.26
    assert pld_epsilon == pytest.approx(0.96, abs=0.01)


def test_steps_per_epoch_take_each_image_once_in_expectation() -> None:
    assert [dp_sgd_steps_per_epoch(q) for q in (1.0, 0.5, 0.1, 0.08, 1 / 3)] == [1, 2, 10, 13, 3]
    with pytest.raises(ValueError, match="sample_rate"):
        dp_sgd_steps_per_epoch(0.0)


@pytest.mark.parametrize("epsilon", [16.0, 4.0, 1.0])
def test_one_budget_for_dp_sgd_and_the_statistics_is_met_by_their_composition(epsilon) -> None:
    budget = split_budget(epsilon, DELTA, 0.5, 0.08, 130, 2)
    recomputed = composed_epsilon(
        DELTA,
        dp_sgd_event(0.08, budget.sgd_noise_multiplier, 130),
        gaussian_releases(budget.stats_noise_multiplier, 2),
    )
    assert budget.epsilon == recomputed
    assert epsilon * (1 - 1e-3) < budget.epsilon <= epsilon  # all of it spent, never more
    # each part alone is cheaper than the whole, and composing beats adding halves
    assert composed_epsilon(DELTA, budget.events()[0]) < epsilon
    assert composed_epsilon(DELTA, budget.events()[1]) < epsilon
    assert budget.stats_noise_multiplier < noise_multiplier_for(epsilon / 2, DELTA, 2)


def test_a_larger_concept_share_gives_dp_sgd_less_noise_and_the_statistics_more() -> None:
    low, high = (
        split_budget(4.0, DELTA, 0.3, 0.08, 130, 2),
        split_budget(4.0, DELTA, 0.7, 0.08, 130, 2),
    )
    assert high.sgd_noise_multiplier < low.sgd_noise_multiplier
    assert high.stats_noise_multiplier > low.stats_noise_multiplier
    with pytest.raises(ValueError, match="sgd_share"):
        split_budget(4.0, DELTA, 1.0, 0.08, 130, 2)
    with pytest.raises(ValueError, match="steps"):
        split_budget(4.0, DELTA, 0.5, 0.08, 0, 2)


# --- DP-SGD: per-image clipping and noise on the tiny model --------------------------------------


def make_concept_problem(ldm):
    """Learn_concepts' loss on 4 random latents of 3 classes, with each image's t and noise, in
    the dtype of ``ldm``'s weights."""
    layout = prompt_layout(
        ldm.tokenizer, "a {S} of a {V}", 1, 1, "sketch", ["circle", "zebra", "star"]
    )
    s0, v0 = (c.to(ldm.dtype) for c in initial_concepts(ldm, layout, "token"))
    g = torch.Generator().manual_seed(0)
    z0 = torch.randn(4, *ldm.latent_shape(16), generator=g, dtype=torch.float64).to(ldm.dtype)
    labels = torch.tensor([0, 1, 2, 1])
    t, noise = (
        torch.randint(1, 1000, (4,), generator=g),
        torch.randn(z0.shape, generator=g, dtype=torch.float64).to(ldm.dtype),
    )
    shifts = [torch.zeros_like(s0), torch.zeros_like(v0)]
    loss = concept_batch_loss(ldm, layout, "token", z0, labels)
    return loss, [s0, v0], shifts, concept_scale(ldm, "token"), t, noise, layout


@pytest.fixture()
def concept_problem(tiny_ldm):
    return make_concept_problem(tiny_ldm)


def clipped_sum(problem, images: list[int], clip: float) -> torch.Tensor:
    """private_gradient's sum over ``images``, two at a time, flat."""
    loss, starts, shifts, scale, t, noise, _ = problem
    batch = torch.tensor(images)
    grads, _ = private_gradient(
        loss, starts, shifts, scale, batch, t[batch], noise[batch], clip, chunk=2
    )
    return torch.cat([g.flatten() for g in grads])


def test_each_images_gradient_is_its_own_as_in_a_batch_of_one(tiny_ldm) -> None:
    """With a clip no gradient reaches, the sum of per-image gradients (chunks of 2, one copy of
    the shifts per image) is the sum of four single-image backward passes.

    In float64: batches of 2 and of 1 take other kernels (other vector widths, blockings and
    sum orders on AVX2 and AVX-512), so in float32 the two differ in the last bits of terms
    that cancel (1.5e-5 relative on one coordinate on AVX2). Each coordinate is a sum over the
    UNet's and text encoder's activations; at float64's 2^-53 = 1.1e-16 per operation, 1e-9
    relative to the largest coordinate leaves 10^7 operations' worth of rounding per output,
    while a gradient mixed between images (what the test is for) moves them by O(1)."""
    problem = make_concept_problem(copy.deepcopy(tiny_ldm).to("cpu", torch.float64))
    loss, starts, shifts, scale, t, noise, _ = problem
    alone = []
    for i in range(4):
        copies = [u.clone().requires_grad_(True) for u in shifts]
        value = loss(
            [c + scale * u for c, u in zip(starts, copies, strict=True)],
            torch.tensor([i]),
            t[i : i + 1],
            noise[i : i + 1],
        )
        alone.append(torch.cat([g.flatten() for g in torch.autograd.grad(value, copies)]))
    summed, expected = clipped_sum(problem, [0, 1, 2, 3], clip=1e6), torch.stack(alone).sum(0)
    assert summed.dtype == torch.float64
    torch.testing.assert_close(summed, expected, rtol=0, atol=1e-9 * expected.abs().max().item())


def test_removing_one_image_moves_the_clipped_sum_by_at_most_the_clip(concept_problem) -> None:
    """Noise off: leaving out one image moves the sum by its clipped gradient, of norm the
    clip (the tiny model's per-image norms are about 1e-3); unclipped, by more."""
    clip = 1e-5
    everyone = clipped_sum(concept_problem, [0, 1, 2, 3], clip)
    for i in (0, 3):  # a class held once and one held twice
        others = [j for j in range(4) if j != i]
        assert (
            everyone - clipped_sum(concept_problem, others, clip)
        ).norm().item() == pytest.approx(clip, rel=1e-3)
        unclipped = clipped_sum(concept_problem, [i], clip=1e6).norm().item()
        assert unclipped > 10 * clip, "without the clip one image would move it further"


def test_dp_sgd_noise_has_std_sigma_times_clip_on_the_trainable_coordinates(
    concept_problem,
) -> None:
    """An empty Poisson sample: the gradient is the noise alone. V's rows past a class's tokens
    (zebra spells 5 tokens here, circle and star 1) get none."""
    loss, starts, shifts, scale, t, noise, layout = concept_problem
    empty = torch.tensor([], dtype=torch.int64)
    zero, loss_sum = private_gradient(
        loss, starts, shifts, scale, empty, t[empty], noise[empty], 0.5, 2
    )
    assert loss_sum == 0 and all(not g.any() for g in zero)
    privacy = DPSGD(
        0.1, 10, noise_multiplier=1.5, clip=0.5, trainable=(None, layout.v_mask.unsqueeze(-1))
    )
    generator = torch.Generator().manual_seed(0)
    draws = [add_gradient_noise(zero, privacy, generator) for _ in range(200)]
    s_noise = torch.stack([d[0] for d in draws])
    v_noise = torch.stack([d[1] for d in draws])
    used = layout.v_mask.unsqueeze(-1).expand_as(v_noise[0])
    # 200 x 18 x 32 = 115,200 draws of S and V's used rows: std within 1.5 % is 7 standard errors
    both = torch.cat([s_noise.flatten(), v_noise[:, used].flatten()])
    assert both.std().item() == pytest.approx(1.5 * 0.5, rel=0.015)
    assert both.mean().abs().item() < 0.02
    assert not v_noise[:, ~used].any()

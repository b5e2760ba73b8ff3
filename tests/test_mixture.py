"""Per-class diagonal Gaussian mixtures over z(T): fitting, padding, drawing, the upload's
tensors and their validation.

Statistical tolerances are 5 standard errors of the estimate at the test's sample size: a
correct implementation exceeds one with probability about 6e-7 per comparison (a few dozen
comparisons per test), while a wrong parameterisation (standard deviation for variance,
uniform component choice, swapped weights) misses by many standard errors. Every draw is
seeded, so the outcome is also fixed from run to run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import safetensors.torch
import torch

from fedbip_flwr.mixture import (
    MIXTURE_TENSOR_NAMES,
    LatentMixture,
    check_mixture,
    draw,
    fit_mixture,
    from_tensors,
)

LATENT = (2, 2, 2)  # D = 8: small enough for thousands of rows in milliseconds
D = math.prod(LATENT)
SIGMAS = 5.0


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def known_mixture_rows(n: int, weights: tuple[float, float], seed: int) -> tuple[torch.Tensor, ...]:
    """n rows of a 2-component diagonal mixture: means -3 and +3 in every dimension (so a row's
    component is never in doubt), variances from 0.25 to 2 across dimensions, reversed in the
    second component."""
    g = generator(seed)
    means = torch.stack([torch.full((D,), -3.0), torch.full((D,), 3.0)])
    variances = torch.stack([torch.linspace(0.25, 2.0, D), torch.linspace(2.0, 0.25, D)])
    component = (torch.rand(n, generator=g) >= weights[0]).long()
    rows = means[component] + variances[component].sqrt() * torch.randn(n, D, generator=g)
    return rows.reshape(n, *LATENT), means, variances


def class_rows(
    per_class: list[int], spacing: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit-variance rows around class c's centre c * spacing (every dimension)."""
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate(per_class)])
    noise = torch.randn(len(labels), *LATENT, generator=generator(seed))
    return labels.float().mul(spacing).view(-1, 1, 1, 1) + noise, labels


def test_fit_recovers_a_known_two_component_mixture():
    n, weights = 4000, (0.3, 0.7)
    rows, means, variances = known_mixture_rows(n, weights, seed=0)
    fitted = fit_mixture(rows, torch.zeros(n, dtype=torch.long), 1, 2, generator(0))
    order = fitted.means[0, :, 0].argsort()  # the component near -3 first, as in `means`
    for k, w in enumerate(weights):
        rows_k = n * w
        got_w, got_m, got_v = (
            fitted.weights[0, order[k]],
            fitted.means[0, order[k]],
            fitted.variances[0, order[k]],
        )
        assert abs(got_w - w) < SIGMAS * math.sqrt(w * (1 - w) / n)
        torch.testing.assert_close(
            got_m, means[k], rtol=0, atol=SIGMAS * (variances[k] / rows_k).sqrt().max().item()
        )
        # a sample variance's standard error is variance * sqrt(2 / (rows - 1))
        assert (
            (got_v - variances[k]).abs() < SIGMAS * variances[k] * math.sqrt(2 / (rows_k - 1))
        ).all()


def test_one_mixture_per_class_of_fixed_shape():
    rows, labels = class_rows([12, 12, 12], spacing=10.0, seed=0)
    mixture = fit_mixture(rows, labels, 3, 4, generator(0))
    assert (mixture.num_classes, mixture.components, mixture.latent_shape) == (3, 4, LATENT)
    assert mixture.weights.shape == (3, 4)
    assert mixture.means.shape == mixture.variances.shape == (3, 4, D)
    assert {t.dtype for t in mixture.to_tensors().values()} == {torch.float32}
    torch.testing.assert_close(mixture.weights.sum(dim=1), torch.ones(3))
    assert (mixture.variances > 0).all()
    check_mixture(mixture)


def test_a_class_with_fewer_rows_than_components_is_padded():
    rows, labels = class_rows([2, 10], spacing=10.0, seed=1)
    mixture = fit_mixture(rows, labels, 2, 4, generator(0))
    weights = mixture.weights[0]
    assert weights.shape == (4,) and int((weights == 0).sum()) == 2
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0))
    real, padded = weights > 0, weights == 0
    # two rows, two components: each component is one row, whichever way round
    own = rows[labels == 0].reshape(2, D)
    got = mixture.means[0, real]
    assert torch.allclose(got, own) or torch.allclose(got, own.flip(0))
    for pad in mixture.means[0, padded]:
        assert any(torch.equal(pad, m) for m in got)
    assert (mixture.variances[0] > 0).all()
    check_mixture(mixture)


@pytest.mark.parametrize("rows_of_class_1", [1])
def test_a_class_too_small_to_fit_is_refused_by_index(rows_of_class_1: int):
    rows, labels = class_rows([5, rows_of_class_1, 5], spacing=10.0, seed=0)
    with pytest.raises(ValueError, match=f"class 1 has {rows_of_class_1} row"):
        fit_mixture(rows, labels, 3, 2, generator(0))


def test_an_absent_class_gets_the_placeholder_and_few_rows_get_few_components():
    rows, labels = class_rows([12, 5], spacing=10.0, seed=0)
    mixture = fit_mixture(rows, labels, 3, 4, generator(0), rows_per_component=4)
    assert mixture.weights[2].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert torch.equal(mixture.means[2, 0], torch.zeros(D)) and torch.equal(
        mixture.variances[2, 0], torch.ones(D)
    )
    assert int((mixture.weights[0] > 0).sum()) <= 3, "12 rows, 4 per component: at most 3"
    assert int((mixture.weights[1] > 0).sum()) == 1, "5 rows, 4 per component: one"
    check_mixture(mixture)


def test_draws_follow_their_labels():
    rows, labels = class_rows([10, 10, 10], spacing=20.0, seed=2)
    mixture = fit_mixture(rows, labels, 3, 2, generator(0))
    wanted = torch.tensor([2, 0, 0, 1, 2, 2, 1, 0, 1] * 4)  # no palindrome: order matters
    z = draw(mixture, wanted, generator(1))
    assert z.shape == (len(wanted), *LATENT) and z.dtype == torch.float32
    # Classes 20 apart, unit spread: a draw's nearest class centre is its class's.
    centres = torch.stack([rows[labels == c].mean(0).flatten() for c in range(3)])
    assert torch.equal(torch.cdist(z.flatten(1), centres).argmin(1), wanted)


def test_many_draws_have_the_fitted_mean_and_variance():
    rows, _, _ = known_mixture_rows(400, (0.25, 0.75), seed=3)
    mixture = fit_mixture(rows, torch.zeros(400, dtype=torch.long), 1, 2, generator(0))
    w, m, v = (t[0].double() for t in (mixture.weights, mixture.means, mixture.variances))
    w = w[:, None]
    mean = (w * m).sum(0)
    offset = m - mean
    variance = (w * (v + offset**2)).sum(0)
    fourth = (w * (offset**4 + 6 * offset**2 * v + 3 * v**2)).sum(0)  # central 4th moment
    n = 20000
    z = draw(mixture, torch.zeros(n, dtype=torch.long), generator(1)).flatten(1).double()
    assert ((z.mean(0) - mean).abs() < SIGMAS * (variance / n).sqrt()).all()
    # a sample variance's standard error is sqrt((mu4 - sigma^4) / n)
    assert ((z.var(0) - variance).abs() < SIGMAS * ((fourth - variance**2) / n).sqrt()).all()


def test_the_generators_alone_decide_fit_and_draws():
    # An isotropic blob has no clusters to find, so where k-means starts decides the fit.
    rows = torch.randn(40, *LATENT, generator=generator(4))
    labels = torch.zeros(40, dtype=torch.long)

    def fit(seed: int, global_seed: int) -> LatentMixture:
        torch.manual_seed(global_seed)  # torch's global RNG must play no part
        return fit_mixture(rows, labels, 1, 4, generator(seed))

    first, again, other = fit(0, global_seed=1), fit(0, global_seed=2), fit(1, global_seed=1)
    assert all(
        torch.equal(a, b) for a, b in zip(first.to_tensors().values(), again.to_tensors().values())
    )
    assert not torch.equal(first.means, other.means)

    def draws(seed: int, global_seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)
        return draw(first, torch.zeros(16, dtype=torch.long), generator(seed))

    assert torch.equal(draws(5, global_seed=1), draws(5, global_seed=2))
    assert not torch.equal(draws(5, global_seed=1), draws(6, global_seed=1))


def test_the_tensors_round_trip_through_safetensors():
    rows, labels = class_rows([6, 3], spacing=10.0, seed=5)
    mixture = fit_mixture(rows, labels, 2, 4, generator(0))
    tensors = safetensors.torch.load(safetensors.torch.save(mixture.to_tensors()))
    assert set(tensors) == set(MIXTURE_TENSOR_NAMES)
    back = from_tensors(tensors, LATENT)
    assert back.latent_shape == LATENT
    assert all(
        torch.equal(a, b) for a, b in zip(mixture.to_tensors().values(), back.to_tensors().values())
    )


def valid_mixture() -> LatentMixture:
    """Two classes of two components; the second class has one real component and one padded."""
    return LatentMixture(
        weights=torch.tensor([[0.25, 0.75], [1.0, 0.0]]),
        means=torch.zeros(2, 2, D),
        variances=torch.ones(2, 2, D),
        latent_shape=LATENT,
    )


def first_set(field: str, value: float) -> Callable[[LatentMixture], LatentMixture]:
    """The mixture with the first element of ``field`` replaced by ``value``."""

    def alter(mixture: LatentMixture) -> LatentMixture:
        tensor = getattr(mixture, field).clone()
        tensor.view(-1)[0] = value
        return dataclasses.replace(mixture, **{field: tensor})

    return alter


# case -> (how a valid mixture is spoiled, what the refusal must say)
BAD_MIXTURES: dict[str, tuple[Callable[[LatentMixture], LatentMixture], str]] = {
    "NaN mean": (first_set("means", math.nan), "NaN or infinite"),
    "infinite variance": (first_set("variances", math.inf), "NaN or infinite"),
    "negative variance": (first_set("variances", -1.0), "variance <= 0"),
    "zero variance": (first_set("variances", 0.0), "variance <= 0"),
    "weights summing to 0.9": (
        lambda m: dataclasses.replace(m, weights=m.weights * 0.9),
        "sum to 1",
    ),
    "a negative weight, sum still 1": (
        lambda m: dataclasses.replace(m, weights=torch.tensor([[1.25, -0.25], [1.0, 0.0]])),
        "negative",
    ),
    "float64 weights": (lambda m: dataclasses.replace(m, weights=m.weights.double()), "float64"),
    "means for another latent shape": (
        lambda m: dataclasses.replace(m, latent_shape=(2, 2, 3)),
        "shape",
    ),
    "weights for another component count": (
        lambda m: dataclasses.replace(m, weights=m.weights[:, :1]),
        "shape",
    ),
    "one-dimensional weights": (lambda m: dataclasses.replace(m, weights=m.weights[0]), "shape"),
}


def test_the_valid_mixture_passes():
    check_mixture(valid_mixture())


@pytest.mark.parametrize("case", list(BAD_MIXTURES))
def test_check_mixture_refuses(case: str):
    spoil, reason = BAD_MIXTURES[case]
    with pytest.raises(ValueError, match=reason):
        check_mixture(spoil(valid_mixture()))


def test_from_tensors_refuses_a_bad_or_incomplete_upload():
    tensors = valid_mixture().to_tensors()
    with pytest.raises(ValueError, match="shape"):
        from_tensors(tensors, (4, 2, 2))  # the receiver's latents are of another size
    with pytest.raises(ValueError, match="lacks tensor"):
        from_tensors({k: v for k, v in tensors.items() if k != MIXTURE_TENSOR_NAMES[1]}, LATENT)
    tensors[MIXTURE_TENSOR_NAMES[2]][0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        from_tensors(tensors, LATENT)

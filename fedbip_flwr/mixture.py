"""Per-class Gaussian mixtures over z(T): an upload that holds no per-image latent.

A client forward-noises mixed same-class latents to timestep T (several times, fresh noise
each time) and fits, per class, a diagonal-covariance Gaussian mixture to those rows; the
server draws z(T) from the mixtures and denoises them. Diagonal covariances keep the fit
well-posed where a class has a few dozen rows in D = c*h*w dimensions (1024 for the miniature
LDM's 4x16x16 latents, 16384 for Stable Diffusion's 4x64x64): a full covariance would need more
rows than dimensions. The upload is three float32 tensors (:meth:`LatentMixture.to_tensors`),
every class padded to the same number of components so their shapes are fixed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

# Tensor names of the upload (safetensors keys).
MIXTURE_WEIGHTS = "mixture_weights"
MIXTURE_MEANS = "mixture_means"
MIXTURE_VARIANCES = "mixture_variances"
MIXTURE_TENSOR_NAMES = (MIXTURE_WEIGHTS, MIXTURE_MEANS, MIXTURE_VARIANCES)

# Added to every fitted variance. With a few rows per component in hundreds to thousands of
# dimensions, EM can shrink a component onto its rows (a component that owns one row has
# variance exactly 0 and infinite likelihood); the floor keeps every variance positive and
# the fit finite. z(T) has a per-dimension variance near 1 at large T (the forward process
# adds 1 - alpha_bar(T) of unit noise), so 1e-3 is negligible beside any component fitted to
# two or more distinct rows.
DEFAULT_REG_COVAR = 1e-3
# float32 rounding of M weights moves their sum by about M * 2**-24: far below this for any
# M up to hundreds, while a payload whose weights do not form a distribution is far above it.
WEIGHT_SUM_TOLERANCE = 1e-5
# GaussianMixture estimates a variance from the spread of a component's rows: one row has none.
MIN_ROWS_PER_CLASS = 2
# sklearn's random_state is a 32-bit seed.
_SEED_BOUND = 2**31 - 1


@dataclass(frozen=True)
class LatentMixture:
    """C classes' mixtures of M diagonal Gaussians over flattened latents of ``latent_shape``.

    ``weights`` (C, M), each row a distribution; ``means`` and ``variances`` (C, M, D) with
    D = c*h*w; all float32. A component of weight 0 is padding (never drawn).
    """

    weights: torch.Tensor
    means: torch.Tensor
    variances: torch.Tensor
    latent_shape: tuple[int, int, int]

    @property
    def num_classes(self) -> int:
        return self.weights.shape[0]

    @property
    def components(self) -> int:
        return self.weights.shape[1]

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The three tensors under fixed names, for ``safetensors.torch.save``."""
        return {
            MIXTURE_WEIGHTS: self.weights.contiguous(),
            MIXTURE_MEANS: self.means.contiguous(),
            MIXTURE_VARIANCES: self.variances.contiguous(),
        }


def from_tensors(
    tensors: Mapping[str, torch.Tensor], latent_shape: tuple[int, int, int]
) -> LatentMixture:
    """The mixture in an upload's tensors, checked (:func:`check_mixture`): they are untrusted.

    ``latent_shape`` is the receiver's own (its base model's), so an upload made for another
    latent size is refused rather than reshaped.
    """
    missing = [name for name in MIXTURE_TENSOR_NAMES if name not in tensors]
    if missing:
        raise ValueError(f"the mixture lacks tensor(s) {', '.join(missing)}.")
    mixture = LatentMixture(
        weights=tensors[MIXTURE_WEIGHTS],
        means=tensors[MIXTURE_MEANS],
        variances=tensors[MIXTURE_VARIANCES],
        latent_shape=tuple(latent_shape),
    )
    check_mixture(mixture)
    return mixture


def check_mixture(mixture: LatentMixture) -> None:
    """Refuse a mixture no client could have fitted, with a one-sentence reason (ValueError).

    Shapes first, so the value checks below can index without failing on their own.
    """
    _check_shapes(mixture)
    tensors = mixture.to_tensors()
    for name, tensor in tensors.items():
        if tensor.dtype != torch.float32:
            raise ValueError(f"{name} is {tensor.dtype}, not torch.float32.")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{name} holds NaN or infinite values.")
    if (mixture.weights < 0).any():
        raise ValueError(f"{MIXTURE_WEIGHTS} holds negative weights.")
    error = (mixture.weights.double().sum(dim=1) - 1.0).abs().max().item()
    if error > WEIGHT_SUM_TOLERANCE:
        raise ValueError(
            f"a class's {MIXTURE_WEIGHTS} sum to 1 +- {error:.3g}, beyond {WEIGHT_SUM_TOLERANCE}."
        )
    if (mixture.variances <= 0).any():
        raise ValueError(f"{MIXTURE_VARIANCES} holds a variance <= 0.")


def _check_shapes(mixture: LatentMixture) -> None:
    shape = mixture.latent_shape
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"latent shape {shape} is not three positive sizes (c, h, w).")
    if mixture.weights.ndim != 2 or min(mixture.weights.shape) < 1:
        raise ValueError(
            f"{MIXTURE_WEIGHTS} has shape {tuple(mixture.weights.shape)}, not (classes, components)."
        )
    expected = (*mixture.weights.shape, math.prod(shape))
    for name, tensor in ((MIXTURE_MEANS, mixture.means), (MIXTURE_VARIANCES, mixture.variances)):
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, not {expected} for latents of shape {shape}."
            )


def fit_mixture(
    z_t: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    components: int,
    generator: torch.Generator,
    reg_covar: float = DEFAULT_REG_COVAR,
    rows_per_component: int = 1,
) -> LatentMixture:
    """Fit one ``components``-Gaussian diagonal mixture per class to the rows ``z_t`` (N, c, h, w).

    A class with fewer rows than ``components`` gets one component per row, padded to
    ``components``. Each class's EM initialisation (k-means) is seeded from ``generator``, so
    the client's own randomness decides it. A class with fewer than 2 rows raises ValueError
    naming it: whether to drop the class or gather more rows is the caller's decision. A class
    with no rows (one the client lacks) gets the placeholder N(0, I) in its first component:
    the upload's class counts say it is absent, and nothing is drawn from it.
    ``rows_per_component``: a class gets at most one component per that many rows, so no
    component is fitted to a handful of rows (its mean would nearly be one private z(T)).
    ``reg_covar``: see :data:`DEFAULT_REG_COVAR`.
    """
    _check_fit_inputs(z_t, labels, num_classes, components)
    rows = z_t.detach().reshape(len(z_t), -1).cpu().double().numpy()
    labels = labels.cpu().long()
    seeds = torch.randint(_SEED_BOUND, (num_classes,), generator=generator).tolist()
    fits = [
        _fit_class(rows[(labels == c).numpy()], components, seeds[c], reg_covar, rows_per_component)
        for c in range(num_classes)
    ]
    weights, means, variances = (torch.from_numpy(np.stack(part)).float() for part in zip(*fits))
    return LatentMixture(
        # sklearn's weights sum to 1 in float64; renormalised, they do in float32 too
        weights=weights / weights.sum(dim=1, keepdim=True),
        means=means,
        variances=variances,
        latent_shape=tuple(z_t.shape[1:]),
    )


def _check_fit_inputs(
    z_t: torch.Tensor, labels: torch.Tensor, num_classes: int, components: int
) -> None:
    if z_t.ndim != 4:
        raise ValueError(f"z_t has shape {tuple(z_t.shape)}, not (N, c, h, w).")
    if labels.shape != (len(z_t),):
        raise ValueError(f"labels have shape {tuple(labels.shape)}, not ({len(z_t)},).")
    if min(num_classes, components) < 1:
        raise ValueError(
            f"num_classes {num_classes} and components {components} must both be at least 1."
        )
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}).")
    counts = torch.bincount(labels.cpu().long(), minlength=num_classes)
    for c, count in enumerate(counts.tolist()):
        if 0 < count < MIN_ROWS_PER_CLASS:
            raise ValueError(
                f"class {c} has {count} row(s); a mixture needs at least {MIN_ROWS_PER_CLASS}."
            )


def _fit_class(
    rows: np.ndarray, components: int, seed: int, reg_covar: float, rows_per_component: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights, means, variances) of one class, padded to ``components``."""
    from sklearn.mixture import GaussianMixture

    if not len(rows):
        dim = rows.shape[1]
        return _pad(np.ones(1), np.zeros((1, dim)), np.ones((1, dim)), components)
    fitted = GaussianMixture(
        n_components=max(1, min(components, len(rows) // rows_per_component)),
        covariance_type="diag",
        reg_covar=reg_covar,
        random_state=seed,
    ).fit(rows)
    return _pad(fitted.weights_, fitted.means_, fitted.covariances_, components)


def _pad(
    weights: np.ndarray, means: np.ndarray, variances: np.ndarray, components: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weight-0 components copying the first real one: never drawn, yet valid values, so the
    upload's shape is fixed and :func:`check_mixture` needs no special case for padding."""
    pad = components - len(weights)
    return (
        np.concatenate([weights, np.zeros(pad)]),
        np.concatenate([means, np.repeat(means[:1], pad, axis=0)]),
        np.concatenate([variances, np.repeat(variances[:1], pad, axis=0)]),
    )


def draw(mixture: LatentMixture, labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One z(T) per label, (N, c, h, w): a component by its weight, then its Gaussian.

    All randomness comes from ``generator`` (component choice first, then the noise), so the
    server's draws follow from its seed. It is a CPU generator: the mixture lives on the CPU,
    and CPU draws are the same on every machine; move the result to the device afterwards.
    """
    if labels.ndim != 1:
        raise ValueError(f"labels have shape {tuple(labels.shape)}, not (N,).")
    if len(labels) and (labels.min() < 0 or labels.max() >= mixture.num_classes):
        raise ValueError(f"labels must lie in [0, {mixture.num_classes}).")
    labels = labels.cpu().long()
    chosen = torch.multinomial(mixture.weights[labels], 1, generator=generator).squeeze(1)
    means, variances = mixture.means[labels, chosen], mixture.variances[labels, chosen]
    noise = torch.randn(means.shape, generator=generator, dtype=means.dtype)
    return (means + variances.sqrt() * noise).reshape(len(labels), *mixture.latent_shape)

"""FedBiP's upload contract: what its one safetensors blob holds, and its strict validation.

A client sends ``{z_i(T), y_i}`` for all local images plus the learned concepts ``S`` and ``V``
exactly once. The server treats those bytes as untrusted network input, so they are:

* safetensors only: loading it cannot execute code (unlike pickle / ``torch.load``);
* size-capped before anything is parsed, with the header length checked against our own limit
  before safetensors sees it;
* schema-checked (tensor names, dtypes, byte layout, metadata, shapes, finiteness, labels) and,
  when the server passes :class:`Expectations`, checked against the server's base model and run
  config, and for plausibility: z(T) must look like what the forward process makes at T, and
  every concept vector must be of the concept space's scale (:class:`Plausibility`).

Every rejection is a :class:`PayloadError` whose message says what is wrong and what to change;
no other exception escapes :func:`decode_payload`, whatever the bytes. See ``docs/payload.md``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from fedbip_flwr.config import CONCEPT_SLOT_S, CONCEPT_SLOT_V
from fedbip_flwr.method_settings import MAX_CLASS_CLUSTERS
from fedbip_flwr.shared_concepts import Concepts, check_concept_rows
from fedbip_flwr.upload import (
    DEFAULT_MAX_BYTES,
    Check,
    PayloadError,
    UploadMeta,
    check_dtype,
    check_finite,
    check_index,
    check_schema_version,
    check_shape,
    encode_tensors,
    meta_strings,
    meta_value,
    parse_meta,
    read_capped,
    read_tensors,
    refuse_mismatch,
)

TENSOR_NAMES = ("latents", "labels", "domain_concept", "class_concepts")
# With class_clusters > 1, each z(T)'s sub-cluster: which of its class's concepts it is denoised with.
CLUSTER_TENSOR = "latent_clusters"

_LATENT_DTYPES = {"float32": torch.float32, "float16": torch.float16}
_FIXED_DTYPES = {
    "labels": torch.int64,
    "domain_concept": torch.float32,
    "class_concepts": torch.float32,
    CLUSTER_TENSOR: torch.int64,
}


class PayloadMeta(UploadMeta):
    """Everything the server needs to denoise a client's z(T) exactly as the client meant."""

    method: Literal["fedbip"] = "fedbip"
    timestep: int = Field(ge=0)
    scheduler: str = Field(min_length=1)
    num_inference_steps: int = Field(ge=1)
    n_s: int = Field(ge=1)
    n_v: int = Field(ge=1)
    concept_space: Literal["token", "hidden"]
    prompt_template: str
    base_model: str = Field(min_length=1)
    latent_shape: list[int] = Field(min_length=3, max_length=3)
    latent_dtype: Literal["float32", "float16"]
    class_clusters: int = Field(1, ge=1, le=MAX_CLASS_CLUSTERS)  # run config class-clusters

    @property
    def concept_names(self) -> list[str]:
        """The class each row of V is a concept of: class-major, class_clusters rows each."""
        return self.per_concept(self.class_names)

    def per_concept(self, per_class: Sequence[Any]) -> list[Any]:
        """A per-class list repeated for each of the class's rows of V (class-major)."""
        return [value for value in per_class for _ in range(self.class_clusters)]

    def tensor_names(self) -> tuple[str, ...]:
        """Exactly the tensors a payload with this metadata holds."""
        return (*TENSOR_NAMES, CLUSTER_TENSOR) if self.class_clusters > 1 else TENSOR_NAMES

    @model_validator(mode="after")
    def _check_fields(self) -> PayloadMeta:
        for slot in (CONCEPT_SLOT_S, CONCEPT_SLOT_V):
            if self.prompt_template.count(slot) != 1:
                raise ValueError(f"prompt_template must contain {slot} exactly once")
        if any(size < 1 for size in self.latent_shape):
            raise ValueError("latent_shape entries must be >= 1")
        return self


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors with == is not a bool
class Payload:
    """One client's upload. Clients build it; :func:`decode_payload` returns it validated, on CPU."""

    latents: torch.Tensor  # z(T): (N, C, H, W), dtype per meta.latent_dtype
    labels: torch.Tensor  # (N,) int64 in [0, len(class_names))
    domain_concept: torch.Tensor  # S: (n_s, d) float32
    class_concepts: torch.Tensor  # V: (len(class_names) x class_clusters, n_v, d) float32
    meta: PayloadMeta
    latent_clusters: torch.Tensor | None = None  # (N,) int64 in [0, class_clusters) when > 1

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors under their file names (:meth:`PayloadMeta.tensor_names`)."""
        return {name: getattr(self, name) for name in self.meta.tensor_names()}

    @property
    def concepts(self) -> Concepts:
        """S and V with what places them in the prompt: what synthesis conditions on."""
        return Concepts(
            domain=self.domain_concept,
            classes=self.class_concepts,
            template=self.meta.prompt_template,
            domain_phrase=self.meta.domain,
            concept_names=tuple(self.meta.concept_names),
            space=self.meta.concept_space,
            owner=self.meta.client_id,
        )

    @property
    def concept_rows(self) -> torch.Tensor:
        """(N,) the row of V each z(T) is denoised with: its label's, its sub-cluster's."""
        if self.latent_clusters is None:
            return self.labels
        return self.labels * self.meta.class_clusters + self.latent_clusters


@dataclass(frozen=True)
class Expectations:
    """What the server's run config and loaded base model demand of every payload."""

    max_bytes: int
    base_model: str
    latent_shape: tuple[int, int, int]
    concept_dim: int
    timestep: int
    num_inference_steps: int
    scheduler: str
    n_s: int  # run config data.n-s / data.n-v: the fewest vectors per concept
    n_v: int
    concept_space: str
    class_names: tuple[str, ...]
    prompt_template: str
    # the server evaluates on these, any other has no test set; () = any (imagefolder: every
    # institution names its own domain)
    domains: tuple[str, ...]
    # Tokens of a phrase (domain or class name) under the server's tokenizer: a concept has
    # max(n, tokens) vectors (fedbip_flwr.concepts.concept_slots). None: n is the size.
    phrase_tokens: Callable[[str], int] | None = None
    # The prompt layout synthesis rebuilds from a payload (fedbip_flwr.concepts.prompt_layout
    # on the server's tokenizer, with (template, n_s, n_v, domain, concept names)): acceptance
    # builds it too, so a payload whose prompts the text encoder cannot take is refused here,
    # not when synthesis starts. None: not checked (no tokenizer at hand).
    layout: Callable[[str, int, int, str, Sequence[str]], Any] | None = None
    # What honest numbers look like under the server's model; None: structure checks only.
    plausibility: Plausibility | None = None
    class_clusters: int = 1  # run config class-clusters: class concepts per class

    def concept_sizes(self, domain: str) -> tuple[int, list[int]]:
        """Vectors of S for ``domain`` and of each V_y, as the clients' prompt layout has them."""
        count = self.phrase_tokens or (lambda _phrase: 0)
        return (
            max(self.n_s, count(domain)),
            [max(self.n_v, count(name)) for name in self.class_names],
        )


# How far an honest upload's statistics can lie from the method's, in docs/payload.md
# "Plausibility". L bounds a scaled VAE latent's per-image RMS: the VAE's scaling factor makes
# latents about unit variance, and the largest measured was 1.37 (the miniature model, a
# saturated image; real shapes images <= 1.26; the tiny test model's random VAE <= 0.07).
LATENT_RMS = 4.0
# M bounds one coordinate of a scaled VAE latent: the largest |value| measured was 7.93 (the
# miniature's 1,500 shapes test images of all five domains; saturated and noise images <= 5.3).
LATENT_MAX = 16.0
# Standard deviations of the noise an honest z(T) may be off by. With k = 8 an honest image is
# refused with probability below 3e-14, at any latent size (see latent_bounds).
SIGMAS = 8.0
# No used concept vector is smaller than 1/F of the concept space's coordinate scale s: measured,
# the smallest embedding-table row is 0.57 s and the smallest learned concept 1.0 s.
CONCEPT_FLOOR = 10.0
# float16 storage rounds each latent by at most 2**-11 of itself; float32 arithmetic far less.
ROUNDING = 1e-3


def adam_step_bound(beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The most one Adam step moves a coordinate, in units of lr (7.27 for learn_concepts'
    betas): |m_t| <= (1 - b1) sqrt(sum (b1^2 / b2)^i) sqrt(v_t / (1 - b2)) by Cauchy-Schwarz,
    and the bias corrections only shrink the ratio."""
    return (1 - beta1) / math.sqrt(1 - beta2) / math.sqrt(1 - beta1 * beta1 / beta2)


@dataclass(frozen=True)
class Plausibility:
    """What the server's model and run config say an honest upload's numbers look like.

    ``alpha_bar``: the scheduler's alphas_cumprod at the payload's T. ``concept_scale``: s,
    :func:`fedbip_flwr.concepts.concept_scale` in the run's concept space. A concept starts at
    most ``concept_init_rms`` s large and each optimizer step moves each coordinate by at most
    ``concept_step`` s (lr times :func:`adam_step_bound`); ``concept_epochs``,
    ``concept_batch_size`` and ``latents_per_image`` (the run config's) give the step count,
    unless ``concept_steps`` states it (a DP upload's DP-SGD, whose steps the server checked).
    """

    alpha_bar: float
    concept_scale: float
    concept_init_rms: float
    concept_step: float
    concept_epochs: int
    concept_batch_size: int
    latents_per_image: int
    latent_rms: float = LATENT_RMS
    sigmas: float = SIGMAS
    concept_floor: float = CONCEPT_FLOOR
    concept_steps: int | None = None

    def concept_range(self, num_examples: int) -> tuple[float, float]:
        """Allowed RMS of a used concept vector: [s / floor, s (init + step x steps)], the
        steps those of learn_concepts over the client's images."""
        images = -(-num_examples // self.latents_per_image)
        steps = self.concept_steps or self.concept_epochs * -(-images // self.concept_batch_size)
        ceiling = self.concept_init_rms + self.concept_step * steps
        s = self.concept_scale
        return s / self.concept_floor * (1 - ROUNDING), s * ceiling * (1 + ROUNDING)


@dataclass(frozen=True)
class LatentBounds:
    """Per-image moments an honest z(T) of ``size`` elements has (with probability ~1)."""

    abs_mean: float
    std_low: float
    std_high: float


def latent_bounds(
    alpha_bar: float, size: int, latent_rms: float = LATENT_RMS, sigmas: float = SIGMAS
) -> LatentBounds:
    """Bounds on one image's mean and std of z = a zbar + b eps (a^2 = abar_T, b^2 = 1 - a^2).

    zbar interpolates two scaled latents, so RMS(zbar) <= L; eps ~ N(0, I_D) is independent
    of zbar. Over the D elements, with m() the mean and s() the population std:

    * m(z) = a m(zbar) + b m(eps), m(eps) ~ N(0, 1/D): |m(z)| <= a L + k b / sqrt(D).
    * s(z)^2 = a^2 s(zbar)^2 + b^2 s(eps)^2 + 2ab c, with c = mean((zbar - m(zbar)) eps)
      ~ N(0, s(zbar)^2 / D) given zbar, so |c| <= k s(zbar) / sqrt(D); D RMS(eps)^2 is
      chi2(D), D s(eps)^2 chi2(D - 1), bounded by Laurent-Massart with x = k^2 / 2.
      Upper: a^2 L^2 + 2ab k L / sqrt(D) + b^2 RMS(eps)^2. Lower: the larger of the
      quadratic in s(zbar) minimised over [0, L] and the triangle bound b s(eps) - a L.

    Each of the four tail events has probability <= max(P(|N(0,1)| > k), e^(-k^2/2)), so
    an honest image fails with probability <= 2 erfc(k / sqrt 2) + 2 e^(-k^2/2) (< 3e-14
    for k = 8), whatever D.
    """
    a, b = math.sqrt(alpha_bar), math.sqrt(max(0.0, 1.0 - alpha_bar))
    d, k, lat = float(size), sigmas, latent_rms
    x = k * k / 2
    rms_high = (d + 2 * math.sqrt(d * x) + 2 * x) / d  # bound on RMS(eps)^2
    std_low = max(0.0, (d - 1 - 2 * math.sqrt((d - 1) * x)) / d)  # bound on s(eps)^2
    cross = k / math.sqrt(d)
    var_high = a * a * lat * lat + 2 * a * b * cross * lat + b * b * rms_high
    y = min(lat, b * cross / a) if a > 0 else 0.0  # s(zbar) minimising the quadratic
    var_low = b * b * std_low + a * a * y * y - 2 * a * b * cross * y
    low = max(math.sqrt(max(0.0, var_low)), b * math.sqrt(std_low) - a * lat, 0.0)
    return LatentBounds(
        abs_mean=(a * lat + k * b / math.sqrt(d)) * (1 + ROUNDING) + ROUNDING * math.sqrt(var_high),
        std_low=low * (1 - ROUNDING),
        std_high=math.sqrt(var_high) * (1 + ROUNDING),
    )


def coordinate_bound(
    alpha_bar: float, size: int, sigmas: float = SIGMAS, latent_max: float = LATENT_MAX
) -> float:
    """The largest |value| one coordinate of an honest z(T) = a zbar + b eps of ``size``
    elements has: |zbar_j| <= M (a convex mix of two latents), and the largest of the image's
    ``size`` |eps_j| stays below k' = sqrt(2 ln(2 size / p)) but with probability p, p the same
    2 erfc(k / sqrt 2) + 2 e^(-k^2 / 2) the moment bounds allow (about 9.1 at SD's 16,384)."""
    a, b = math.sqrt(alpha_bar), math.sqrt(max(0.0, 1.0 - alpha_bar))
    p = 2 * math.erfc(sigmas / math.sqrt(2)) + 2 * math.exp(-sigmas * sigmas / 2)
    return (a * latent_max + b * math.sqrt(2 * math.log(2 * size / p))) * (1 + ROUNDING)


# --- encoding ---------------------------------------------------------------------------------


def encode_payload(p: Payload) -> bytes:
    """Serialize ``p`` to safetensors bytes, refusing a payload the server would reject anyway."""
    check_payload(p)
    return encode_tensors(p.tensors(), meta_strings(p.meta))


# --- decoding ---------------------------------------------------------------------------------


def load_payload(
    path: str | os.PathLike[str],
    expect: Expectations | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Payload:
    """Decode a payload file, checking its size before reading it into memory.

    I/O failures (missing file, permissions) raise ``OSError``; bad content raises
    :class:`PayloadError`. The cap is ``expect.max_bytes`` when given, else ``max_bytes``.
    """
    limit = expect.max_bytes if expect is not None else max_bytes
    return decode_payload(read_capped(path, limit), expect, max_bytes=limit)


def decode_payload(
    blob: bytes, expect: Expectations | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> Payload:
    """Parse and validate untrusted bytes; raise :class:`PayloadError` and nothing else.

    The cap is ``expect.max_bytes`` when expectations are given, else ``max_bytes``.
    """
    limit = expect.max_bytes if expect is not None else max_bytes
    tensors, metadata = read_tensors(blob, payload_tensor_names, limit, "fedbip")
    meta = parse_meta(metadata, PayloadMeta)
    payload = Payload(**tensors, meta=meta)
    check_payload(payload)
    if expect is not None:
        check_expectations(payload, expect)
    return payload


def payload_tensor_names(metadata: dict[str, str]) -> tuple[str, ...]:
    """The tensors a FedBiP payload must hold, as its metadata's class_clusters says (a bad
    value is refused with its reason when the metadata is parsed)."""
    try:
        clusters = meta_value(metadata, "class_clusters")
    except PayloadError:
        return TENSOR_NAMES
    valid = type(clusters) is int and 1 < clusters <= MAX_CLASS_CLUSTERS
    return (*TENSOR_NAMES, CLUSTER_TENSOR) if valid else TENSOR_NAMES


# --- validation shared by encode and decode ---------------------------------------------------


def check_payload(p: Payload) -> None:
    """Check that tensors agree with the metadata and with each other; raise PayloadError."""
    meta = p.meta
    check_schema_version(meta.schema_version)
    if (p.latent_clusters is None) != (meta.class_clusters == 1):
        raise PayloadError(
            f"class_clusters is {meta.class_clusters}: latent_clusters must be "
            + ("absent" if meta.class_clusters == 1 else "present (each z(T)'s sub-cluster)")
        )
    for name, tensor in p.tensors().items():
        if not isinstance(tensor, torch.Tensor):
            raise PayloadError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    _check_dtypes(p)
    _check_shapes(p)
    for name in ("latents", "domain_concept", "class_concepts"):
        check_finite(name, getattr(p, name))
    check_index("labels", p.labels, len(meta.class_names), "one per class name")
    if p.latent_clusters is not None:
        check_index(
            "latent_clusters", p.latent_clusters, meta.class_clusters, "sub-clusters per class"
        )


def _check_dtypes(p: Payload) -> None:
    """Latents in the dtype the metadata declares (float16 halves an upload); the rest fixed."""
    declared = p.meta.latent_dtype
    dtypes = {"latents": _LATENT_DTYPES[declared], **_FIXED_DTYPES}
    declaration = f"metadata says latent_dtype '{declared}'; float32 or float16 may be declared"
    for name in p.meta.tensor_names():
        check_dtype(name, getattr(p, name), dtypes[name], declaration if name == "latents" else "")


def _check_shapes(p: Payload) -> None:
    """Every shape follows from the metadata and the concept width d (read from S)."""
    meta = p.meta
    n, d = meta.num_examples, _concept_dim(p)
    shapes = {
        "latents": (n, *meta.latent_shape),
        "labels": (n,),
        "domain_concept": (meta.n_s, d),
        "class_concepts": (len(meta.class_names) * meta.class_clusters, meta.n_v, d),
        CLUSTER_TENSOR: (n,),
    }
    why = (
        f"from the metadata's num_examples={n}, latent_shape={meta.latent_shape}, n_s={meta.n_s}, "
        f"n_v={meta.n_v}, {len(meta.class_names)} classes x {meta.class_clusters} concepts each, "
        f"and concept dim {d} from domain_concept"
    )
    for name in meta.tensor_names():
        check_shape(name, getattr(p, name), shapes[name], why)


def _concept_dim(p: Payload) -> int:
    """d, the concept width, read from S; V must agree and the server checks it against d_w."""
    if p.domain_concept.dim() != 2 or p.domain_concept.shape[1] < 1:
        raise PayloadError(
            f"domain_concept has shape {list(p.domain_concept.shape)}, expected (n_s, d)"
        )
    return int(p.domain_concept.shape[1])


def check_expectations(p: Payload, expect: Expectations) -> None:
    """Refuse a valid payload that does not fit this server's base model and run config."""
    meta = p.meta
    n_s, n_v = expect.concept_sizes(meta.domain)
    checks: list[Check] = [
        *sampling_checks(meta, expect),
        (
            "concept dimension",
            _concept_dim(p),
            expect.concept_dim,
            "concepts must come from the server's text encoder",
        ),
        (
            "n_s",
            meta.n_s,
            n_s,
            "clients and server must share run config data.n-s; S has one "
            "vector per token of the domain phrase, at least data.n-s",
        ),
        (
            "n_v",
            meta.n_v,
            max(n_v),
            "clients and server must share run config data.n-v; V_y has "
            "one vector per token of its class name, at least data.n-v",
        ),
        (
            "concept space",
            meta.concept_space,
            expect.concept_space,
            "clients and server must share run config concept-space",
        ),
        (
            "class_clusters",
            meta.class_clusters,
            expect.class_clusters,
            "clients and server must share run config class-clusters",
        ),
        (
            "class names",
            tuple(meta.class_names),
            tuple(expect.class_names),
            "labels index the class list, so order matters",
        ),
        (
            "prompt template",
            meta.prompt_template,
            expect.prompt_template,
            "concepts were learned in this exact prompt",
        ),
    ]
    refuse_mismatch(checks)
    if expect.domains and meta.domain not in expect.domains:
        raise PayloadError(
            f"domain {meta.domain!r} is not one of the server's domains {list(expect.domains)} "
            "(clients and server must share run config data.domains)"
        )
    lengths = meta.per_concept(n_v)
    check_concept_rows(p.class_concepts, lengths, meta.concept_names)
    check_prompts_fit(meta, expect)
    if expect.plausibility is not None:
        check_latent_moments(p.latents, expect.timestep, expect.plausibility)
        check_concept_scale(p, lengths, expect.plausibility)


def check_prompts_fit(meta: Any, expect: Expectations) -> None:
    """Every prompt synthesis will build from the upload's concepts fits the text encoder (a
    domain phrase of hundreds of tokens does not)."""
    if expect.layout is None:
        return
    try:
        expect.layout(meta.prompt_template, meta.n_s, expect.n_v, meta.domain, meta.concept_names)
    except ValueError as err:
        raise PayloadError(f"{err}: the server could not prompt with these concepts") from None


def sampling_checks(meta: Any, expect: Expectations) -> list[Check]:
    """What every upload of z(T), or of a distribution over z(T), must share with the server:
    the LDM, the latent shape and the sampler and its first timestep. ``meta`` has the fields
    ``base_model``, ``latent_shape``, ``scheduler``, ``num_inference_steps`` and ``timestep``."""
    return [
        (
            "base model fingerprint",
            meta.base_model,
            expect.base_model,
            "client and server must load the same LDM",
        ),
        (
            "latent shape",
            tuple(meta.latent_shape),
            tuple(expect.latent_shape),
            "clients must encode images at the server's image size with the same VAE",
        ),
        (
            "scheduler",
            meta.scheduler,
            expect.scheduler,
            "z(T) only matches the sampler it was noised for: clients and server must share "
            "run config synthesis.scheduler",
        ),
        (
            "num_inference_steps",
            meta.num_inference_steps,
            expect.num_inference_steps,
            "clients and server must share run config synthesis.num-inference-steps",
        ),
        (
            "timestep",
            meta.timestep,
            expect.timestep,
            "z(T) must be noised to the first timestep the server denoises from: clients and "
            "server must share run config synthesis.num-inference-steps, "
            "synthesis.timestep-spacing and synthesis.start-timestep",
        ),
    ]


def check_latent_moments(latents: torch.Tensor, timestep: int, plaus: Plausibility) -> None:
    """Refuse an upload any of whose z(T) has a mean or std that z(T) at ``timestep`` cannot
    have (:func:`latent_bounds`): scaled, shifted or replaced latents poison the synthesis."""
    size = math.prod(latents.shape[1:])
    bounds = latent_bounds(plaus.alpha_bar, size, plaus.latent_rms, plaus.sigmas)
    mean, std = _image_moments(latents)
    why = (
        f"that z(T) at timestep {timestep} can have (an honest z(T) is sqrt(abar_T) times an "
        f"image latent plus sqrt(1 - abar_T) = {math.sqrt(1 - plaus.alpha_bar):.3g} times "
        "N(0, I) noise); was it noised to T with the server's scheduler and VAE?"
    )
    outside = (std < bounds.std_low) | (std > bounds.std_high)
    if bool(outside.any()):
        i = int(outside.nonzero()[0])
        raise PayloadError(
            f"latents[{i}] has std {float(std[i]):.4g}{_others(outside)}, outside "
            f"[{bounds.std_low:.3g}, {bounds.std_high:.3g}] {why}"
        )
    outside = mean.abs() > bounds.abs_mean
    if bool(outside.any()):
        i = int(outside.nonzero()[0])
        raise PayloadError(
            f"latents[{i}] has mean {float(mean[i]):.4g}{_others(outside)}, outside "
            f"[{-bounds.abs_mean:.3g}, {bounds.abs_mean:.3g}] {why}"
        )
    largest = coordinate_bound(plaus.alpha_bar, size, plaus.sigmas)
    peaks = latents.detach().reshape(len(latents), -1).abs().amax(dim=1).double()
    outside = peaks > largest
    if bool(outside.any()):
        i = int(outside.nonzero()[0])
        raise PayloadError(
            f"latents[{i}] has a value of size {float(peaks[i]):.4g}{_others(outside)}, above the "
            f"{largest:.3g} (one coordinate) {why}"
        )


def _image_moments(latents: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-image mean and population std, in float64, a few images at a time (bounded memory)."""
    flat = latents.detach().reshape(len(latents), -1)
    parts = [torch.var_mean(rows.double(), dim=1, correction=0) for rows in flat.split(chunk)]
    variance = torch.cat([v for v, _ in parts])
    return torch.cat([m for _, m in parts]), variance.sqrt()


def _others(outside: torch.Tensor) -> str:
    count = int(outside.sum())
    return f" (as do {count - 1} more of the {len(outside)} latents)" if count > 1 else ""


def check_concept_scale(p: Payload, lengths: Sequence[int], plaus: Plausibility) -> None:
    """Refuse a used concept vector whose RMS its learning cannot give it: above where its
    initial words plus every optimizer step at full size can take it, or far below the concept
    space's scale (:meth:`Plausibility.concept_range`)."""
    low, high = plaus.concept_range(p.meta.num_examples)
    vectors = {
        **{f"domain_concept[{j}] (S)": row for j, row in enumerate(p.domain_concept)},
        **{
            f"class_concepts[{y}][{j}] (V of {name!r})": rows[j]
            for y, (name, rows, length) in enumerate(
                zip(p.meta.concept_names, p.class_concepts, lengths, strict=True)
            )
            for j in range(min(length, len(rows)))
        },
    }
    rms = torch.stack(list(vectors.values())).double().pow(2).mean(-1).sqrt()
    outside = (rms < low) | (rms > high)
    if bool(outside.any()):
        i = int(outside.nonzero()[0])
        raise PayloadError(
            f"{list(vectors)[i]} has RMS {float(rms[i]):.4g}, outside [{low:.3g}, {high:.3g}] "
            f"that a concept can have after the run's concept learning (its initial words, "
            f"moved by at most {plaus.concept_step:.3g} x the {p.meta.concept_space} concept "
            f"space's scale {plaus.concept_scale:.3g} per step, and never below 1/"
            f"{plaus.concept_floor:g} of that scale); were the concepts learned with the "
            "server's base model, concept space and run config?"
        )


# --- reporting --------------------------------------------------------------------------------

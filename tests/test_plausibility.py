"""Statistically implausible uploads are refused, with a reason; honest ones never are.

Honest payloads come from the real client code (:func:`fedbip_flwr.methods.fedbip.personalize`) on the
tiny test model and are checked against the server's own expectations
(:func:`fedbip_flwr.expectations.expectations`), exactly as ``FedBiP.accept`` checks an upload.
The bounds themselves are in docs/payload.md, "Plausibility".
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fedbip_flwr import shapes
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.expectations import expectations
from fedbip_flwr.ldm import LDM, load_ldm
from fedbip_flwr.methods.base import ServerJob
from fedbip_flwr.methods.fedbip import FedBiP, personalize
from fedbip_flwr.payload import LATENT_RMS, Payload, decode_payload, encode_payload, latent_bounds
from fedbip_flwr.upload import PayloadError

CLASSES = ["circle", "square", "star"]
SIZE = 32  # the tiny model's 4 x 16 x 16 latent
CFG = FedBiPConfig.from_flat(
    {"synthesis.num-inference-steps": 4, "data.image-size": SIZE, "data.shots-per-class": 2}
).with_settings("fedbip", concept_epochs=1)


def honest(ldm: LDM, latent_dtype: str = "float32", domain: str = "sketch") -> Payload:
    """A payload computed by the real client code on real (generated) images."""
    cfg = CFG.with_settings("fedbip", latent_dtype=latent_dtype)
    data = shapes.client_train_set(
        domain, cfg.data.shots_per_class, 0, seed=0, size=SIZE, classes=CLASSES
    )
    payload, _ = personalize(
        ldm,
        data.images,
        data.labels,
        CLASSES,
        domain,
        f"{domain}-0",
        cfg,
        torch.Generator().manual_seed(0),
    )
    return payload


def accept(ldm: LDM, payload: Payload, cfg: FedBiPConfig = CFG) -> Payload:
    """What the server does with an upload: decode it under its own expectations."""
    expect = expectations(cfg, ldm, CLASSES, cfg.settings_of("fedbip"))
    return decode_payload(encode_payload(payload), expect)


def refusal(ldm: LDM, payload: Payload) -> str:
    with pytest.raises(PayloadError) as info:
        accept(ldm, payload)
    return info.value.reason


@pytest.fixture(scope="module")
def ldm(tiny_model_dir: Path) -> LDM:
    """The tiny model, loaded once for the module (tests only read it)."""
    return load_ldm(tiny_model_dir)


@pytest.fixture(scope="module")
def payload(ldm: LDM) -> Payload:
    return honest(ldm)


def scaled(payload: Payload, **factors: float | torch.Tensor) -> Payload:
    """``payload`` with tensors multiplied (float16 latents stay float16)."""
    tensors = {name: getattr(payload, name) * f for name, f in factors.items()}
    tensors = {name: t.to(getattr(payload, name).dtype) for name, t in tensors.items()}
    return replace(payload, **tensors)


# --- honest uploads pass ------------------------------------------------------------------------


def test_an_honest_payload_is_accepted(ldm: LDM, payload: Payload) -> None:
    assert (
        payload.meta.num_examples == 2 * len(CLASSES) * CFG.settings_of("fedbip").latents_per_image
    )
    decoded = accept(ldm, payload)
    assert torch.equal(decoded.latents, payload.latents)


def test_an_honest_float16_payload_is_accepted(ldm: LDM) -> None:
    payload = honest(ldm, "float16", domain="painting")
    assert payload.latents.dtype == torch.float16
    assert accept(ldm, payload).latents.dtype == torch.float16


def test_the_server_path_refuses_what_decode_refuses(ldm: LDM, payload: Payload) -> None:
    """FedBiP.accept, the strategy's entry point, runs the plausibility checks."""
    server = ServerJob(CFG, CLASSES, lambda: ldm)
    assert FedBiP().accept(encode_payload(payload), server).client_id == "sketch-0"
    with pytest.raises(PayloadError, match=r"latents\[0\] has std"):
        FedBiP().accept(encode_payload(scaled(payload, latents=50.0)), server)


# --- latents ------------------------------------------------------------------------------------


def test_latents_scaled_by_50_are_refused_naming_them(ldm: LDM, payload: Payload) -> None:
    reason = refusal(ldm, scaled(payload, latents=50.0))
    n = len(payload.latents)
    match = re.match(
        rf"latents\[0\] has std ([\d.]+) \(as do {n - 1} more of the {n} latents\), "
        r"outside \[([\d.]+), ([\d.]+)\] that z\(T\) at timestep 751 can have "
        r"\(an honest z\(T\) is",
        reason,
    )
    assert match, reason
    std, low, high = map(float, match.groups())
    assert std > 40 and low < 1 < high < 2


def test_one_poisoned_image_among_honest_ones_is_refused_naming_its_index(
    ldm: LDM, payload: Payload
) -> None:
    factors = torch.ones(len(payload.latents), 1, 1, 1)
    factors[3] = 50.0
    reason = refusal(ldm, scaled(payload, latents=factors))
    assert re.match(r"latents\[3\] has std [\d.]+, outside ", reason), reason


def test_a_shifted_image_is_refused_on_its_mean(ldm: LDM, payload: Payload) -> None:
    """Adding a constant keeps the std of z(T) but not its mean."""
    latents = payload.latents.clone()
    latents[5] += 3.0
    reason = refusal(ldm, replace(payload, latents=latents))
    assert reason.startswith("latents[5] has mean 2.9"), reason
    assert "outside [-1.19, 1.19]" in reason


def test_too_quiet_latents_are_refused(ldm: LDM, payload: Payload) -> None:
    reason = refusal(ldm, scaled(payload, latents=0.01))
    assert re.match(
        r"latents\[0\] has std 0\.0\d+ \(as do \d+ more of the \d+ latents\), "
        r"outside \[0\.[5-9]\d*, ",
        reason,
    ), reason


def test_clean_latents_without_noise_are_refused(ldm: LDM, payload: Payload) -> None:
    """z(0) itself (no forward noise: the image in the clear) is far quieter than z(T)."""
    z0 = torch.randn_like(payload.latents) * 0.06  # the tiny VAE's scaled-latent RMS
    assert "has std" in refusal(ldm, replace(payload, latents=z0))


# --- concepts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [1000.0, 1e-4])
def test_domain_concept_off_scale_is_refused_naming_it(
    ldm: LDM, payload: Payload, factor: float
) -> None:
    reason = refusal(ldm, scaled(payload, domain_concept=factor))
    # s = 0.0198 (the tiny table's RMS); its largest row is 1.3 s, and one step moves <= 0.727 s
    assert re.match(
        r"domain_concept\[0\] \(S\) has RMS [\d.e-]+, outside \[0\.00197, 0\.0401\] that "
        r"a concept can have after the run's concept learning \(its initial words, moved "
        r"by at most 0\.727 x the token concept space's scale 0\.0198 per step",
        reason,
    ), reason


@pytest.mark.parametrize("factor", [1000.0, 1e-4])
def test_one_class_concept_off_scale_is_refused_naming_its_class(
    ldm: LDM, payload: Payload, factor: float
) -> None:
    factors = torch.ones(len(CLASSES), 1, 1)
    factors[1] = factor
    reason = refusal(ldm, scaled(payload, class_concepts=factors))
    assert reason.startswith("class_concepts[1][0] (V of 'square') has RMS "), reason


def test_hidden_space_concepts_are_held_to_the_hidden_scale(ldm: LDM) -> None:
    """The scale is the run's concept space's: hidden states are ~50x token embeddings here, and
    one learning step allows 5x the scale to be refused."""
    cfg = CFG.with_settings("fedbip", concept_space="hidden")
    data = shapes.client_train_set("sketch", 2, 0, seed=0, size=SIZE, classes=CLASSES)
    payload, _ = personalize(
        ldm,
        data.images,
        data.labels,
        CLASSES,
        "sketch",
        "sketch-0",
        cfg,
        torch.Generator().manual_seed(0),
    )
    accept(ldm, payload, cfg)
    # s = 1 (the tiny encoder's final LayerNorm is the identity): [0.1 s, (1 + 0.727) s]
    with pytest.raises(
        PayloadError, match=r"domain_concept\[0\] \(S\) has RMS 0\.0\d+, outside \[0\.0999, 1\.73\]"
    ):
        accept(ldm, scaled(payload, domain_concept=0.02), cfg)
    with pytest.raises(
        PayloadError, match=r"class_concepts\[2\]\[0\] \(V of 'star'\) has RMS [2-9]\.\d+, "
    ):
        accept(
            ldm,
            replace(
                payload,
                class_concepts=payload.class_concepts * torch.tensor([1, 1, 5.0]).view(3, 1, 1),
            ),
            cfg,
        )


# --- the bounds themselves ----------------------------------------------------------------------


@pytest.mark.parametrize("size", [64, 256, 1024])
@pytest.mark.parametrize("alpha_bar", [0.005775, 0.0557, 0.5])
def test_honest_worst_case_latents_stay_within_the_bounds(size: int, alpha_bar: float) -> None:
    """20,000 z(T) per case whose zbar is as large as L allows, all of it in the mean, all of it
    in the spread, or split: none is refused (the bounds hold for every zbar with RMS <= L)."""
    g = torch.Generator().manual_seed(size)
    n = 20_000
    shape = torch.randn(n, size, generator=g)
    shape = (shape - shape.mean(1, keepdim=True)) / shape.std(1, correction=0, keepdim=True)
    spread = torch.rand(n, 1, generator=g)  # share of L^2 in the spread; the rest is the mean
    sign = torch.randint(0, 2, (n, 1), generator=g) * 2 - 1
    zbar = LATENT_RMS * (spread.sqrt() * shape + sign * (1 - spread).sqrt())
    z = math.sqrt(alpha_bar) * zbar + math.sqrt(1 - alpha_bar) * torch.randn(n, size, generator=g)
    var, mean = torch.var_mean(z.double(), dim=1, correction=0)
    bounds = latent_bounds(alpha_bar, size)
    assert float(mean.abs().max()) <= bounds.abs_mean
    assert bounds.std_low <= float(var.sqrt().min()) and float(var.sqrt().max()) <= bounds.std_high


def test_the_bounds_tighten_with_the_latent_size() -> None:
    """At SD v1-4's 4 x 64 x 64 latent and T = 981, z(T) must be nearly N(0, I)."""
    sd = latent_bounds(0.005775, 4 * 64 * 64)
    assert 0.94 < sd.std_low < 1 < sd.std_high < 1.11 and sd.abs_mean < 0.37
    assert latent_bounds(0.005775, 256).std_low < latent_bounds(0.005775, 1024).std_low < sd.std_low


def test_no_check_runs_on_odd_input_but_payload_error(ldm: LDM, payload: Payload) -> None:
    """Extreme but finite values, float16 or float32, and a one-image payload."""
    expect = expectations(CFG, ldm, CLASSES, CFG.settings_of("fedbip"))
    g = torch.Generator().manual_seed(0)
    huge = torch.randn(payload.latents.shape, generator=g).clamp(-3, 3) * 1e38
    for latents in (huge, (huge / 1e34).to(torch.float16), torch.zeros_like(payload.latents)):
        bad = replace(
            payload,
            latents=latents,
            meta=payload.meta.model_copy(
                update={"latent_dtype": str(latents.dtype).removeprefix("torch.")}
            ),
        )
        with pytest.raises(PayloadError, match="latents"):
            decode_payload(encode_payload(bad), expect)
    one = replace(
        payload,
        latents=payload.latents[:1],
        labels=payload.labels[:1],
        meta=payload.meta.model_copy(update={"num_examples": 1}),
    )
    decode_payload(encode_payload(one), expect)

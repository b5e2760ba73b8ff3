"""Concept-level personalization (eq. 4): only S and V learn; the LDM stays bit-identical."""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial

import pytest
import torch
from diffusers import DDPMScheduler

from fedbip_flwr import shapes
from fedbip_flwr.concepts import (
    concept_scale,
    count_tokens,
    diffusion_loss,
    encode_prompts,
    initial_concepts,
    learn_concepts,
    plain_prompt,
    prompt_layout,
    velocity,
)
from fedbip_flwr.ldm import SD_SCHEDULER_CONFIG, load_ldm
from fedbip_flwr.payload import Expectations, Payload, PayloadMeta, decode_payload, encode_payload
from fedbip_flwr.synthesis import SynthesisSettings, concept_layout
from fedbip_flwr.upload import SCHEMA_VERSION, PayloadError
from fedbip_tools.build_ldm import TINY, build_ldm
from tests.helpers import WORDS

CLASSES = ["circle", "square", "star"]


def test_layout_places_slots_from_template(tiny_ldm):
    tok = tiny_ldm.tokenizer
    layout = prompt_layout(tok, "a {S} style of a {V}", 1, 2, "sketch", CLASSES)
    ids = layout.input_ids
    assert ids.shape == (3, tok.model_max_length)
    sketch = tok("sketch", add_special_tokens=False).input_ids
    for c, name in enumerate(CLASSES):
        assert ids[c, layout.s_positions[c]].tolist() == sketch
        word = tok(name, add_special_tokens=False).input_ids
        assert ids[c, layout.v_positions[c]].tolist() == word * 2  # n_v = 2 > 1 token: repeated
    # V before S in the template works too
    swapped = prompt_layout(tok, "{V} in a {S} style", 2, 1, "sketch", CLASSES)
    assert (swapped.v_positions.max(1).values < swapped.s_positions.min(1).values).all()


def test_concepts_start_from_the_whole_phrase(tiny_ldm, caplog):
    """A class name of several tokens gets one vector per token: nothing cut, nothing padded.

    The tiny tokenizer spells unknown words letter by letter, so "zebra" is 5 tokens.
    """
    tok = tiny_ldm.tokenizer
    names = ["circle", "zebra", "star"]
    with caplog.at_level(logging.WARNING, logger="fedbip_flwr.concepts"):
        layout = prompt_layout(tok, "a {S} style of a {V}", 1, 1, "sketch", names)
    assert "class name 'zebra' is 5 tokens" in caplog.text
    assert layout.v_lengths.tolist() == [1, 5, 1] and layout.n_v == 5
    for c, name in enumerate(names):
        plain = plain_prompt("a {S} style of a {V}", "sketch", name)
        want = tok(plain, padding="max_length", max_length=tok.model_max_length).input_ids
        assert layout.input_ids[c].tolist() == want
    for space in ("token", "hidden"):
        s0, v0 = initial_concepts(tiny_ldm, layout, space)
        assert v0.shape == (3, 5, tiny_ldm.concept_dim)
        assert not v0[0, 1:].any() and v0[1].abs().amax(-1).gt(0).all()  # unused rows are zero
        states = encode_prompts(tiny_ldm, layout, space, s0, v0, torch.arange(3))
        # the same forward on the same batch (see the next test): equal to a few 2^-24
        assert torch.allclose(
            states, tiny_ldm.text_encoder(layout.input_ids).last_hidden_state, atol=1e-5
        )


def test_prompt_too_long_is_a_clear_error(tiny_ldm):
    with pytest.raises(ValueError, match="needs .* tokens"):
        prompt_layout(tiny_ldm.tokenizer, "a {S} style of a {V}", 8, 8, "sketch", CLASSES)


@pytest.mark.parametrize("space", ["token", "hidden"])
def test_initial_concepts_reproduce_the_plain_prompt(tiny_ldm, space):
    layout = prompt_layout(tiny_ldm.tokenizer, "a {S} style of a {V}", 1, 1, "sketch", CLASSES)
    s0, v0 = initial_concepts(tiny_ldm, layout, space)
    states = encode_prompts(tiny_ldm, layout, space, s0, v0, torch.arange(3))
    plain = tiny_ldm.text_encoder(layout.input_ids).last_hidden_state
    # the same forward on the same batch: "token" writes the table's own rows back (bit-equal),
    # "hidden" the mean of 3 states sharing one causal prefix (a few 2^-24 of |state| < 4 off)
    assert torch.allclose(states, plain, atol=1e-5)
    # a random shift (a constant one would vanish in the first LayerNorm)
    moved = encode_prompts(tiny_ldm, layout, space, s0 + torch.randn_like(s0), v0, torch.arange(3))
    assert not torch.allclose(moved, plain, atol=1e-3)


@pytest.mark.parametrize("space", ["token", "hidden"])
def test_learning_lowers_loss_and_changes_only_concepts(tiny_ldm, space):
    layout = prompt_layout(tiny_ldm.tokenizer, "a {S} style of a {V}", 1, 1, "sketch", CLASSES)
    before = {
        name: {k: v.clone() for k, v in m.state_dict().items()}
        for name, m in [
            ("vae", tiny_ldm.vae),
            ("unet", tiny_ldm.unet),
            ("text", tiny_ldm.text_encoder),
        ]
    }
    g = torch.Generator().manual_seed(0)
    z0 = torch.randn(6, *tiny_ldm.latent_shape(), generator=g)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    s0, v0 = initial_concepts(tiny_ldm, layout, space)
    # eq. 4 on a fixed held draw of (t, eps), before and after learning
    t = torch.randint(1, 982, (24,), generator=g)
    noise = torch.randn(24, *z0.shape[1:], generator=g)
    zs, ys = z0.repeat(4, 1, 1, 1), labels.repeat(4)
    with torch.no_grad():
        start = diffusion_loss(tiny_ldm, layout, space, s0, v0, zs, ys, t, noise).item()
    result = learn_concepts(
        tiny_ldm, layout, space, z0, labels, 981, epochs=30, batch_size=6, lr=0.1, generator=g
    )
    with torch.no_grad():
        end = diffusion_loss(
            tiny_ldm, layout, space, result.domain, result.classes, zs, ys, t, noise
        ).item()
    # a random-init UNet listens to its text only weakly: a small but real drop
    assert end < start, (start, end, result.losses)
    assert not torch.allclose(result.domain, s0) and not torch.allclose(result.classes, v0)
    assert result.domain.shape == s0.shape and result.classes.shape == (3, 1, tiny_ldm.concept_dim)
    for name, m in [
        ("vae", tiny_ldm.vae),
        ("unet", tiny_ldm.unet),
        ("text", tiny_ldm.text_encoder),
    ]:
        for key, value in m.state_dict().items():
            assert torch.equal(value, before[name][key]), f"{name}.{key} changed"
        assert all(p.grad is None for p in m.parameters())


def test_plain_prompt_is_the_unlearned_layout(tiny_ldm):
    """Prompts-only's text is exactly what instance-only conditions on (no learned concept)."""
    tok = tiny_ldm.tokenizer
    layout = prompt_layout(tok, shapes.CAPTION_TEMPLATE, 1, 1, "sketch", CLASSES)
    for c, name in enumerate(CLASSES):
        text = plain_prompt(shapes.CAPTION_TEMPLATE, "sketch", name)
        assert text == f"a sketch of a {name}"
        ids = tok(text, padding="max_length", max_length=tok.model_max_length).input_ids
        assert ids == layout.input_ids[c].tolist()


@pytest.mark.parametrize("space", ["token", "hidden"])
def test_lr_acts_on_the_spaces_own_scale(tiny_ldm, space):
    """Adam's first step moves each coordinate by ~lr x the space's RMS, so lr 0.1 shifts a
    concept by ~10% of its norm in either space (an absolute 0.1 would be ~1/scale times that)."""
    layout = prompt_layout(tiny_ldm.tokenizer, "a {S} style of a {V}", 1, 1, "sketch", CLASSES)
    scale = concept_scale(tiny_ldm, space)
    if space == "token":
        table = tiny_ldm.text_encoder.get_input_embeddings().weight
        assert scale == pytest.approx(float(table.pow(2).mean().sqrt()))
    s0, v0 = initial_concepts(tiny_ldm, layout, space)
    g = torch.Generator().manual_seed(0)
    z0 = torch.randn(6, *tiny_ldm.latent_shape(), generator=g)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    result = learn_concepts(
        tiny_ldm, layout, space, z0, labels, 981, epochs=1, batch_size=6, lr=0.1, generator=g
    )
    step = (result.domain - s0).abs()
    assert step.max() <= 0.1 * scale * 1.001  # Adam's first step is at most lr per coordinate of u
    assert step.median() > 0.05 * scale
    assert result.domain_drift == pytest.approx(float((result.domain - s0).norm() / s0.norm()))
    per_class = [float((a - b).norm() / b.norm()) for a, b in zip(result.classes, v0)]
    assert result.class_drift == pytest.approx(sum(per_class) / 3)
    assert 0.02 < result.domain_drift < 0.3 and 0.02 < result.class_drift < 0.3


def test_adapted_concepts_round_trip_through_server_checks(tiny_ldm):
    """A 5-token class name: learning keeps V's unused rows at zero, the server (told the token
    counts) accepts the payload, rebuilds the same layout and refuses other data.n-v."""
    names = ["circle", "zebra", "star"]
    template = "a {S} style of a {V}"
    layout = prompt_layout(tiny_ldm.tokenizer, template, 1, 1, "sketch", names)
    g = torch.Generator().manual_seed(0)
    z0 = torch.randn(6, *tiny_ldm.latent_shape(), generator=g)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    result = learn_concepts(
        tiny_ldm, layout, "token", z0, labels, 901, epochs=2, batch_size=3, lr=0.1, generator=g
    )
    assert not result.classes[0, 1:].any() and not result.classes[2, 1:].any()
    meta = PayloadMeta(
        schema_version=SCHEMA_VERSION,
        client_id="sketch-0",
        domain="sketch",
        timestep=901,
        scheduler="PNDMScheduler",
        num_inference_steps=10,
        n_s=layout.n_s,
        n_v=layout.n_v,
        concept_space="token",
        class_names=names,
        prompt_template=template,
        base_model=tiny_ldm.fingerprint,
        latent_shape=list(z0.shape[1:]),
        latent_dtype="float32",
        num_examples=6,
    )
    payload = Payload(z0, labels, result.domain, result.classes, meta)

    def expect(n_v: int) -> Expectations:
        return Expectations(
            max_bytes=2**24,
            base_model=tiny_ldm.fingerprint,
            latent_shape=tuple(z0.shape[1:]),
            concept_dim=tiny_ldm.concept_dim,
            timestep=901,
            num_inference_steps=10,
            scheduler="PNDMScheduler",
            n_s=1,
            n_v=n_v,
            concept_space="token",
            class_names=tuple(names),
            prompt_template=template,
            domains=("sketch",),
            phrase_tokens=partial(count_tokens, tiny_ldm.tokenizer),
        )

    decode_payload(encode_payload(payload), expect(1))
    with pytest.raises(
        PayloadError, match="class concept of 'circle' does not use exactly its first 2"
    ):
        decode_payload(encode_payload(payload), expect(2))
    settings = SynthesisSettings(10, 1.0, 6, n_v=1)
    rebuilt = concept_layout(tiny_ldm, payload.concepts, settings)
    assert torch.equal(rebuilt.input_ids, layout.input_ids)
    with pytest.raises(PayloadError, match="'circle'"):
        concept_layout(tiny_ldm, payload.concepts, SynthesisSettings(10, 1.0, 6, n_v=3))


def test_v_prediction_model_trains_against_the_velocity(tmp_path):
    """SD 2.x-style models predict v = sqrt(abar) eps - sqrt(1 - abar) z0, not eps."""
    folder = tmp_path / "v-model"
    build_ldm(replace(TINY, prediction_type="v_prediction"), WORDS, seed=0).save(folder)
    ldm = load_ldm(folder)
    assert ldm.scheduler.config.prediction_type == "v_prediction"  # PNDM's step reads it too
    layout = prompt_layout(ldm.tokenizer, "a {S} style of a {V}", 1, 1, "sketch", CLASSES)
    s0, v0 = initial_concepts(ldm, layout, "token")
    g = torch.Generator().manual_seed(0)
    z0, noise = torch.randn(2, 3, *ldm.latent_shape(), generator=g)
    t, labels = torch.tensor([100, 700, 981]), torch.tensor([0, 1, 2])
    ddpm = DDPMScheduler.from_config(SD_SCHEDULER_CONFIG)  # diffusers' own get_velocity
    target = ddpm.get_velocity(z0, noise, t)
    assert torch.allclose(velocity(ldm.scheduler, z0, noise, t), target, atol=1e-6)
    with torch.no_grad():
        cond = encode_prompts(ldm, layout, "token", s0, v0, labels)
        zt = ldm.scheduler.add_noise(z0, noise, t)
        pred = ldm.unet(zt, t, encoder_hidden_states=cond).sample
        loss = diffusion_loss(ldm, layout, "token", s0, v0, z0, labels, t, noise)
    assert loss.item() == pytest.approx(float(((pred - target) ** 2).mean()), rel=1e-5)
    assert loss.item() != pytest.approx(float(((pred - noise) ** 2).mean()), rel=1e-3)

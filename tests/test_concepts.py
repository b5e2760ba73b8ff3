"""Concept-level personalization (eq. 4): only S and V learn; the LDM stays bit-identical."""

from __future__ import annotations

import pytest
import torch

from fedbip_flwr import shapes
from fedbip_flwr.concepts import (
    diffusion_loss,
    encode_prompts,
    initial_concepts,
    learn_concepts,
    plain_prompt,
    prompt_layout,
)

CLASSES = ["circle", "square", "star"]


def test_layout_places_slots_from_template(tiny_ldm):
    tok = tiny_ldm.tokenizer
    layout = prompt_layout(tok, "a {S} style of a {V}", 1, 2, "sketch", CLASSES)
    ids = layout.input_ids
    assert ids.shape == (3, tok.model_max_length)
    sketch = tok("sketch", add_special_tokens=False).input_ids
    assert ids[0, layout.s_positions].tolist() == sketch
    for c, name in enumerate(CLASSES):
        word = tok(name, add_special_tokens=False).input_ids
        assert ids[c, layout.v_positions].tolist() == word * 2
    # V before S in the template works too
    swapped = prompt_layout(tok, "{V} in a {S} style", 2, 1, "sketch", CLASSES)
    assert swapped.v_positions.max() < swapped.s_positions.min()


def test_prompt_too_long_is_a_clear_error(tiny_ldm):
    with pytest.raises(ValueError, match="needs .* tokens"):
        prompt_layout(tiny_ldm.tokenizer, "a {S} style of a {V}", 8, 8, "sketch", CLASSES)


@pytest.mark.parametrize("space", ["token", "hidden"])
def test_initial_concepts_reproduce_the_plain_prompt(tiny_ldm, space):
    layout = prompt_layout(tiny_ldm.tokenizer, "a {S} style of a {V}", 1, 1, "sketch", CLASSES)
    s0, v0 = initial_concepts(tiny_ldm, layout, space)
    states = encode_prompts(tiny_ldm, layout, space, s0, v0, torch.arange(3))
    plain = tiny_ldm.text_encoder(layout.input_ids).last_hidden_state
    assert torch.allclose(states, plain, atol=1e-5)
    # a random shift (a constant one would vanish in the first LayerNorm)
    moved = encode_prompts(tiny_ldm, layout, space, s0 + torch.randn_like(s0), v0, torch.arange(3))
    assert not torch.allclose(moved, plain, atol=1e-3)


@pytest.mark.parametrize("space", ["token", "hidden"])
def test_learning_lowers_loss_and_changes_only_concepts(tiny_ldm, space):
    layout = prompt_layout(tiny_ldm.tokenizer, "a {S} style of a {V}", 1, 1, "sketch", CLASSES)
    before = {
        name: {k: v.clone() for k, v in m.state_dict().items()}
        for name, m in [("vae", tiny_ldm.vae), ("unet", tiny_ldm.unet), ("text", tiny_ldm.text_encoder)]
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
        end = diffusion_loss(tiny_ldm, layout, space, result.domain, result.classes, zs, ys, t, noise).item()
    # a random-init UNet listens to its text only weakly: a small but real drop
    assert end < start, (start, end, result.losses)
    assert not torch.allclose(result.domain, s0) and not torch.allclose(result.classes, v0)
    assert result.domain.shape == s0.shape and result.classes.shape == (3, 1, tiny_ldm.concept_dim)
    for name, m in [("vae", tiny_ldm.vae), ("unet", tiny_ldm.unet), ("text", tiny_ldm.text_encoder)]:
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

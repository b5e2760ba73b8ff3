"""Concept layouts under Stable Diffusion v1-x's real tokenizer (CLIP BPE, built offline).

CLIP splits many of the paper's phrases ("quickdraw" -> quick draw, "melanocytic nevi" -> 6
tokens): every concept must still start from its whole phrase.
"""

from __future__ import annotations

import logging

import pytest

from fedbip_flwr.concepts import count_tokens, plain_prompt, prompt_layout
from fedbip_flwr.specs import SPECS
from fedbip_tools.clip_bpe import CLIP_VOCAB_SIZE, clip_tokenizer

PAPER = [spec for spec in SPECS.values() if spec.classes]  # imagefolder names its own


@pytest.fixture(scope="module")
def tok():
    return clip_tokenizer()


def test_ids_are_clips_own(tok):
    assert len(tok) == CLIP_VOCAB_SIZE and tok.model_max_length == 77
    assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert tok.tokenize("quickdraw") == ["quick", "draw</w>"]
    assert count_tokens(tok, "melanocytic nevi") == 6


@pytest.mark.parametrize("spec", PAPER, ids=[s.name for s in PAPER])
def test_initial_prompt_is_the_plain_prompt(tok, spec):
    """With one vector per token (n = 1), the unlearned prompt is exactly the plain text."""
    for domain in spec.domains:
        layout = prompt_layout(tok, spec.prompt_template, 1, 1, domain, spec.classes)
        for c, name in enumerate(spec.classes):
            text = plain_prompt(spec.prompt_template, domain, name)
            want = tok(text, padding="max_length", max_length=77).input_ids
            assert layout.input_ids[c].tolist() == want, text
            decoded = tok.decode(layout.input_ids[c], skip_special_tokens=True)
            assert decoded == tok.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("spec", PAPER, ids=[s.name for s in PAPER])
def test_table5_sizes_never_cut_a_phrase(tok, spec, caplog):
    """With the paper's n_s / n_v, each concept holds its whole phrase first (repeated up to n
    when shorter), and every phrase that needs more than n is logged."""
    for domain in spec.domains:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fedbip_flwr.concepts"):
            layout = prompt_layout(
                tok, spec.prompt_template, spec.n_s, spec.n_v, domain, spec.classes
            )
        phrase = tok(domain, add_special_tokens=False).input_ids
        for row, s_pos in zip(layout.input_ids, layout.s_positions):
            assert row[s_pos].tolist()[: len(phrase)] == phrase
        assert layout.n_s == max(spec.n_s, len(phrase))
        for c, name in enumerate(spec.classes):
            words = tok(name, add_special_tokens=False).input_ids
            used = layout.input_ids[c, layout.v_positions[c, : layout.v_lengths[c]]].tolist()
            assert used == [words[i % len(words)] for i in range(max(spec.n_v, len(words)))]
            if len(words) > spec.n_v:
                assert f"class name '{name}' is {len(words)} tokens" in caplog.text
        assert (f"domain phrase '{domain}'" in caplog.text) == (len(phrase) > spec.n_s)


def test_the_issue_examples(tok):
    domainnet = SPECS["domainnet"]
    layout = prompt_layout(tok, domainnet.prompt_template, 1, 1, "quickdraw", domainnet.classes)
    assert layout.n_s == 2 and tok.decode(layout.s_init_ids) == "quickdraw"
    derma = SPECS["dermamnist"]
    layout = prompt_layout(tok, derma.prompt_template, 2, 4, derma.domains[0], derma.classes)
    assert layout.n_s == 4  # der mato scopic image
    lengths = dict(zip(derma.classes, layout.v_lengths.tolist()))
    assert lengths["melanocytic nevi"] == 6 and lengths["intraepithelial carcinoma"] == 5
    assert lengths["melanoma"] == 4 and layout.n_v == 6  # n_v = 4 repeats a one-token name

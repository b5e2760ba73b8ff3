"""Exported concepts work in a plain diffusers pipeline, exactly as they were learned.

A payload is personalized on the shipped miniature model (a few sketch images, one concept
epoch), exported, and loaded with ``load_textual_inversion`` into a ``StableDiffusionPipeline``
built from the same folder. The pipeline's prompt encoding must then equal the conditioning the
concepts were trained under, for one-vector and multi-vector concepts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import safetensors.torch
import torch
from diffusers import StableDiffusionPipeline

from fedbip_flwr import shapes
from fedbip_flwr.concepts import encode_prompts, prompt_layout
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import LDM, load_ldm
from fedbip_flwr.methods.fedbip import personalize
from fedbip_flwr.payload import Payload
from fedbip_tools.textual_inversion import (
    ExportError,
    concept_embeddings,
    example_prompt,
    export_concepts,
    file_for,
    token_for,
)

MODEL = Path(__file__).resolve().parents[1] / "models" / "miniature-ldm"
CLASSES = ("circle", "square")


@pytest.fixture(scope="module")
def ldm() -> LDM:
    return load_ldm(MODEL)


def personalized(ldm: LDM, n_s: int, n_v: int) -> tuple[Payload, FedBiPConfig]:
    """Two sketch images per class, one concept epoch: real learned concepts, in seconds."""
    cfg = FedBiPConfig.from_flat({"data.n-s": n_s, "data.n-v": n_v}).with_settings(
        "fedbip", concept_epochs=1
    )
    data = shapes.client_train_set("sketch", 2, classes=CLASSES)
    payload, _ = personalize(
        ldm,
        data.images,
        data.labels,
        list(CLASSES),
        "sketch",
        "sketch-0",
        cfg,
        generator=torch.Generator().manual_seed(0),
    )
    return payload, cfg


@pytest.fixture(scope="module")
def single(ldm: LDM) -> tuple[Payload, FedBiPConfig]:
    """One vector per concept (the shapes default, n_s = n_v = 1)."""
    return personalized(ldm, n_s=1, n_v=1)


def loaded_pipeline(payload: Payload, out_dir: Path) -> StableDiffusionPipeline:
    """A pipeline of the base model with every exported file loaded, as a user would."""
    pipe = StableDiffusionPipeline.from_pretrained(MODEL)
    files = [str(out_dir / concept.file) for concept in export_concepts(payload, out_dir)]
    pipe.load_textual_inversion(files)
    return pipe


def training_conditioning(
    ldm: LDM, payload: Payload, cfg: FedBiPConfig, label: int
) -> torch.Tensor:
    """tau(S, V_label): what the UNet saw while S and V were learned."""
    layout = prompt_layout(
        ldm.tokenizer, cfg.data.prompt_template, cfg.data.n_s, cfg.data.n_v, "sketch", CLASSES
    )
    with torch.no_grad():
        return encode_prompts(
            ldm,
            layout,
            "token",
            payload.domain_concept,
            payload.class_concepts,
            torch.tensor([label]),
        )


def pipeline_conditioning(pipe: StableDiffusionPipeline, prompt: str) -> torch.Tensor:
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(prompt, "cpu", 1, do_classifier_free_guidance=False)
    return embeds


def test_exported_concepts_load_and_generate(
    ldm: LDM, single: tuple[Payload, FedBiPConfig], tmp_path: Path
) -> None:
    payload, cfg = single
    pipe = loaded_pipeline(payload, tmp_path)
    prompt = "a <sketch> of a <circle>"
    assert example_prompt(payload) == prompt

    table = pipe.text_encoder.get_input_embeddings().weight
    ids = pipe.tokenizer.convert_tokens_to_ids(["<sketch>", "<circle>", "<square>"])
    assert torch.equal(table[ids[0]], payload.domain_concept[0])
    assert torch.equal(table[ids[1]], payload.class_concepts[0, 0])
    assert torch.equal(table[ids[2]], payload.class_concepts[1, 0])

    expected = training_conditioning(ldm, payload, cfg, label=0)
    torch.testing.assert_close(pipeline_conditioning(pipe, prompt), expected)

    image = pipe(
        prompt, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0)
    ).images
    assert image.shape == (1, 64, 64, 3)
    assert (image >= 0).all() and (image <= 1).all()


def test_multi_vector_concepts_expand_as_learned(ldm: LDM, tmp_path: Path) -> None:
    """n_s = n_v = 2: diffusers' <t>, <t>_1 tokens fill the two slots the concept was learned in."""
    payload, cfg = personalized(ldm, n_s=2, n_v=2)
    pipe = loaded_pipeline(payload, tmp_path)
    file = safetensors.torch.load_file(str(tmp_path / "class-square.safetensors"))
    assert list(file) == ["<square>"] and file["<square>"].shape == (2, ldm.concept_dim)

    table = pipe.text_encoder.get_input_embeddings().weight
    ids = pipe.tokenizer.convert_tokens_to_ids(["<sketch>", "<sketch>_1"])
    assert torch.equal(table[ids], payload.domain_concept)

    expected = training_conditioning(ldm, payload, cfg, label=1)
    torch.testing.assert_close(pipeline_conditioning(pipe, "a <sketch> of a <square>"), expected)


def test_hidden_space_concepts_are_refused(single: tuple[Payload, FedBiPConfig]) -> None:
    payload, _ = single
    hidden = dataclasses.replace(
        payload, meta=payload.meta.model_copy(update={"concept_space": "hidden"})
    )
    with pytest.raises(ExportError, match='concept-space = "token"'):
        concept_embeddings(hidden)


def test_names_become_one_prompt_word_and_a_safe_file_name() -> None:
    assert token_for("baseball  bat") == "<baseball-bat>"
    assert file_for("class", "baseball bat") == "class-baseball-bat.safetensors"
    assert "/" not in file_for("class", "a/../b")


def test_names_that_would_share_a_token_are_refused(single: tuple[Payload, FedBiPConfig]) -> None:
    payload, _ = single
    clash = payload.meta.model_copy(update={"class_names": ["big cat", "big  cat"]})
    with pytest.raises(ExportError, match="share a token"):
        concept_embeddings(dataclasses.replace(payload, meta=clash))

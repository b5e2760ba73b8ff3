"""Loading: the tiny folder and SD v1-4 go through one function; failures are one sentence."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from diffusers import StableDiffusionPipeline

from fedbip_flwr.ldm import ALLOW_CPU_ENV, ModelLoadError, load_for_run, load_ldm
from fedbip_tools.build_ldm import TINY, build_ldm, build_tokenizer, grow_vocabulary
from tests.helpers import WORDS, script


def test_saved_tiny_model_loads_like_sd(tiny_model_dir):
    built = build_ldm(TINY, WORDS, seed=0)
    loaded = load_ldm(tiny_model_dir)
    assert loaded.fingerprint == built.fingerprint
    assert loaded.latent_shape() == (4, 16, 16)
    assert all(not p.requires_grad for p in loaded.unet.parameters())
    pipe = StableDiffusionPipeline.from_pretrained(tiny_model_dir, safety_checker=None)
    assert type(pipe.scheduler).__name__ == "PNDMScheduler"


def test_run_loader_resolves_local_folder(tiny_model_dir):
    ldm = load_for_run(str(tiny_model_dir), "cpu", half_precision=True, image_size=32)
    assert ldm.dtype == torch.float32  # CPU never runs half precision


def test_sd_sized_run_on_cpu_is_refused_before_loading(tmp_path):
    """No weights are read: the folder does not even exist, the device check comes first."""
    with pytest.raises(
        ModelLoadError,
        match="data.image-size 512 is a Stable Diffusion-sized run and needs a CUDA GPU",
    ):
        load_for_run(str(tmp_path / "absent"), "cpu", half_precision=True, image_size=512)


def test_sd_sized_run_on_cpu_when_the_environment_opts_in(tmp_path, tiny_model_dir, monkeypatch):
    """FEDBIP_ALLOW_SD_ON_CPU=1 (the 512-px CPU proof) lifts the refusal; anything else keeps it."""
    monkeypatch.setenv(ALLOW_CPU_ENV, "0")
    with pytest.raises(ModelLoadError, match=f"set {ALLOW_CPU_ENV}=1"):
        load_for_run(str(tmp_path / "absent"), "cpu", half_precision=True, image_size=512)
    monkeypatch.setenv(ALLOW_CPU_ENV, "1")
    ldm = load_for_run(str(tiny_model_dir), "cpu", half_precision=True, image_size=512)
    assert ldm.device.type == "cpu" and ldm.dtype == torch.float32


def test_uncached_hub_id_offline_is_one_clear_sentence(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="Set run config 'ldm.model' to a local folder"):
        load_ldm("CompVis/stable-diffusion-v1-4", allow_download=False)


def test_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "readme.txt").write_text("not a model")
    with pytest.raises(ModelLoadError, match="not a diffusers model folder"):
        load_ldm(tmp_path)


def test_different_weights_different_fingerprint():
    assert build_ldm(TINY, WORDS, seed=0).fingerprint != build_ldm(TINY, WORDS, seed=1).fingerprint


def test_tokenizer_keeps_words_whole_and_spells_unknown_ones():
    tok = build_tokenizer(["star", "stars", "sketch", "square", "quickdraw", "style"], 16)
    for word in ["star", "stars", "sketch", "square", "quickdraw", "style"]:
        assert len(tok.tokenize(word)) == 1, word
    assert len(tok.tokenize("zebra")) == 5


def test_unknown_prediction_type_is_refused_at_load(tmp_path):
    folder = tmp_path / "sample-model"
    build_ldm(replace(TINY, prediction_type="sample"), WORDS, seed=0).save(folder)
    with pytest.raises(ModelLoadError, match="predicts 'sample' .* only epsilon or v_prediction"):
        load_ldm(folder)


def test_grown_vocabulary_keeps_every_learned_token(tmp_path):
    ldm = build_ldm(TINY, WORDS, seed=0)
    prompt = "a painting of a star"

    def encode(model, text: str) -> torch.Tensor:
        ids = model.tokenizer([text], padding="max_length", return_tensors="pt").input_ids
        return model.text_encoder(ids).last_hidden_state

    grown = grow_vocabulary(ldm, ["doodle", "scribble"])
    assert len(grown.tokenizer) > len(ldm.tokenizer)
    assert grown.tokenizer.tokenize("a doodle of a star") == [
        "a</w>", "doodle</w>", "of</w>", "a</w>", "star</w>"
    ]  # fmt: skip
    assert torch.equal(encode(grown, prompt), encode(ldm, prompt))  # ids moved, meaning did not
    assert grown.fingerprint != ldm.fingerprint
    grown.save(tmp_path / "grown")
    loaded = load_ldm(tmp_path / "grown")
    assert loaded.fingerprint == grown.fingerprint
    assert torch.equal(encode(loaded, "a doodle of a star"), encode(grown, "a doodle of a star"))
    assert grow_vocabulary(grown, ["doodle"]) is grown


def test_pretraining_stops_at_its_step_count_and_trains_the_unet():
    """pretrain_miniature.py --unet-steps: a run reproducible exactly (a time budget is not)."""
    train_unet = script("pretrain_miniature").train_unet
    trained = []
    for _ in range(2):
        ldm = build_ldm(TINY, WORDS, seed=0)
        before = [p.clone() for p in ldm.unet.parameters()]
        latents = torch.randn(8, *ldm.latent_shape(), generator=torch.Generator().manual_seed(0))
        log: list[dict] = []
        train_unet(ldm, latents, ["a star"] * 8, 60.0, 3, 2, log, seed=0)
        assert log[-1]["final"] and log[-1]["step"] == 3
        assert any(not torch.equal(a, b) for a, b in zip(before, ldm.unet.parameters()))
        trained.append(ldm.unet.state_dict())
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])

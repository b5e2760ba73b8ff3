"""The shipped miniature LDM: what `flwr run .` uses by default, in the layout SD v1-4 uses."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import torch
from diffusers import StableDiffusionPipeline

from fedbip_flwr import shapes
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import load_ldm
from fedbip_flwr.paths import resolve
from fedbip_flwr.synthesis import SynthesisSettings
from fedbip_tools.sampling import sample_from_prompts

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "models" / "miniature-ldm"


def test_default_run_uses_the_shipped_folder():
    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert defaults["ldm"]["model"] == FedBiPConfig().ldm.model == "models/miniature-ldm"
    assert resolve(defaults["ldm"]["model"]) == FOLDER
    assert (FOLDER / "model_index.json").is_file()


def test_weights_are_safetensors_only_and_small():
    files = [p for p in FOLDER.rglob("*") if p.is_file()]
    weights = [p for p in files if p.suffix in {".safetensors", ".bin", ".pt", ".pth", ".ckpt"}]
    assert sorted(p.parent.name for p in weights) == [
        "classifier-backbone",
        "text_encoder",
        "unet",
        "vae",
    ]
    assert all(p.suffix == ".safetensors" for p in weights)
    # the LDM's 19 MB and the classifier backbone's 22.4 MB (float16 ResNet-18)
    assert sum(p.stat().st_size for p in files) < 44 * 2**20


def test_loads_through_the_sd_code_path_and_diffusers_pipeline():
    ldm = load_ldm(FOLDER)
    assert ldm.latent_shape() == (4, 16, 16) and ldm.image_size == 64
    vocab = ldm.tokenizer.get_vocab()
    assert all(f"{word}</w>" in vocab for word in [*shapes.CLASSES, *shapes.DOMAINS])
    pipe = StableDiffusionPipeline.from_pretrained(FOLDER, safety_checker=None)
    assert type(pipe.unet).__name__ == "UNet2DConditionModel"


def test_pretraining_log_records_what_was_trained():
    log = json.loads((FOLDER / "pretrain_log.json").read_text())
    runs = [entry for entry in log if "args" in entry]
    unet_steps = [e["step"] for e in log if e.get("stage") == "unet" and e.get("final")]
    assert runs and len(unet_steps) == len(runs), "each pretraining stage ends with its step count"
    assert sum(unet_steps) > 1000
    vae_losses = [e["loss"] for e in log if e.get("stage") == "vae"]
    assert vae_losses[-1] < 0.5 * vae_losses[0]


def test_pretrained_model_draws_images_not_noise():
    """A random-init LDM decodes noise; a trained one draws flat backgrounds and shapes.

    Shapes images are smooth: neighbouring pixels are close. Noise is not.
    """
    ldm = load_ldm(FOLDER)
    settings = SynthesisSettings(num_inference_steps=10, guidance_scale=4.0, batch_size=6)
    prompts = [f"a photo of a {name}" for name in shapes.CLASSES]
    images = sample_from_prompts(ldm, prompts, settings, torch.Generator().manual_seed(0))
    neighbour_gap = (images[..., 1:] - images[..., :-1]).abs().mean()
    real = shapes.test_set("photo", 1, seed=0).images
    real_gap = (real[..., 1:] - real[..., :-1]).abs().mean()
    assert neighbour_gap < 3 * real_gap, (float(neighbour_gap), float(real_gap))

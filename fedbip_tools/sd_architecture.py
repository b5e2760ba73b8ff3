"""Stable Diffusion v1-4's architecture, built from its published configs (no weights).

``models/sd-v1-4-architecture/`` holds the four configs diffusers and transformers publish for
``CompVis/stable-diffusion-v1-4`` (UNet2DConditionModel, AutoencoderKL, CLIP ViT-L/14's text
model, the PNDM scheduler). Built with random weights and CLIP's real BPE tokenizer
(:mod:`fedbip_tools.clip_bpe`), they give a diffusers folder that runs exactly the shapes, FLOPs
and memory of the real model: what the CPU proof at 512 px (BENCHMARKS.md) runs. Speed and
shapes do not depend on the weights; images do, so nothing it synthesizes means anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel

from fedbip_flwr.ldm import LDM, fingerprint_of

from .clip_bpe import clip_tokenizer

CONFIG_DIR = Path(__file__).resolve().parents[1] / "models" / "sd-v1-4-architecture"

# Published parameter counts of SD v1-4's parts (the original LDM code logs the UNet as
# "859.52 M params"; the VAE and CLIP ViT-L/14's text tower are 83.65 M and 123.06 M).
PUBLISHED_PARAMETERS = {"unet": 859_520_964, "vae": 83_653_863, "text_encoder": 123_060_480}


def configs(folder: str | Path = CONFIG_DIR) -> dict[str, dict]:
    """The committed configs: {"unet", "vae", "text_encoder", "scheduler"} -> dict."""
    folder = Path(folder)
    files = {
        "unet": "unet/config.json",
        "vae": "vae/config.json",
        "text_encoder": "text_encoder/config.json",
        "scheduler": "scheduler/scheduler_config.json",
    }
    return {part: json.loads((folder / name).read_text()) for part, name in files.items()}


def _init_args(config: dict) -> dict:
    """A diffusers config without its bookkeeping keys (``_class_name``, ...)."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def build_modules(
    cfgs: dict[str, dict] | None = None,
) -> tuple[UNet2DConditionModel, AutoencoderKL, CLIPTextModel, PNDMScheduler]:
    """UNet, VAE, text encoder (randomly initialised) and scheduler from the configs.

    Call under ``accelerate.init_empty_weights()`` to get them on the meta device (no memory).
    """
    cfgs = cfgs or configs()
    unet = UNet2DConditionModel(**_init_args(cfgs["unet"]))
    vae = AutoencoderKL(**_init_args(cfgs["vae"]))
    text = CLIPTextModel(CLIPTextConfig(**cfgs["text_encoder"]))
    # from_config: the published file also carries keys PNDM ignores (clip_sample).
    scheduler = PNDMScheduler.from_config(cfgs["scheduler"])
    return unet, vae, text, scheduler


def parameter_counts(unet, vae, text) -> dict[str, int]:
    return {
        name: sum(p.numel() for p in module.parameters())
        for name, module in (("unet", unet), ("vae", vae), ("text_encoder", text))
    }


def build_random_sd(seed: int = 0, cfgs: dict[str, dict] | None = None) -> LDM:
    """SD v1-4's architecture with seeded random weights and CLIP's real tokenizer (~4 GB fp32)."""
    torch.manual_seed(seed)
    unet, vae, text, scheduler = build_modules(cfgs)
    tokenizer = clip_tokenizer()
    ldm = LDM(vae, unet, text, tokenizer, scheduler, fingerprint_of(vae, unet, text, scheduler))
    return ldm.freeze()

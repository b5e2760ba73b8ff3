"""Small latent diffusion models of Stable Diffusion's architecture family, built with random
weights from a spec: the tests' tiny model and the miniature's starting point
(scripts/pretrain_miniature.py). Saved with :meth:`~fedbip_flwr.ldm.LDM.save`, they load through
:func:`~fedbip_flwr.ldm.load_ldm` as real weights do."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from fedbip_flwr.ldm import LDM, SD_SCHEDULER_CONFIG, SPECIAL_TOKENS, fingerprint_of


@dataclass(frozen=True)
class LDMSpec:
    """Architecture of a small Stable-Diffusion-family model (all parts diffusers classes)."""

    image_size: int = 32
    vae_channels: tuple[int, ...] = (8, 16)
    unet_channels: tuple[int, ...] = (16, 32)
    text_hidden: int = 32
    text_layers: int = 1
    text_heads: int = 2
    max_length: int = 16
    attention_head_dim: int = 8
    prediction_type: str = "epsilon"  # v_prediction: an SD 2.x-style model


TINY = LDMSpec()
MINIATURE = LDMSpec(
    image_size=64,
    vae_channels=(16, 32, 64),
    unet_channels=(32, 64, 128),
    text_hidden=64,
    text_layers=2,
    text_heads=2,
    max_length=16,
    attention_head_dim=16,
)


def build_tokenizer(words: Iterable[str], max_length: int) -> CLIPTokenizer:
    """A word-level CLIP BPE tokenizer: each word is one token, any other text still encodes.

    Letters stay in the vocabulary, so unknown words split into characters instead of failing.
    Merges are chained per word; a merge from one word can pre-empt another word's chain, so
    extra merges are appended until every word tokenizes to exactly one token.
    """
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab: dict[str, int] = {}
    for token in [*SPECIAL_TOKENS, *letters, *(c + "</w>" for c in letters)]:
        vocab.setdefault(token, len(vocab))
    merges: list[tuple[str, str]] = []
    words = sorted({w.lower() for w in words if w.isalpha() and w.isascii() and len(w) > 1})
    for word in words:
        pieces = [*word[:-1], word[-1] + "</w>"]
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            if pair not in merges:
                merges.append(pair)
                vocab.setdefault("".join(pair), len(vocab))
            pieces = ["".join(pair), *pieces[2:]]
    for _ in range(8):
        tokenizer = _clip_tokenizer(vocab, merges, max_length)
        broken = {w: tokenizer.tokenize(w) for w in words if len(tokenizer.tokenize(w)) > 1}
        if not broken:
            return tokenizer
        for pieces in broken.values():
            while len(pieces) > 1:
                pair = (pieces[0], pieces[1])
                merges.append(pair)
                vocab.setdefault("".join(pair), len(vocab))
                pieces = ["".join(pair), *pieces[2:]]
    raise RuntimeError(f"could not make single-token words of {sorted(broken)}")


def _clip_tokenizer(vocab: dict[str, int], merges: list, max_length: int) -> CLIPTokenizer:
    return CLIPTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=max_length)


def grow_vocabulary(ldm: LDM, words: Iterable[str]) -> LDM:
    """``ldm`` with a tokenizer for ``words`` as well as its own, for resuming pretraining on
    captions with new words: every token it had keeps its learned embedding (matched by its
    text, since ids move), a new token starts as the text encoder initialises one."""
    old = ldm.tokenizer.get_vocab()
    known = [token.removesuffix("</w>") for token in old if token.endswith("</w>")]
    tokenizer = build_tokenizer([*known, *words], ldm.tokenizer.model_max_length)
    if tokenizer.get_vocab() == old:
        return ldm
    text = copy.deepcopy(ldm.text_encoder)  # ``ldm`` stays as it was
    table = text.get_input_embeddings().weight.detach()
    std = text.config.initializer_range * text.config.initializer_factor
    grown = torch.randn(len(tokenizer), table.shape[1]) * std
    for token, index in tokenizer.get_vocab().items():
        if token in old:
            grown[index] = table[old[token]]
    text.resize_token_embeddings(len(tokenizer), mean_resizing=False)  # special ids stay first
    text.get_input_embeddings().weight.data.copy_(grown)
    return LDM(
        ldm.vae,
        ldm.unet,
        text,
        tokenizer,
        ldm.scheduler,
        fingerprint_of(ldm.vae, ldm.unet, text, ldm.scheduler),
    ).freeze()


def build_ldm(spec: LDMSpec, words: Iterable[str], seed: int = 0) -> LDM:
    """A randomly initialised LDM of the SD architecture family (for tests and pretraining)."""
    torch.manual_seed(seed)
    n_vae = len(spec.vae_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n_vae,
        up_block_types=("UpDecoderBlock2D",) * n_vae,
        block_out_channels=spec.vae_channels,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=min(8, spec.vae_channels[0]),
        sample_size=spec.image_size,
        mid_block_add_attention=False,
    )
    n_unet = len(spec.unet_channels)
    unet = UNet2DConditionModel(
        sample_size=spec.image_size // 2 ** (n_vae - 1),
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (n_unet - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (n_unet - 1) + ("UpBlock2D",),
        block_out_channels=spec.unet_channels,
        layers_per_block=1,
        cross_attention_dim=spec.text_hidden,
        attention_head_dim=spec.attention_head_dim,
        norm_num_groups=min(8, spec.unet_channels[0]),
    )
    tokenizer = build_tokenizer(words, spec.max_length)
    text = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=spec.text_hidden,
            intermediate_size=spec.text_hidden * 4,
            num_hidden_layers=spec.text_layers,
            num_attention_heads=spec.text_heads,
            max_position_embeddings=spec.max_length,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    sched = PNDMScheduler(**SD_SCHEDULER_CONFIG, prediction_type=spec.prediction_type)
    return LDM(vae, unet, text, tokenizer, sched, fingerprint_of(vae, unet, text, sched)).freeze()

"""The frozen latent diffusion model: loading (hub id or diffusers folder).

Every run, from the 2-core CPU tests to Stable Diffusion v1-4 on a GPU, loads its model through
:func:`load_ldm`. Small models are built by :mod:`fedbip_tools.build_ldm` (random init) and
saved in the diffusers folder layout, so tests exercise exactly the path that real weights take.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .paths import resolve

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

# Stable Diffusion v1-x scheduler settings: the noise schedule that z(T) and synthesis share.
SD_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "skip_prk_steps": True,
    "steps_offset": 1,
    "set_alpha_to_one": False,
}
SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>")
# What the UNet predicts: concept learning's target and PNDM's step both follow it.
PREDICTION_TYPES = ("epsilon", "v_prediction")


class ModelLoadError(RuntimeError):
    """The base model cannot be loaded; the message says what to set or install."""


@dataclass
class LDM:
    """The four frozen parts of a latent diffusion model plus its noise scheduler."""

    vae: AutoencoderKL
    unet: UNet2DConditionModel
    text_encoder: CLIPTextModel
    tokenizer: CLIPTokenizer
    scheduler: PNDMScheduler
    fingerprint: str
    # Compute dtype of sampling under autocast (weights unchanged): bfloat16 on a CPU with bf16
    # instructions when ldm.half-precision is on (load_for_run); None = the weights' own dtype.
    autocast: torch.dtype | None = None
    compiled: bool = False  # the UNet is torch.compile'd (run config ldm.compile-unet)

    def batch_bucket(self, batch_size: int) -> int | None:
        """The batch size every UNet call is padded to: the full batch when the UNet is
        compiled (one graph for all batches), else none."""
        return batch_size if self.compiled else None

    def sampling_precision(self) -> contextlib.AbstractContextManager:
        """The context every no-grad sampling call (UNet, VAE decode) runs in."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    @property
    def device(self) -> torch.device:
        return self.unet.device

    @property
    def dtype(self) -> torch.dtype:
        return self.unet.dtype

    @property
    def concept_dim(self) -> int:
        """d_w: width of a token embedding (= text hidden size for CLIP)."""
        return int(self.text_encoder.config.hidden_size)

    @property
    def image_size(self) -> int:
        return int(self.vae.config.sample_size)

    def latent_shape(self, image_size: int | None = None) -> tuple[int, int, int]:
        """(C, H, W) of z for an image of ``image_size`` pixels (VAE downsampling factor)."""
        return vae_latent_shape(self.vae.config, image_size or self.image_size)

    def freeze(self) -> LDM:
        """FedBiP never updates the LDM: no gradients, eval mode."""
        for module in (self.vae, self.unet, self.text_encoder):
            module.requires_grad_(False)
            module.eval()
        return self

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> LDM:
        for module in (self.vae, self.unet, self.text_encoder):
            # a dtype the module already has is not passed: diffusers warns on any dtype given
            # to to() ("modules ... should be kept in float32: []"), even where none must be
            cast = dtype is not None and dtype != module.dtype
            module.to(device=device, **({"dtype": dtype} if cast else {}))
        return self

    def save(self, folder: str | Path) -> Path:
        """Write the diffusers folder layout (safetensors weights) that :func:`load_ldm` reads."""
        folder = Path(folder)
        self.vae.save_pretrained(folder / "vae")
        self.unet.save_pretrained(folder / "unet")
        self.text_encoder.save_pretrained(folder / "text_encoder")
        self.tokenizer.save_pretrained(folder / "tokenizer")
        self.scheduler.save_pretrained(folder / "scheduler")
        _write_model_index(folder)
        return folder


def vae_latent_shape(config: Mapping[str, Any], image_size: int) -> tuple[int, int, int]:
    """(C, H, W) of the latent a VAE of ``config`` gives an image of ``image_size`` pixels."""
    factor = 2 ** (len(config["block_out_channels"]) - 1)
    return (int(config["latent_channels"]), image_size // factor, image_size // factor)


def configured_latent_shape(model: str, image_size: int) -> tuple[int, int, int]:
    """The latent shape of the run config's ``ldm.model`` (a folder, or a hub id in the local cache)
    at ``image_size``, read from its VAE's config alone: no weight is loaded."""
    from diffusers import AutoencoderKL

    local = resolve(model)
    try:
        config = AutoencoderKL.load_config(
            str(local) if local.exists() else model, subfolder="vae", local_files_only=True
        )
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"Could not read the VAE config of the base model '{model}': {err}"
        ) from None
    return vae_latent_shape(config, image_size)


def _write_model_index(folder: Path) -> None:
    """model_index.json lets ``StableDiffusionPipeline.from_pretrained(folder)`` load it too."""
    index = {
        "_class_name": "StableDiffusionPipeline",
        "_diffusers_version": "0.42.1",
        "feature_extractor": [None, None],
        "requires_safety_checker": False,
        "safety_checker": [None, None],
        "image_encoder": [None, None],
        "scheduler": ["diffusers", "PNDMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))


def fingerprint(parts: Iterable[torch.Tensor]) -> str:
    """Short hash of identifying weights: client and server must share one base model.

    Concepts learned against one text encoder are meaningless under another, so the payload
    carries this and the server refuses a mismatch. Hashing all of SD's 1B parameters would take
    seconds; the token-embedding table, the outer UNet/VAE convs and the noise schedule
    (alphas_cumprod) identify a checkpoint. Configs are left out on purpose: saving and loading
    adds bookkeeping keys to them without changing the model.
    """
    digest = hashlib.sha256()
    for tensor in parts:
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def fingerprint_of(
    vae: AutoencoderKL, unet: UNet2DConditionModel, text: CLIPTextModel, sched: PNDMScheduler
) -> str:
    modules = [text.get_input_embeddings(), unet.conv_in, unet.conv_out, vae.decoder.conv_out]
    tensors = [p for m in modules for p in m.parameters()] + [sched.alphas_cumprod]
    return fingerprint(tensors)


def load_ldm(source: str | Path, *, allow_download: bool = True) -> LDM:
    """Load VAE, UNet, CLIP text encoder, tokenizer and PNDM scheduler (float32, frozen).

    ``source`` is a hub id (``CompVis/stable-diffusion-v1-4``) or a local diffusers folder.
    The scheduler is always PNDM (the paper's sampler) built from the model's scheduler config.
    """
    from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer
    from transformers.utils import logging as transformers_logging

    source = str(source)
    local = Path(source).expanduser()
    if (
        local.exists()
        and not (local / "model_index.json").exists()
        and not (local / "unet").is_dir()
    ):
        raise ModelLoadError(
            f"'{source}' is a folder but not a diffusers model folder (no unet/ or "
            "model_index.json); point run config 'ldm.model' at one."
        )
    if not local.exists() and (local.is_absolute() or source.startswith((".", "~"))):
        raise ModelLoadError(
            f"The model folder '{source}' does not exist; set run config 'ldm.model'."
        )
    path = str(local) if local.exists() else source
    kwargs = {"local_files_only": not allow_download} if not local.exists() else {}
    if local.exists():  # nothing downloads: transformers' bar per load says nothing
        transformers_logging.disable_progress_bar()
    try:
        vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **kwargs)
        unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", **kwargs)
        text = CLIPTextModel.from_pretrained(path, subfolder="text_encoder", **kwargs)
        tokenizer = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **kwargs)
        sched_cfg = PNDMScheduler.load_config(path, subfolder="scheduler", **kwargs)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"Could not load the base model '{source}': it is not a local diffusers folder "
            "and is not in the Hugging Face cache (or the hub is unreachable). Set run config "
            "'ldm.model' to a local folder, or download it once with network access "
            f"({type(err).__name__}: {str(err).splitlines()[0][:200]})."
        ) from None
    sched = PNDMScheduler.from_config({**sched_cfg, "skip_prk_steps": True})
    check_prediction_type(sched, source)
    ldm = LDM(vae, unet, text, tokenizer, sched, fingerprint_of(vae, unet, text, sched))
    return ldm.freeze()


def check_prediction_type(scheduler: PNDMScheduler, source: str) -> None:
    """Refuse a model whose UNet predicts something FedBiP cannot train or sample against."""
    kind = scheduler.config.prediction_type
    if kind not in PREDICTION_TYPES:
        raise ModelLoadError(
            f"The base model '{source}' predicts '{kind}' (scheduler prediction_type), but "
            f"FedBiP trains and samples only {' or '.join(PREDICTION_TYPES)} models."
        )


# --- runtime --------------------------------------------------------------------------------


CPU_MAX_IMAGE_SIZE = 256  # at and above this, a run is SD-sized: refused on a CPU
# "I know it takes hours: run the SD-sized model on this CPU anyway" (the 512-px CPU proof in
# BENCHMARKS.md). An environment variable, not a run-config key: whether a machine may spend
# hours is the machine owner's call, and every process of a federation (SuperLink, SuperNodes,
# their apps) inherits it from the shell that starts it.
ALLOW_CPU_ENV = "FEDBIP_ALLOW_SD_ON_CPU"


def cpu_full_size_allowed() -> bool:
    return os.environ.get(ALLOW_CPU_ENV, "").strip().lower() in ("1", "true", "yes")


def select_device(choice: str) -> torch.device:
    """``auto`` takes CUDA when present; asking for CUDA without one is an error, not a fallback."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError('run config ldm.device = "cuda" but no CUDA device is visible')
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def release_cached_memory(device: torch.device) -> tuple[int, int] | None:
    """Hand PyTorch's cached but unused CUDA blocks back to the card: CUDA bytes reserved
    before and after, or None off CUDA.

    A client's step leaves the activations and optimiser state of concept learning in the
    caching allocator's pool; a Ray actor of a one-GPU-box simulation lives on after its step,
    so without this the pool stays reserved while the ServerApp synthesizes on the same card.
    What is still referenced (the actor's frozen LDM, kept for its next client) stays.
    """
    if device.type != "cuda":
        return None
    before = torch.cuda.memory_reserved(device)
    gc.collect()  # reference cycles can hold tensors past their last use
    torch.cuda.empty_cache()
    return before, torch.cuda.memory_reserved(device)


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX) in the kernels torch
    runs here: only then is bf16 autocast faster than float32 rather than an emulation.

    ``ATEN_CPU_CAPABILITY=avx2`` and ``ONEDNN_MAX_CPU_ISA=AVX2`` cap torch's and oneDNN's
    kernels at AVX2 (the README's test section runs the suite so, as an AVX2 machine would):
    then bf16 is emulated, and a run takes float32 as such a machine does."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    native = any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))
    return (
        native
        and torch.backends.cpu.get_cpu_capability() == "AVX512"
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def load_for_run(
    model: str,
    device_choice: str | torch.device,
    half_precision: bool,
    image_size: int,
    *,
    channels_last: bool = False,
    compile_unet: bool = False,
) -> LDM:
    """Resolve the run config's model (local folder or hub id) and place it on the device.

    The device is checked before any weight is read: a Stable Diffusion-sized run on a CPU
    would take days, so it stops at once with what to do, unless the environment sets
    ``FEDBIP_ALLOW_SD_ON_CPU=1`` (tiny federations at 512 px, to prove the full-size path).

    ``half_precision``: on CUDA the frozen LDM's weights are fp16; on a CPU with bf16
    instructions the weights stay float32 and sampling (UNet, VAE decode) runs under bfloat16
    autocast (speed and judged fidelity against float32: the speed benchmark in BENCHMARKS.md).
    Concept learning keeps its float32 gradients on the CPU either way. ``channels_last`` and
    ``compile_unet`` (``torch.compile``) are optional UNet speed-ups, measured there too.
    ``device_choice`` is the run config's ``ldm.device``, or a device already chosen (accelerate's,
    in `fedbip synthesize`).
    """
    device = (
        device_choice if isinstance(device_choice, torch.device) else select_device(device_choice)
    )
    if device.type == "cpu" and image_size >= CPU_MAX_IMAGE_SIZE and not cpu_full_size_allowed():
        raise ModelLoadError(
            f"data.image-size {image_size} is a Stable Diffusion-sized run and needs a CUDA GPU, "
            "but this machine has none: run it where a GPU is visible, or use the miniature model "
            f"(the default config) on the CPU (or set {ALLOW_CPU_ENV}=1 to spend the hours anyway)"
        )
    local = resolve(model)
    ldm = load_ldm(local if local.exists() else model)
    dtype = torch.float16 if device.type == "cuda" and half_precision else torch.float32
    ldm.to(device, dtype)
    if device.type == "cpu" and half_precision and cpu_has_bf16():
        ldm.autocast = torch.bfloat16
    if channels_last:
        ldm.unet.to(memory_format=torch.channels_last)
    if compile_unet:
        # In place: the module keeps its type, config and device. Inductor's freezing was
        # measured and left out: on an AVX2 CPU it gave 1.26x against plain compile's 1.25x
        # for twice the compile time (docs/benchmarks/speed.md).
        ldm.unet.compile()
        ldm.compiled = True
    return ldm

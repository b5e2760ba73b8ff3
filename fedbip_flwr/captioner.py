"""Captioners: the frozen image-to-text model OSCAR's clients run on their private images.

:func:`load_captioner` takes the run config's ``captioner`` (a local folder or a hub id):

- a folder holding the **miniature captioner** (``config.json`` with ``model_type``
  :data:`MINIATURE_TYPE`): a small CNN image encoder and GRU decoder over the miniature LDM's
  tokenizer, trained once on that LDM's own pretraining corpus and captions
  (``scripts/train_captioner.py``). It knows only that corpus's words, as BLIP knows only its
  own; it stands in for BLIP where no captioner can be downloaded.
- anything else: a **BLIP** captioning model through transformers
  (``BlipForConditionalGeneration`` + ``BlipProcessor``, e.g.
  ``Salesforce/blip-image-captioning-base``), as in OSCAR's paper.

Both sample captions (nucleus sampling, as OSCAR's code does) from the client's own
generator, so the captions, like every other draw a client makes, stay the client's.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

from .ldm import ModelLoadError, fingerprint
from .paths import resolve
from .viz import to_uint8

if TYPE_CHECKING:
    from transformers import BlipForConditionalGeneration, BlipProcessor, CLIPTokenizer

MINIATURE_TYPE = "fedbip-miniature-captioner"
WEIGHTS = "model.safetensors"


class Captioner(ABC):
    """A frozen captioner: images in [-1, 1] -> one sampled caption per image."""

    name: str  # what the upload's metadata records: the hub id or the folder's name
    fingerprint: str  # short hash of identifying weights

    @abstractmethod
    def caption(self, images: torch.Tensor, generator: torch.Generator) -> list[str]:
        """One caption per image of ``images`` (N, 3, H, W) in [-1, 1], sampled with
        ``generator`` (the same generator state gives the same captions)."""


def load_captioner(source: str, device: torch.device | str = "cpu") -> Captioner:
    """The run config's ``captioner``: a relative folder resolves like ``ldm.model`` does."""
    local = resolve(source)
    label = Path(source).name if Path(source).is_absolute() else source  # no institution paths
    config = local / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == MINIATURE_TYPE:
        return MiniatureCaptioner.load(local, label).to(device)
    from transformers import BlipForConditionalGeneration, BlipProcessor

    try:
        path = str(local) if local.exists() else source
        model = BlipForConditionalGeneration.from_pretrained(path)
        processor = BlipProcessor.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"Could not load the captioner '{source}': it is neither the miniature captioner's "
            "folder nor a BLIP captioning model (local folder, or hub id in the cache or "
            f"reachable); set run config 'captioner' ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]})."
        ) from None
    return BlipCaptioner(model, processor, label).to(device)


# --- BLIP (the paper's captioner) ------------------------------------------------------------


class BlipCaptioner(Captioner):
    """BLIP image captioning, sampled as BLIP's own ``generate(sample=True)`` does."""

    TOP_P = 0.9
    MAX_LENGTH = 30
    MIN_LENGTH = 10
    REPETITION_PENALTY = 1.1
    BATCH_SIZE = 16

    def __init__(self, model: BlipForConditionalGeneration, processor: BlipProcessor, name: str):
        self.model = model.eval().requires_grad_(False)
        self.processor = processor
        self.name = name
        vision = model.vision_model.embeddings.patch_embedding.weight
        self.fingerprint = fingerprint([model.get_input_embeddings().weight, vision])

    def to(self, device: torch.device | str) -> BlipCaptioner:
        self.model.to(device)
        return self

    @torch.no_grad()
    def caption(self, images: torch.Tensor, generator: torch.Generator) -> list[str]:
        """transformers' sampling draws from torch's global generator: it is seeded from the
        client's generator inside a forked RNG state, which leaves the global state as it was."""
        seed = int(torch.randint(0, 2**62, (), generator=generator))
        device = self.model.device
        pixels = list(to_uint8(images))
        captions: list[str] = []
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            for start in range(0, len(pixels), self.BATCH_SIZE):
                inputs = self.processor(
                    images=pixels[start : start + self.BATCH_SIZE], return_tensors="pt"
                )
                ids = self.model.generate(
                    pixel_values=inputs.pixel_values.to(device, self.model.dtype),
                    do_sample=True,
                    top_p=self.TOP_P,
                    max_length=self.MAX_LENGTH,
                    min_length=self.MIN_LENGTH,
                    repetition_penalty=self.REPETITION_PENALTY,
                )
                captions += [
                    c.strip() for c in self.processor.batch_decode(ids, skip_special_tokens=True)
                ]
        return captions


# --- the miniature stand-in ------------------------------------------------------------------


@dataclass(frozen=True)
class MiniatureConfig:
    """The miniature captioner's architecture and its sampling settings (``config.json``)."""

    vocab_size: int
    max_length: int  # tokens per caption, start and end included (the tokenizer's)
    bos_token_id: int
    eos_token_id: int
    image_size: int = 64
    channels: tuple[int, ...] = (16, 32, 64, 64)
    embed_dim: int = 32
    hidden_dim: int = 128
    top_p: float = 0.9
    temperature: float = 1.0


class MeanMaxPool(nn.Module):
    """Global mean and max of every channel: the max keeps thin strokes (quickdraw) that the
    mean of a mostly white image washes out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.mean((2, 3)), x.amax((2, 3))], 1)


class MiniatureCaptionNet(nn.Module):
    """CNN image encoder (strided convs with BatchNorm, global pooling) -> a GRU decoder that
    sees the image feature at every step and starts from it."""

    def __init__(self, cfg: MiniatureConfig):
        super().__init__()
        self.cfg = cfg
        layers: list[nn.Module] = []
        width = 3
        for channels in cfg.channels:
            layers += [
                nn.Conv2d(width, channels, 3, stride=2, padding=1),
                nn.BatchNorm2d(channels),
                nn.SiLU(),
                nn.Conv2d(channels, channels, 3, padding=1),
                nn.BatchNorm2d(channels),
                nn.SiLU(),
            ]
            width = channels
        self.encoder = nn.Sequential(*layers, MeanMaxPool(), nn.Linear(2 * width, cfg.hidden_dim))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.embed_dim)
        self.gru = nn.GRU(cfg.embed_dim + cfg.hidden_dim, cfg.hidden_dim, batch_first=True)
        self.head = nn.Linear(cfg.hidden_dim, cfg.vocab_size)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """(N, hidden) from images in [-1, 1] at any size (resized to the captioner's)."""
        size = self.cfg.image_size
        if images.shape[-1] != size or images.shape[-2] != size:
            images = F.interpolate(
                images, size=(size, size), mode="bilinear", antialias=True, align_corners=False
            )
        return self.encoder(images)

    def step(
        self, features: torch.Tensor, tokens: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-token logits (N, T, V) after ``tokens`` (N, T), and the GRU state."""
        if state is None:
            state = torch.tanh(features)[None]
        inputs = torch.cat(
            [self.embed(tokens), features[:, None].expand(-1, tokens.shape[1], -1)], -1
        )
        out, state = self.gru(inputs, state)
        return self.head(out), state

    def loss(self, images: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced cross-entropy over each caption's words and its end token."""
        logits, _ = self.step(self.features(images), ids[:, :-1])
        targets = ids[:, 1:].clone()
        targets[(targets == self.cfg.eos_token_id).cumsum(1) > 1] = -100  # padding after the end
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    @torch.no_grad()
    def sample(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """(N, max_length) token ids, start token first, nucleus-sampled until each caption's
        end token (everything after it is the end token too)."""
        cfg = self.cfg
        features = self.features(images)
        ids = torch.full((len(images), cfg.max_length), cfg.eos_token_id, dtype=torch.int64)
        ids[:, 0] = cfg.bos_token_id
        done = torch.zeros(len(images), dtype=torch.bool)
        state = None
        for t in range(1, cfg.max_length):
            logits, state = self.step(features, ids[:, t - 1 : t].to(features.device), state)
            probs = nucleus(logits[:, -1].float().cpu() / cfg.temperature, cfg.top_p)
            token = torch.multinomial(probs, 1, generator=generator)[:, 0]
            ids[:, t] = torch.where(done, cfg.eos_token_id, token)
            done |= token == cfg.eos_token_id
            if bool(done.all()):
                break
        return ids


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Probabilities restricted to the smallest set of tokens holding ``top_p`` of the mass."""
    probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # mass before it already enough
    sorted_probs[outside] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


class MiniatureCaptioner(Captioner):
    """The miniature captioner with its tokenizer (the miniature LDM's own)."""

    def __init__(self, net: MiniatureCaptionNet, tokenizer: CLIPTokenizer, name: str):
        self.net = net.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name

    @property
    def fingerprint(self) -> str:  # type: ignore[override]
        return fingerprint(self.net.state_dict().values())

    @classmethod
    def build(cls, tokenizer: CLIPTokenizer, **architecture: object) -> MiniatureCaptioner:
        """A randomly initialised captioner over ``tokenizer``'s vocabulary (for training)."""
        cfg = MiniatureConfig(
            vocab_size=len(tokenizer),
            max_length=int(tokenizer.model_max_length),
            bos_token_id=int(tokenizer.bos_token_id),
            eos_token_id=int(tokenizer.eos_token_id),
            **architecture,  # type: ignore[arg-type]
        )
        return cls(MiniatureCaptionNet(cfg), tokenizer, MINIATURE_TYPE)

    @classmethod
    def load(cls, folder: Path, name: str) -> MiniatureCaptioner:
        from transformers import CLIPTokenizer

        values = json.loads((folder / "config.json").read_text())
        values.pop("model_type")
        values["channels"] = tuple(values["channels"])
        net = MiniatureCaptionNet(MiniatureConfig(**values))
        net.load_state_dict(safetensors.torch.load_file(folder / WEIGHTS))
        return cls(net, CLIPTokenizer.from_pretrained(folder / "tokenizer"), name)

    def save(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        config = {"model_type": MINIATURE_TYPE, **asdict(self.net.cfg)}
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        safetensors.torch.save_file(
            {k: v.contiguous() for k, v in self.net.state_dict().items()}, folder / WEIGHTS
        )
        self.tokenizer.save_pretrained(folder / "tokenizer")
        return folder

    def to(self, device: torch.device | str) -> MiniatureCaptioner:
        self.net.to(device)
        return self

    def token_ids(self, captions: list[str]) -> torch.Tensor:
        """(N, max_length) ids of captions as training targets: start, words, end, end..."""
        return self.tokenizer(
            captions,
            padding="max_length",
            max_length=self.net.cfg.max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids

    def caption(self, images: torch.Tensor, generator: torch.Generator) -> list[str]:
        device = next(self.net.parameters()).device
        ids = self.net.sample(images.to(device, torch.float32), generator)
        return [c.strip() for c in self.tokenizer.batch_decode(ids, skip_special_tokens=True)]

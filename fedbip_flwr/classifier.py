"""The global classifier (paper eq. 6): ResNet-18 trained on the synthetic set only.

SGD (lr 0.01, momentum 0.9), batch 64, cross-entropy. Inputs are images in [-1, 1] (the
authors normalise with mean = std = 0.5), resized to ``image_size``. Light augmentation (random
crop with padding, horizontal flip) keeps small synthetic sets from collapsing to one class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from safetensors.torch import load as load_safetensors
from torch import nn

from .storage import write_tensors
from .viz import dequantize, quantize


class ClassifierInitError(RuntimeError):
    """ImageNet weights were asked for but cannot be had; the message says what to set."""


IMAGENET_WEIGHTS = torchvision.models.ResNet18_Weights.IMAGENET1K_V1


def imagenet_weights_path() -> Path:
    """Where torchvision looks for the ResNet-18 ImageNet weights: $TORCH_HOME/hub/checkpoints."""
    return Path(torch.hub.get_dir()) / "checkpoints" / IMAGENET_WEIGHTS.url.rsplit("/", 1)[-1]


def check_classifier_init(init: str) -> None:
    """Fail at start-up, not hours later after synthesis, when ImageNet weights cannot be had.

    Looks in the torch hub cache only: nothing is downloaded and no model is built.
    """
    path = imagenet_weights_path()
    if init == "imagenet" and not path.is_file():
        raise ClassifierInitError(
            f"classifier-init = \"imagenet\" needs the ResNet-18 ImageNet weights at {path} "
            f"(torch's hub cache, $TORCH_HOME/hub/checkpoints), which is missing: download "
            f"{IMAGENET_WEIGHTS.url} there once where the network is reachable, or set run "
            "config classifier-init = \"random\"."
        )


def build_classifier(num_classes: int, init: str = "imagenet") -> nn.Module:
    """ResNet-18 with a fresh ``num_classes`` head; ImageNet-initialised unless ``random``."""
    weights = IMAGENET_WEIGHTS if init == "imagenet" else None
    try:
        model = torchvision.models.resnet18(weights=weights)
    except (OSError, RuntimeError) as err:  # URLError is an OSError
        raise ClassifierInitError(
            "ResNet-18 ImageNet weights are not in the torch hub cache and cannot be "
            "downloaded here; set run config classifier-init = \"random\" or copy "
            f"{weights.url.rsplit('/', 1)[-1]} into $TORCH_HOME/hub/checkpoints ({err})."
        ) from None
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    return model


@dataclass(frozen=True)
class TrainSettings:
    epochs: int
    lr: float
    momentum: float
    batch_size: int
    image_size: int
    augment: bool = True


def _prepare(images: torch.Tensor, size: int) -> torch.Tensor:
    """Model input, float in [-1, 1] at ``size``, from float or uint8 images (one batch at a time).

    Synthetic sets stay uint8 until a batch needs them: at 512 px a paper-sized FedBiP-L set
    would take tens of GB as float32.
    """
    images = dequantize(images) if images.dtype == torch.uint8 else images.float()
    if images.shape[-1] == size:
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", antialias=True)


def shrink(images: torch.Tensor, size: int, chunk: int = 256) -> torch.Tensor:
    """uint8 images no larger than the classifier's input, to hold a big synthetic set in memory."""
    if images.shape[-1] <= size:
        return images
    return torch.cat([quantize(_prepare(part, size)) for part in images.split(chunk)])


def _augment(batch: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random 1/8-padded crop and horizontal flip, per image."""
    n, _, h, w = batch.shape
    pad = max(1, h // 8)
    padded = F.pad(batch, (pad, pad, pad, pad), mode="replicate")
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    out = torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(n)])
    out[flip] = out[flip].flip(-1)
    return out


def train_classifier(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    settings: TrainSettings,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    on_epoch: Callable[[int, float], None] | None = None,
) -> nn.Module:
    """Train in place on (images, labels) and return the model in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model.to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=settings.momentum)
    # BatchNorm cannot train on a batch of one: drop a last batch of size 1.
    for epoch in range(settings.epochs):
        order = torch.randperm(len(labels), generator=generator)
        total, seen = 0.0, 0
        for batch in order.split(settings.batch_size):
            if len(batch) < 2:
                continue
            x = _prepare(images[batch], settings.image_size)
            x = _augment(x, generator) if settings.augment else x
            loss = F.cross_entropy(model(x.to(device)), labels[batch].to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total, seen = total + loss.item() * len(batch), seen + len(batch)
        if on_epoch is not None:
            on_epoch(epoch, total / max(seen, 1))
    return model.eval()


@dataclass(frozen=True)
class Evaluation:
    accuracy: float
    mean_loss: float  # cross-entropy: the membership-inference gap compares this
    mean_entropy: float  # prediction entropy: likewise
    predictions: torch.Tensor


@torch.no_grad()
def evaluate(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    image_size: int,
    *,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
) -> Evaluation:
    """Accuracy, mean loss and mean prediction entropy on a labelled set."""
    model.to(device).eval()
    logits = torch.cat(
        [model(_prepare(b, image_size).to(device)).float().cpu() for b in images.split(batch_size)]
    )
    log_p = logits.log_softmax(-1)
    predictions = logits.argmax(-1)
    return Evaluation(
        accuracy=float((predictions == labels).float().mean()),
        mean_loss=float(F.nll_loss(log_p, labels)),
        mean_entropy=float(-(log_p.exp() * log_p).sum(-1).mean()),
        predictions=predictions,
    )


def save_classifier(model: nn.Module, path: str | Path, metadata: dict[str, str]) -> Path:
    """Weights as safetensors (never pickle), with the class names etc. in the header."""
    return write_tensors(path, dict(model.state_dict()), metadata)


def load_classifier_bytes(blob: bytes, class_names: list[str]) -> nn.Module:
    """The ResNet-18 the server sent back (safetensors bytes, never pickle), for these classes.

    Every tensor name and shape must be the architecture's own: ``load_state_dict`` is strict.
    """
    state = load_safetensors(bytes(blob))
    model = build_classifier(len(class_names), "random")
    model.load_state_dict(state, strict=True)
    return model.eval()

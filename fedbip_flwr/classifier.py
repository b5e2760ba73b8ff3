"""The global classifier (paper eq. 6): ResNet-18 trained on the synthetic set only.

SGD (lr 0.01, momentum 0.9; constant, or cosine-annealed to 0), batch 64, cross-entropy.
Inputs are images in [-1, 1] (the authors normalise with mean = std = 0.5), resized to
``image_size``. Light augmentation (random crop with padding, horizontal flip) keeps small
synthetic sets from collapsing to one class.
A :class:`Distillation` (FedLMG's MD / SD) adds a divergence to a teacher's soft targets on the
same augmented batch; everything else about the recipe stays the same.

``classifier.init`` picks the starting weights: ``imagenet`` (torchvision's, as the paper's SD
configurations use), ``random``, or ``pretrained``: the ResNet-18 backbone shipped inside the
base model's folder (``<model>/classifier-backbone/model.safetensors``, made by
``scripts/pretrain_backbone.py`` from the model's own public pretraining corpus), which is to the
miniature LDM what ImageNet is to Stable Diffusion. Either pretrained start gets a fresh head.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load as load_safetensors
from torch import nn
from torch.optim.swa_utils import update_bn
from torch.utils.data import DataLoader, Dataset

from . import ldm
from .config import LearningRateSchedule
from .paths import resolve
from .storage import read_small_tensor, read_tensors, tensor_location, write_tensors
from .viz import dequantize, quantize

if TYPE_CHECKING:
    import torchvision


class ClassifierInitError(RuntimeError):
    """ImageNet weights were asked for but cannot be had; the message says what to set."""


PrecisionMode = Literal["auto", "float32"]


def imagenet_weights() -> torchvision.models.ResNet18_Weights:
    """torchvision's ResNet-18 ImageNet weights (IMAGENET1K_V1): ``classifier.init = imagenet``."""
    import torchvision

    return torchvision.models.ResNet18_Weights.IMAGENET1K_V1


def imagenet_weights_path() -> Path:
    """Where torchvision looks for the ResNet-18 ImageNet weights: $TORCH_HOME/hub/checkpoints."""
    return Path(torch.hub.get_dir()) / "checkpoints" / imagenet_weights().url.rsplit("/", 1)[-1]


# The backbone a base model ships for classifier.init = "pretrained", inside its folder.
BACKBONE_DIR = "classifier-backbone"
BACKBONE_FILE = "model.safetensors"
BACKBONE_SCRIPT = "scripts/pretrain_backbone.py"


def backbone_path(model: str | Path) -> Path:
    """Where the run config's ``ldm.model`` keeps its classifier backbone; a relative folder
    resolves as the LDM's does (:func:`fedbip_flwr.paths.resolve`)."""
    return resolve(model) / BACKBONE_DIR / BACKBONE_FILE


def _missing_backbone(path: Path) -> ClassifierInitError:
    return ClassifierInitError(
        f'classifier.init = "pretrained" needs the ResNet-18 backbone shipped with the base '
        f"model at {path}, which is missing: make it with `python {BACKBONE_SCRIPT} --out "
        f"{path.parent}` (trained on the miniature LDM's public pretraining corpus) or set run "
        'config classifier.init = "imagenet" or "random".'
    )


def check_classifier_init(init: str, model: str | Path = "") -> None:
    """Fail at start-up, not hours later after synthesis, when the initial weights cannot be had.

    Looks in the torch hub cache (``imagenet``) or the base ``model``'s folder (``pretrained``)
    only: nothing is downloaded and no model is built, and torchvision (1.5 s to import, before
    the server's first message) is imported only to name the ImageNet weights' file.
    """
    if init == "imagenet" and not (path := imagenet_weights_path()).is_file():
        raise ClassifierInitError(
            f'classifier.init = "imagenet" needs the ResNet-18 ImageNet weights at {path} '
            f"(torch's hub cache, $TORCH_HOME/hub/checkpoints), which is missing: download "
            f"{imagenet_weights().url} there once where the network is reachable, or set run "
            'config classifier.init = "random".'
        )
    if init == "pretrained" and not backbone_path(model).is_file():
        raise _missing_backbone(backbone_path(model))


def save_backbone(
    model: nn.Module, folder: str | Path, metadata: dict[str, str] | None = None
) -> Path:
    """The whole ResNet-18 state dict (its ``fc`` for the classes it was trained on) as
    ``folder/model.safetensors``: floating tensors in float16 (about 23 MB), BatchNorm's
    batch counts as they are."""
    state = {
        name: t.half() if t.is_floating_point() else t for name, t in model.state_dict().items()
    }
    return write_tensors(Path(folder) / BACKBONE_FILE, state, metadata)


def load_backbone(path: str | Path) -> nn.Module:
    """A ResNet-18 with the backbone's weights (float16 -> float32) and its own ``fc``."""
    import torchvision

    path = Path(path)
    if not path.is_file():
        raise _missing_backbone(path)
    state = {
        name: t.float() if t.is_floating_point() else t for name, t in read_tensors(path).items()
    }
    if "fc.weight" not in state:
        raise ClassifierInitError(f"{path} holds no ResNet-18 state dict (no fc.weight)")
    model = torchvision.models.resnet18(num_classes=state["fc.weight"].shape[0])
    model.load_state_dict(state, strict=True)
    return model


def build_classifier(num_classes: int, init: str = "imagenet", model: str | Path = "") -> nn.Module:
    """ResNet-18 with a fresh ``num_classes`` head: ImageNet-initialised (``imagenet``), from
    the backbone shipped with the base ``model`` (``pretrained``: :func:`backbone_path`), or
    ``random``."""
    import torchvision

    if init == "pretrained":
        net = load_backbone(backbone_path(model))
        net.fc = nn.Linear(net.fc.in_features, num_classes)
        return net
    weights = imagenet_weights() if init == "imagenet" else None
    try:
        net = torchvision.models.resnet18(weights=weights)
    except (OSError, RuntimeError) as err:  # URLError is an OSError
        raise ClassifierInitError(
            "ResNet-18 ImageNet weights are not in the torch hub cache and cannot be "
            'downloaded here; set run config classifier.init = "random" or copy '
            f"{weights.url.rsplit('/', 1)[-1]} into $TORCH_HOME/hub/checkpoints ({err})."
        ) from None
    net.fc = nn.Linear(net.fc.in_features, num_classes)
    return net


@dataclass(frozen=True)
class TrainSettings:
    epochs: int
    lr: float
    momentum: float
    batch_size: int
    image_size: int
    augment: bool = True
    num_workers: int = 0  # DataLoader processes reading batches (0: in the training process)
    steps: int = 0  # > 0: exactly this many SGD steps, epochs as many as they take
    precision: PrecisionMode = "float32"  # "auto": half precision where the device has it
    # BatchNorm's statistics re-estimated after training (recalibrate_batchnorm)
    precise_bn: bool = False
    schedule: LearningRateSchedule = "constant"

    def epochs_for(self, n: int) -> int:
        """Epochs over ``n`` images: ``epochs``, or enough to make ``steps`` SGD steps."""
        return (
            -(-self.steps // batches_per_epoch(n, self.batch_size)) if self.steps else self.epochs
        )

    def steps_for(self, n: int) -> int:
        """SGD steps training on ``n`` images makes: ``steps``, or ``epochs`` full passes."""
        return self.steps or self.epochs * batches_per_epoch(n, self.batch_size)


def batches_per_epoch(n: int, batch_size: int) -> int:
    """SGD steps one epoch over ``n`` images makes (a last batch of one is dropped)."""
    full, rest = divmod(n, batch_size)
    return max(1, full + (rest >= 2))


@dataclass(frozen=True)
class Precision:
    """How the classifier computes. ``auto``: on CUDA channels_last and fp16 autocast with a
    GradScaler; on a CPU with native bfloat16 channels_last and bf16 autocast (no scaler: bf16
    has float32's range) at inputs where that trains soundly (:func:`cpu_bf16_trains_soundly`);
    float32 elsewhere. The ResNet's BatchNorm and the loss stay float32 under autocast, and the
    weights are float32 throughout."""

    autocast: torch.dtype | None = None
    channels_last: bool = False

    @classmethod
    def for_device(
        cls, device: torch.device | str, mode: PrecisionMode, image_size: int
    ) -> Precision:
        kind = torch.device(device).type
        if mode == "float32":
            return cls()
        if kind == "cuda":
            return cls(autocast=torch.float16, channels_last=True)
        if kind == "cpu" and ldm.cpu_has_bf16() and cpu_bf16_trains_soundly(image_size):
            return cls(autocast=torch.bfloat16, channels_last=True)
        return cls()

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format


# ResNet-18 has halved its input four times (stem conv, max-pool, layer2, layer3) when layer4's
# first, strided 3x3 convolution reads it.
_RESNET_REDUCTION_BEFORE_LAYER4 = 16


def cpu_bf16_trains_soundly(image_size: int) -> bool:
    """Whether bf16 autocast on a CPU computes the classifier's weight gradients at this input.

    oneDNN's AVX512-BF16 kernel (3.12 in torch 2.14.1, still in 3.13.3 in torch 2.15.0) gets a
    bf16 strided convolution's weight gradient wrong when that convolution's input is a single
    pixel: a tap that sees only padding comes back as whatever memory the process freed last, up
    to 1e33 or NaN and different from call to call. The forward pass, the input's gradient,
    float32, fp16 and the AVX2 kernels are right. ResNet-18's layer4 reads one pixel at inputs
    of 16 px and less (scripts/bf16_weight_gradient_check.py shows it).
    """
    return image_size > _RESNET_REDUCTION_BEFORE_LAYER4


# Soft targets: (a batch at the classifier's input, the source client id of each row) -> logits.
Teacher = Callable[[torch.Tensor, list[str]], torch.Tensor]
# KL(student || teacher), as FedLMG's eqs. 12-13 write it, or the soft cross-entropy
# -sum p_teacher log p_student (= KL(teacher || student) + a constant) of its authors' code.
Divergence = Literal["kl-student-teacher", "soft-ce"]


@dataclass(frozen=True)
class Distillation:
    """Adds ``weight * divergence(student, teacher)`` to the cross-entropy, temperature 1,
    the teacher's logits computed without gradient on the same augmented batch."""

    teacher: Teacher
    divergence: Divergence = "kl-student-teacher"
    weight: float = 1.0


def distillation_loss(
    student: torch.Tensor, teacher: torch.Tensor, divergence: Divergence
) -> torch.Tensor:
    """Batch mean of the divergence between softmax(student) and softmax(teacher) logits."""
    log_s, log_t = student.float().log_softmax(-1), teacher.float().log_softmax(-1)
    if divergence == "kl-student-teacher":
        return (log_s.exp() * (log_s - log_t)).sum(-1).mean()
    return -(log_t.exp() * log_s).sum(-1).mean()


class TensorImages(Dataset):
    """An in-memory (images, labels) set, indexed a batch at a time like :class:`ShardImages`;
    ``sources`` names each row's source client where a teacher needs it."""

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, sources: Sequence[str] | None = None
    ) -> None:
        if len(images) != len(labels) or (sources is not None and len(sources) != len(labels)):
            raise ValueError(f"{len(images)} images but {len(labels)} labels / sources")
        self.images, self.labels, self.row_sources = images, labels, sources

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[rows], self.labels[rows]

    def sources(self, rows: torch.Tensor) -> list[str]:
        if self.row_sources is None:
            raise ValueError("these images name no source client: pass sources")
        return [self.row_sources[int(r)] for r in rows]


class ShardImages(Dataset):
    """Synthetic images in uint8 safetensors shards (``images``, ``labels``), read by rows.

    Only the labels (8 bytes an image) are held; ``dataset[rows]`` reads exactly those rows'
    bytes with plain file reads (no memory map, so nothing read stays resident) and returns
    them resized to ``image_size`` (never enlarged), uint8, with their labels: at most a batch
    of images is in memory at a time, whatever the size of the synthetic set. Row ``i`` of the
    dataset is row ``i`` of the shards concatenated in the order given. ``groups`` names each
    shard's source client (default: its file stem), which :meth:`sources` tells per row.
    """

    def __init__(
        self, paths: Sequence[str | Path], image_size: int, groups: Sequence[str] | None = None
    ) -> None:
        self.paths = [str(p) for p in paths]
        self.groups = list(groups) if groups is not None else [Path(p).stem for p in self.paths]
        if len(self.groups) != len(self.paths):
            raise ValueError(f"{len(self.paths)} shards but {len(self.groups)} group names")
        self.image_size = image_size
        self.offsets: list[int] = []
        counts, shapes, labels = [], set(), []
        for path in self.paths:
            offset, dtype, shape = tensor_location(path, "images")
            if dtype != "U8" or len(shape) != 4:
                raise ValueError(f"{path}: images must be uint8 (N, C, H, W), not {dtype} {shape}")
            labels.append(read_small_tensor(path, "labels"))
            if len(labels[-1]) != shape[0]:
                raise ValueError(f"{path}: {shape[0]} images but {len(labels[-1])} labels")
            self.offsets.append(offset)
            counts.append(shape[0])
            shapes.add(tuple(shape[1:]))
        if len(shapes) > 1:
            raise ValueError(f"shards of different image shapes: {sorted(shapes)}")
        self.row_shape = shapes.pop() if shapes else (3, image_size, image_size)
        self.labels = torch.cat(labels) if labels else torch.empty(0, dtype=torch.long)
        self.starts = torch.tensor([0, *counts]).cumsum(0)

    def __len__(self) -> int:
        return len(self.labels)

    def _shards(self, rows: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, the shard index of each), rows checked to lie in the dataset."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows outside 0..{len(self) - 1}")
        return rows, torch.searchsorted(self.starts[1:], rows, right=True)

    def sources(self, rows: torch.Tensor | Sequence[int]) -> list[str]:
        """The source client (shard group) of each row, from the offsets alone: no file read."""
        return [self.groups[i] for i in self._shards(rows)[1].tolist()]

    def read(self, rows: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """The rows as stored (uint8, the LDM's size), in the order asked."""
        rows, shard = self._shards(rows)
        out = torch.empty((len(rows), *self.row_shape), dtype=torch.uint8)
        row_bytes = out[0].numel() if len(rows) else 0
        for index in shard.unique().tolist():
            mine = torch.nonzero(shard == index).flatten().tolist()
            fd = os.open(self.paths[index], os.O_RDONLY)
            try:
                for slot in mine:
                    local = int(rows[slot] - self.starts[index])
                    at = self.offsets[index] + local * row_bytes
                    if os.preadv(fd, [out[slot].numpy()], at) != row_bytes:
                        raise OSError(f"{self.paths[index]}: short read at byte {at}")
            finally:
                os.close(fd)
        return out

    def __getitem__(self, rows: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        return shrink(self.read(rows), self.image_size), self.labels[rows]


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


def fit_to_classifier(images: torch.Tensor, size: int, chunk: int = 256) -> torch.Tensor:
    """A (test) set held at the classifier's input size instead of the LDM's: uint8 stays
    uint8 (:func:`shrink`), floats are resized as :func:`evaluate` would, so scores are unchanged."""
    if images.dtype == torch.uint8 or images.shape[-1] <= size:
        return shrink(images, size, chunk)
    return torch.cat([_prepare(part, size) for part in images.split(chunk)])


def _augment(batch: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random 1/8-padded crop (edge pixels replicated) and horizontal flip, per image.

    One gather over the whole batch, on the batch's device: replicate padding is a clamped
    index, a flip a reversed one. The draws (``dy``, ``dx``, then ``flip``, from the CPU
    ``generator``) and so the result are those of a crop-then-flip loop over the images.
    Returns (N, C, H, W) with channels-last strides.
    """
    n, _, h, w = batch.shape
    pad = max(1, h // 8)
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    rows = (dy[:, None] + torch.arange(h) - pad).clamp(0, h - 1)
    cols = (dx[:, None] + torch.arange(w) - pad).clamp(0, w - 1)
    cols = torch.where(flip[:, None], cols.flip(-1), cols)
    device = batch.device
    picked = batch.permute(0, 2, 3, 1)[
        torch.arange(n, device=device)[:, None, None],
        rows.to(device)[:, :, None],
        cols.to(device)[:, None, :],
    ]
    return picked.permute(0, 3, 1, 2)


def _train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    precision: Precision,
    distillation: Distillation | None = None,
    sources: list[str] | None = None,
) -> torch.Tensor:
    """One SGD step (autocast and loss scaling where ``precision`` says); the loss, float32.

    With ``distillation``, the teacher scores the same (augmented) ``x`` whose rows came from
    ``sources``, and its divergence joins the cross-entropy."""
    with torch.autocast(
        x.device.type,
        dtype=precision.autocast or torch.float32,
        enabled=precision.autocast is not None,
    ):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        if distillation is not None:
            with torch.no_grad():
                target = distillation.teacher(x, sources or [])
            loss = loss + distillation.weight * distillation_loss(
                logits, target, distillation.divergence
            )
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach().float()


def train_classifier(
    model: nn.Module,
    images: torch.Tensor | Dataset,
    labels: torch.Tensor | None,
    settings: TrainSettings,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    on_epoch: Callable[[int, float], None] | None = None,
    precision: Precision | None = None,
    distillation: Distillation | None = None,
) -> nn.Module:
    """Train in place and return the model in eval mode.

    ``images`` is a tensor with its ``labels``, or a dataset indexed by a batch of rows that
    returns (images, labels) (:class:`ShardImages`, with ``labels`` None): batches are read
    through a DataLoader, so a synthetic set on disk is never whole in memory. The data order
    and the augmentation draws come from one generator seeded with ``seed``, in the same
    sequence whatever the data source. ``settings.schedule`` "cosine" anneals the learning rate
    to 0 over exactly the steps training makes. ``precision`` defaults to ``settings.precision`` on
    ``device``. With
    ``settings.steps`` training stops after exactly that many steps, so methods whose training
    sets differ in size get the same budget. ``distillation`` needs a dataset that names each
    row's source client (``sources(rows)``).
    """
    data = images if labels is None else TensorImages(images, labels)
    device = torch.device(device)
    precision = precision or Precision.for_device(device, settings.precision, settings.image_size)
    if (
        device.type == "cpu"
        and precision.autocast == torch.bfloat16
        and not cpu_bf16_trains_soundly(settings.image_size)
    ):
        raise ValueError(
            f"bf16 autocast on the CPU computes wrong weight gradients at {settings.image_size} "
            "px (cpu_bf16_trains_soundly): train at "
            f"{_RESNET_REDUCTION_BEFORE_LAYER4 + 1} px or more, or in float32"
        )
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model.to(device, memory_format=precision.memory_format).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=settings.momentum)
    scaler = torch.amp.GradScaler(device.type, enabled=precision.autocast == torch.float16)
    annealing = (
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, settings.steps_for(len(data)))
        if settings.schedule == "cosine"
        else None
    )
    steps_left = settings.steps or None
    for epoch in range(settings.epochs_for(len(data))):
        order = torch.randperm(len(data), generator=generator)
        # BatchNorm cannot train on a batch of one: drop a last batch of size 1.
        batches = [batch for batch in order.split(settings.batch_size) if len(batch) >= 2]
        if steps_left is not None:
            batches, steps_left = batches[:steps_left], steps_left - len(batches[:steps_left])
        loader = DataLoader(
            data,
            sampler=batches,
            batch_size=None,
            num_workers=settings.num_workers,
            pin_memory=device.type == "cuda",
        )
        total, seen = 0.0, 0
        for rows, (x, y) in zip(batches, loader, strict=True):  # the loader keeps this order
            x = _prepare(x.to(device, non_blocking=True), settings.image_size)
            x = _augment(x, generator) if settings.augment else x
            x = x.contiguous(memory_format=precision.memory_format)
            sources = data.sources(rows) if distillation is not None else None
            loss = _train_step(
                model, optimizer, scaler, x, y.to(device), precision, distillation, sources
            )
            if annealing is not None:
                annealing.step()
            total, seen = total + loss.item() * len(y), seen + len(y)
        if on_epoch is not None:
            on_epoch(epoch, total / max(seen, 1))
    if settings.precise_bn:
        recalibrate_batchnorm(model, data, settings, device, precision, generator)
    return model.eval()


def recalibrate_batchnorm(
    model: nn.Module,
    data: Dataset,
    settings: TrainSettings,
    device: torch.device,
    precision: Precision,
    generator: torch.Generator,
) -> None:
    """Precise BatchNorm (Wu and Johnson, "Rethinking 'Batch' in BatchNorm", 2021): every
    BatchNorm's statistics re-estimated with the final weights over the whole training set,
    unaugmented, in shuffled batches of the training size (torch's ``update_bn``).

    The running averages training leaves behind weigh the last ten or so batches, seen by
    weights that have moved since and augmented; on the default federation they put a
    classifier's rare-domain test images at chance on some runs (docs/benchmarks/default-run.md,
    "The classifier's BatchNorm statistics")."""
    order = torch.randperm(len(data), generator=generator)
    batches = [batch for batch in order.split(settings.batch_size) if len(batch) >= 2]
    if not batches:  # nothing to estimate from: update_bn would leave the reset statistics
        return
    loader = DataLoader(data, sampler=batches, batch_size=None, num_workers=settings.num_workers)
    inputs = (
        _prepare(x.to(device), settings.image_size).contiguous(
            memory_format=precision.memory_format
        )
        for x, _ in loader
    )
    with torch.autocast(
        device.type,
        dtype=precision.autocast or torch.float32,
        enabled=precision.autocast is not None,
    ):
        update_bn(inputs, model)


@dataclass(frozen=True)
class Evaluation:
    accuracy: float
    mean_loss: float  # cross-entropy: the membership-inference gap compares this
    mean_entropy: float  # prediction entropy: likewise
    predictions: torch.Tensor
    losses: torch.Tensor  # per example: what a loss-threshold membership attack thresholds


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
    losses = F.nll_loss(log_p, labels, reduction="none")
    return Evaluation(
        accuracy=float((predictions == labels).float().mean()),
        mean_loss=float(losses.mean()),
        mean_entropy=float(-(log_p.exp() * log_p).sum(-1).mean()),
        predictions=predictions,
        losses=losses,
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

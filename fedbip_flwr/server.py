"""The server's whole job after the one round: uploads -> training set -> classifier -> metrics.

Plain library code over a run folder; the Flower strategy only collects the replies and hands
each to the run's method (:mod:`fedbip_flwr.methods`), whose training set is written as shards
(:func:`keyed_shard`), then :func:`train_global` and, where
the server holds test data, :func:`evaluate_on_server`.
Everything accepted is on disk before any heavy work, synthesis is written in shards (one per
client and pass), and a restart over the same folder resumes from what is there.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .classifier import (
    Distillation,
    ShardImages,
    TrainSettings,
    build_classifier,
    evaluate,
    save_classifier,
    train_classifier,
)
from .config import ClassifierConfig, FedBiPConfig
from .progress import Progress
from .storage import read_metadata, write_json, write_tensors_streamed
from .upload import PayloadError
from .viz import image_grid, quantize

log = logging.getLogger(__name__)
SHARD_KEY = "fedbip.shard-key"


@dataclass(frozen=True)
class RunFolder:
    """Where one run keeps everything: payloads/, shards/, metrics.json, classifier, PNGs."""

    root: Path

    @property
    def payloads(self) -> Path:
        return self.root / "payloads"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def clients(self) -> Path:
        """Outcome of the one round; its presence means the round is complete."""
        return self.root / "clients.json"

    @property
    def classifier(self) -> Path:
        return self.root / "classifier.safetensors"

    @property
    def training_set(self) -> Path:
        """The shards the classifier trained on, per client (shards/ may hold more)."""
        return self.root / "training-set.json"

    @property
    def config(self) -> Path:
        """The run config, written when the ServerApp starts: what `fedbip synthesize` (a process
        outside the ServerApp) redoes the server's synthesis from."""
        return self.root / "config.json"

    @property
    def uploaders(self) -> Path:
        """Which node uploaded which client id: written as each upload is accepted."""
        return self.root / "uploaders.json"

    def payload_path(self, client_id: str) -> Path:
        return self.payloads / f"{client_id}.safetensors"

    def shard_path(self, client_id: str, pass_index: int) -> Path:
        return self.shards / f"{client_id}-pass{pass_index}.safetensors"

    def grid_path(self, client_id: str) -> Path:
        return self.root / f"grid-{client_id}.png"

    def write_training_set(self, shards: Mapping[str, Sequence[Path]]) -> Path:
        """Record the shards the classifier trains on, per client (:attr:`training_set`)."""
        return write_json(self.training_set, {c: [p.name for p in ps] for c, ps in shards.items()})

    def training_shards(self) -> dict[str, list[Path]]:
        """The shards the classifier trained on, per client, as :attr:`training_set` lists
        them; OSError where the run never recorded one."""
        listed = json.loads(self.training_set.read_text())
        return {client: [self.shards / name for name in names] for client, names in listed.items()}

    def persisted_payloads(self) -> dict[str, Path]:
        """Payloads already accepted by an earlier (interrupted) run, by client id."""
        return {p.stem: p for p in sorted(self.payloads.glob("*.safetensors"))}


@dataclass(frozen=True)
class WorkUnit:
    """One piece of a run's training set that any process can make on its own.

    Its shards are keyed and written atomically (:func:`keyed_shard`), so which process makes a
    unit, when, and how often changes no byte: units can be spread over GPUs and machines.
    """

    client_id: str
    index: int  # FedBiP: the pass; 0 where one unit is a client's whole training set
    images: int  # how many images it writes: what a split over processes balances


class ShardMode(enum.Enum):
    """What :func:`keyed_shard` does with a shard that is not on disk under its key."""

    MAKE = "make"  # compute and write it
    # Raise ShardPending: a method's own shard-making code run in this mode checks that every
    # shard it would write is on disk under its key, without a second implementation of any key.
    CHECK = "check"


class ShardPending(Exception):
    """A shard that :attr:`ShardMode.CHECK` found missing (or made under another key)."""


def keyed_shard(
    path: Path,
    key: str,
    labels: torch.Tensor,
    batches: Callable[[], Iterable[torch.Tensor]],
    *,
    mode: ShardMode,
    on_reuse: Callable[[int], None] | None = None,
) -> Path:
    """A training-set shard: reused when the file on disk was made under ``key``, else written
    from ``batches()`` (images in [-1, 1], in label order) as uint8, batch by batch, atomically.

    ``key`` digests everything the pixels depend on, so a restart with another seed or setting
    recomputes instead of silently mixing two configurations. Every method's training set goes
    through here. Under :attr:`ShardMode.CHECK` nothing is written or reported:
    :class:`ShardPending` where the shard would be made.
    """
    if read_metadata(path).get(SHARD_KEY) == key:
        if mode is ShardMode.CHECK:
            return path
        log.info("%s reused", path.name)
        if on_reuse is not None:
            on_reuse(len(labels))
        return path
    if mode is ShardMode.CHECK:
        raise ShardPending(path)
    if path.exists():
        log.warning("%s was made under other settings; redoing it", path)
    quantized = (quantize(images) for images in batches())
    first = next(quantized)
    shape = (len(labels), *first.shape[1:])
    write_tensors_streamed(
        path,
        {"labels": labels.to(torch.int64)},
        ("images", torch.uint8, shape),
        itertools.chain([first], quantized),
        {SHARD_KEY: key},
    )
    log.debug("%s written (%d images)", path.name, len(labels))
    return path


def shard_key(knobs: tuple, *inputs: torch.Tensor) -> str:
    """The key of a shard (:func:`keyed_shard`): sha256 of everything its pixels depend on, its
    ``knobs`` (settings, seeds, digests; by ``repr``) and every byte of its input tensors
    (floating ones as float32). Every method keys its shards with it, so a changed input or
    setting can never reuse an old shard."""
    digest = hashlib.sha256(repr(knobs).encode())
    for tensor in inputs:
        tensor = tensor.detach().cpu().contiguous()
        digest.update((tensor.float() if tensor.is_floating_point() else tensor).numpy().tobytes())
    return digest.hexdigest()


def synthetic_dataset(synthetic: Mapping[str, Sequence[Path]], image_size: int) -> ShardImages:
    """All clients' shards as one dataset (clients in name order), read at ``image_size``; each
    row's source client is its shard's key in ``synthetic``."""
    shards = [(client_id, p) for client_id, paths in sorted(synthetic.items()) for p in paths]
    return ShardImages([p for _, p in shards], image_size, groups=[c for c, _ in shards])


def class_columns(labels: torch.Tensor, classes: int, per_class: int) -> torch.Tensor:
    """Rows of the first ``per_class`` images of each class, class by class: a grid's
    columns, so that rows picked from two sets line up class for class (a class with fewer
    images fills what it has)."""
    return torch.cat(
        [torch.nonzero(labels == c).flatten()[:per_class] for c in range(classes)]
    ).long()


def synthetic_by_class(paths: Sequence[Path], classes: int, per_class: int) -> torch.Tensor:
    """A client's synthetic images as stored, ``per_class`` of each class in class order."""
    shards = ShardImages(paths, image_size=0)
    return shards.read(class_columns(shards.labels, classes, per_class))


def train_global(
    cfg: FedBiPConfig,
    synthetic: Mapping[str, Sequence[Path]],
    class_names: list[str],
    folder: RunFolder,
    device: torch.device | str,
    distillation: Distillation | None = None,
) -> tuple[nn.Module, dict]:
    """Train ResNet-18 on the pooled synthetic set (eq. 6), save it; (model, training facts).

    ``synthetic`` is a method's shards per client (its ``train_set``): they are read a batch
    at a time, so memory does not grow with the synthetic set. ``distillation`` (the method's
    :meth:`~fedbip_flwr.methods.base.Method.teacher`) adds soft targets to the same recipe.
    """
    data = synthetic_dataset(synthetic, cfg.classifier.image_size)
    settings = train_settings(cfg.classifier)
    started = time.perf_counter()
    # The initial weights come from the global RNG: seed it here, or they would depend on
    # whatever ran before in this process (e.g. how much synthesis a resumed run still did).
    torch.manual_seed(cfg.seed)
    model = build_classifier(len(class_names), cfg.classifier.init, cfg.ldm.model)
    losses: list[float] = []
    progress = Progress(log, "classifier", settings.epochs_for(len(data)), "epochs")

    def on_epoch(_epoch: int, loss: float) -> None:
        losses.append(loss)
        progress.update(note=f"loss {loss:.3f}")

    train_classifier(
        model,
        data,
        None,
        settings,
        seed=cfg.seed,
        device=device,
        on_epoch=on_epoch,
        distillation=distillation,
    )
    progress.finish(
        f"{settings.steps_for(len(data))} SGD steps on {len(data)} images, "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    )
    save_classifier(model, folder.classifier, {"class_names": ",".join(class_names)})
    return model, {
        "num_synthetic_images": len(data),
        "classifier_seconds": time.perf_counter() - started,
        "epoch_loss": losses,
    }


def train_settings(classifier: ClassifierConfig, epochs: int | None = None) -> TrainSettings:
    """The shared classifier recipe from the run config's classifier table: the global
    classifier's epochs and step budget, or ``epochs`` of a client's own training (Local,
    FedLMG, FedAvg's rounds)."""
    return TrainSettings(
        epochs=classifier.epochs if epochs is None else epochs,
        lr=classifier.lr,
        momentum=classifier.momentum,
        batch_size=classifier.batch_size,
        image_size=classifier.image_size,
        steps=classifier.steps if epochs is None else 0,
        precision=classifier.precision,
        precise_bn=classifier.precise_bn,
        schedule=classifier.schedule,
    )


def evaluate_on_server(
    model: nn.Module,
    test_sets: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    image_size: int,
    device: torch.device | str,
) -> dict:
    """Accuracy per domain on test sets the server holds (simulations, paper presets), and mean.

    Hold them at the classifier's size (:func:`fedbip_flwr.classifier.fit_to_classifier`): the
    scores are the same and the memory that of the classifier's input, not the LDM's."""
    per_domain = {}
    for domain, (x, y) in sorted(test_sets.items()):
        result = evaluate(model, x, y, image_size, device=device)
        per_domain[domain] = result.accuracy
        if result.predictions.unique().numel() == 1:
            log.warning("the classifier predicts one class for every %s image", domain)
    mean = sum(per_domain.values()) / len(per_domain) if per_domain else float("nan")
    log.info(
        "accuracy on the server's test sets: %s",
        ", ".join(f"{d} {100 * a:.1f}%" for d, a in per_domain.items()),
    )
    return {"per_domain": per_domain, "mean": mean}


def evaluate_models(
    models: Mapping[str, nn.Module],
    test_sets: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    image_size: int,
    device: torch.device | str,
) -> dict:
    """:func:`evaluate_on_server` for one global classifier; for several (Local: one per
    client) each is scored on every domain and the per-domain accuracies averaged over them."""
    scores = {
        name: evaluate_on_server(m, test_sets, image_size, device) for name, m in models.items()
    }
    if len(scores) == 1:
        return next(iter(scores.values()))
    per_domain = {
        domain: sum(s["per_domain"][domain] for s in scores.values()) / len(scores)
        for domain in test_sets
    }
    mean = sum(per_domain.values()) / len(per_domain) if per_domain else float("nan")
    return {"per_domain": per_domain, "mean": mean, "per_model": scores}


def load_persisted(
    folder: RunFolder, accept: Callable[[bytes], Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Uploads accepted before a restart, through the method's ``accept`` again, by client id;
    and why each one that no longer passes (a server whose checks grew stricter) is refused:
    it is recorded, never a reason for the restart to stop."""
    accepted, refused = {}, {}
    for client_id, path in folder.persisted_payloads().items():
        try:
            accepted[client_id] = accept(path.read_bytes())
        except PayloadError as err:
            refused[client_id] = f"its upload on disk no longer passes the server's checks: {err}"
    return accepted, refused


def save_grid(
    folder: RunFolder, client_id: str, real: torch.Tensor | None, synthetic: torch.Tensor
) -> Path:
    """PNG for a person: real images of the client's domain (where the server has them, as in
    a simulation) above its synthetic ones, both in the same class order (:func:`class_columns`)
    so each real image stands above synthetic ones of its class."""
    rows, labels = ([real], ["real"]) if real is not None else ([], [])
    return image_grid(
        [*rows, synthetic],
        folder.grid_path(client_id),
        row_labels=[*labels, "synthetic"],
        columns=len(synthetic),
    )

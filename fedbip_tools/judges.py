"""Fidelity judges for the miniature shapes world: does a synthetic image show its class, and
its client's domain?

Two ResNet-18s are trained on real images of all five domains (a split no benchmark seed uses):
one names the class, one the domain. Class fidelity is the share of a method's synthetic images
judged as the class they were made for; domain fidelity the share judged as the client's domain.
Together they say what a method's images lack where accuracy alone cannot (FedBiP's Figure 1
asks the same question). Used by the methods benchmark and the speed benchmark's check that
faster sampling draws the same images.
"""

from __future__ import annotations

import functools
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fedbip_flwr import shapes
from fedbip_flwr.classifier import (
    Precision,
    ShardImages,
    TensorImages,
    TrainSettings,
    build_classifier,
    evaluate,
    recalibrate_batchnorm,
    train_classifier,
)
from fedbip_flwr.results import FIDELITY_FILE, Fidelity, JudgedImages, read_clients
from fedbip_flwr.server import RunFolder
from fedbip_flwr.storage import read_tensors, write_json, write_tensors

log = logging.getLogger(__name__)
JUDGE_SEED = 1000  # the judges' own real images: no benchmark seed's client or test set
KINDS = ("classes", "domains")


@dataclass(frozen=True)
class Judges:
    classes: nn.Module
    domains: nn.Module
    size: int

    def fidelity(self, images: torch.Tensor, labels: torch.Tensor, domain: str) -> dict[str, float]:
        """Class and domain fidelity of images (float in [-1, 1] or uint8) made for ``labels``
        in ``domain``."""
        domain_labels = torch.full_like(labels, shapes.DOMAINS.index(domain))
        return {
            "class": evaluate(self.classes, images, labels, self.size).accuracy,
            "domain": evaluate(self.domains, images, domain_labels, self.size).accuracy,
        }

    def on_real(self, per_class: int = 20) -> dict[str, float]:
        """Their accuracy on held-out real images of every domain: is the judge any good?"""
        sets = [shapes.test_set(d, per_class, JUDGE_SEED + 1, self.size) for d in shapes.DOMAINS]
        scores = [self.fidelity(s.images, s.labels, s.domain) for s in sets]
        return {k: statistics.fmean(score[k] for score in scores) for k in ("class", "domain")}

    @functools.cached_property
    def accuracy_on_real(self) -> dict[str, float]:
        """:meth:`on_real` computed once: every result these judges judge records it."""
        return self.on_real()


def load_judges(path: Path, size: int = 64, per_class: int = 40, epochs: int = 30) -> Judges:
    """The judges saved at ``path``, or trained on real images of every domain and saved there;
    either way with precise BatchNorm statistics re-estimated over those images. The statistics
    training leaves behind depend on the machine's float32: on one AVX2 EPYC they put the class
    judge at 89.3% on held-out real images, re-estimated at 97.5% (BENCHMARKS.md)."""
    models = {
        "classes": build_classifier(len(shapes.CLASSES), "random"),
        "domains": build_classifier(len(shapes.DOMAINS), "random"),
    }
    sets = [shapes.test_set(d, per_class, JUDGE_SEED, size) for d in shapes.DOMAINS]
    images = torch.cat([s.images for s in sets])
    targets = {
        "classes": torch.cat([s.labels for s in sets]),
        "domains": torch.cat([torch.full_like(s.labels, i) for i, s in enumerate(sets)]),
    }
    settings = TrainSettings(epochs, 0.01, 0.9, 64, size)
    if path.exists():
        weights = read_tensors(path)
        for kind, model in models.items():
            prefix = f"{kind}."
            model.load_state_dict(
                {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
            )
    else:
        for kind, model in models.items():
            log.info("training the %s judge on %d real images", kind, len(images))
            train_classifier(model, images, targets[kind], settings, seed=JUDGE_SEED)
        write_tensors(
            path, {f"{k}.{n}": t for k, m in models.items() for n, t in m.state_dict().items()}
        )
    for kind, model in models.items():  # loaded as trained: a file saved without them gets them
        recalibrate_batchnorm(
            model,
            TensorImages(images, targets[kind]),
            settings,
            torch.device("cpu"),
            Precision(),
            torch.Generator().manual_seed(JUDGE_SEED),
        )
    return Judges(models["classes"].eval(), models["domains"].eval(), size)


def judge_run(folder: RunFolder, judges: Judges, judges_path: Path) -> Fidelity:
    """Class and domain fidelity of a finished run's synthetic training set, per domain: each
    client's shards under the domain ``clients.json`` records for it (clients of one domain
    together). ValueError for a domain the judges do not know (they exist for the shapes world)."""
    domains = {c.client_id: c.domain for c in read_clients(folder.clients)}
    images: dict[str, list[torch.Tensor]] = {}
    labels: dict[str, list[torch.Tensor]] = {}
    for client_id, paths in sorted(folder.training_shards().items()):
        domain = domains.get(client_id, "")
        if domain not in shapes.DOMAINS:
            raise ValueError(
                f"client {client_id!r}'s domain {domain!r} is none of the shapes world's "
                f"({', '.join(shapes.DOMAINS)}): the judges know those only"
            )
        data = ShardImages(paths, judges.size)
        batch, batch_labels = data[torch.arange(len(data))]
        images.setdefault(domain, []).append(batch)
        labels.setdefault(domain, []).append(batch_labels)
    per_domain = {}
    for domain in sorted(images):
        all_images, all_labels = torch.cat(images[domain]), torch.cat(labels[domain])
        score = judges.fidelity(all_images, all_labels, domain)
        per_domain[domain] = JudgedImages(
            class_fidelity=score["class"], domain_fidelity=score["domain"], images=len(all_labels)
        )
    return Fidelity(judges=str(judges_path), per_domain=per_domain)


def write_fidelity(fidelity: Fidelity, run_dir: str | Path) -> Path:
    """``run_dir/fidelity.json``, which the run's report.md shows beside its accuracy."""
    return write_json(Path(run_dir) / FIDELITY_FILE, fidelity.model_dump())

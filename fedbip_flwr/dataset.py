"""The one entry point the apps use for data, whatever ``dataset`` the run config names.

``shapes`` (the default) is generated in memory by :mod:`fedbip_flwr.shapes`, exactly as
before. The paper's datasets are indexed from ``data-root`` by :mod:`fedbip_flwr.folders` and
divided by :mod:`fedbip_flwr.partitions`:

* ``partitioning = "domain"`` (feature heterogeneity: shapes, DomainNet, PACS, OfficeHome):
  partition p holds domain ``domains[p % D]`` as that domain's client ``p // D`` with
  ``shots-per-class`` images per class, disjoint from the domain's other clients; it uploads as
  ``"<domain>-<index>"``.
* ``"dirichlet"`` / ``"iid"`` (label heterogeneity: DermaMNIST, UCM): the one domain's training
  split is divided over the SuperNode's ``num-partitions`` clients; ``"<dataset>-<p>"``.

The server scores every domain on its whole test split (``test-per-class`` sizes shapes only).
Images come as ``(N, 3, image-size, image-size)`` float32 in [-1, 1], as the VAE expects.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from . import shapes
from .config import FedBiPConfig
from .folders import Split, open_split
from .partitions import DataError, k_shots, label_partition, round_robin
from .paths import resolve
from .shapes import ImageSet
from .specs import FEATURE, SPECS, DatasetSpec

__all__ = [
    "ClientSet", "DataError", "DatasetSpec", "ImageSet",
    "class_names", "load_client_data", "load_test_sets", "verify",
]  # fmt: skip


@dataclass(frozen=True)
class ClientSet(ImageSet):
    """A client's private images and the id it uploads under."""

    client_id: str


def class_names(cfg: FedBiPConfig) -> list[str]:
    """The classifier's classes, in label order (the prompt words of Table 5)."""
    return list(SPECS[cfg.dataset].classes)


def _split(cfg: FedBiPConfig, domain: str) -> Split:
    return open_split(SPECS[cfg.dataset], resolve(cfg.data_root), domain, cfg.image_size)


def verify(cfg: FedBiPConfig) -> None:
    """Index every configured domain without decoding: missing data fails before the model loads."""
    if SPECS[cfg.dataset].layout != "generated":
        for domain in cfg.domain_list:
            _split(cfg, domain)


def load_client_data(
    cfg: FedBiPConfig, partition_id: int, num_partitions: int | None = None
) -> ClientSet:
    """The private training images of SuperNode ``partition_id`` (of ``num_partitions``)."""
    spec = SPECS[cfg.dataset]
    if cfg.partitioning == FEATURE:
        domain, index = round_robin(partition_id, cfg.domain_list)
        client_id = f"{domain}-{index}"
        if spec.layout == "generated":
            made = shapes.client_train_set(
                domain, cfg.shots_per_class, index, seed=cfg.seed, size=cfg.image_size
            )
            return ClientSet(made.images, made.labels, made.classes, domain, client_id)
        pool = _split(cfg, domain).train
        key = (cfg.seed, zlib.crc32(domain.encode()))
        where = f"{spec.name} domain '{domain}'"
        chosen = k_shots(pool.labels, spec.classes, cfg.shots_per_class, index, key, where)
    else:
        if num_partitions is None:
            raise DataError(
                f"partitioning '{cfg.partitioning}' needs the node config num-partitions"
            )
        domain, client_id = cfg.domain_list[0], f"{spec.name}-{partition_id}"
        pool = _split(cfg, domain).train
        chosen = label_partition(
            pool.labels,
            cfg.partitioning,
            cfg.dirichlet_beta,
            int(num_partitions),
            partition_id,
            cfg.seed,
        )
    images = pool.take(chosen, cfg.image_size)
    labels = torch.from_numpy(pool.labels[chosen])
    return ClientSet(images, labels, spec.classes, domain, client_id)


def _test_set(cfg: FedBiPConfig, domain: str) -> ImageSet:
    spec = SPECS[cfg.dataset]
    if spec.layout == "generated":
        return shapes.test_set(domain, cfg.test_per_class, seed=cfg.seed, size=cfg.image_size)
    pool = _split(cfg, domain).test
    images = pool.take(np.arange(len(pool)), cfg.image_size)
    return ImageSet(images, torch.from_numpy(pool.labels), spec.classes, domain)


def load_test_sets(cfg: FedBiPConfig, domains: list[str]) -> dict[str, ImageSet]:
    """Real test images per domain (for label partitions: the one global test split)."""
    return {domain: _test_set(cfg, domain) for domain in domains}

"""The one entry point the apps use for data, whatever ``data.dataset`` the run config names.

``imagefolder`` is a real institution's own folder (``<data-root>/[train|test/]<class>/<image>``)
named in its node config (``data-root``) with its domain phrase and client id; the server never
reads it.
``shapes`` (the default) is generated in memory by :mod:`fedbip_flwr.shapes`, exactly as
before. The paper's datasets are indexed from ``data.root`` by :mod:`fedbip_flwr.folders` and
divided by :mod:`fedbip_flwr.partitions`:

* ``data.partitioning = "domain"`` (feature heterogeneity: shapes, DomainNet, PACS, OfficeHome):
  partition p holds domain ``domains[p % D]`` as that domain's client ``p // D`` with
  ``data.shots-per-class`` images per class, disjoint from the domain's other clients; it uploads as
  ``"<domain>-<index>"``.
* ``"dirichlet"`` / ``"iid"`` (label heterogeneity: DermaMNIST, UCM): the one domain's training
  split is divided over the SuperNode's ``num-partitions`` clients; ``"<dataset>-<p>"``.

The server scores every domain on its whole test split (``data.test-per-class`` sizes shapes only).
Images come as ``(N, 3, data.image-size, data.image-size)`` float32 in [-1, 1], as the VAE expects.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from . import shapes
from .config import DataDescription, NodeConfig
from .folders import Split, open_split, own_folder_split
from .partitions import DataError, k_shots, label_partition, round_robin
from .paths import resolve
from .shapes import ImageSet
from .specs import FEATURE, OWN_FOLDER, SPECS, DatasetSpec

__all__ = [
    "ClientSet",
    "DataError",
    "DatasetSpec",
    "ImageSet",
    "class_names",
    "institution_data",
    "institution_test_set",
    "load_client_data",
    "load_test_sets",
    "verify",
]


@dataclass(frozen=True)
class ClientSet(ImageSet):
    """A client's private images, the id it uploads under, and how many unreadable files of
    its folder were left out (node config ``bad-images = "skip"``)."""

    client_id: str
    skipped_files: int = 0


def class_names(data: DataDescription) -> list[str]:
    """The classifier's classes, in label order (Table 5's prompt words, or the run's own)."""
    return list(data.classes)


def _own_split(data: DataDescription, node: NodeConfig) -> Split:
    if not data.data_root:
        raise DataError(
            "dataset imagefolder: set data-root to this institution's folder in its node config"
        )
    return own_folder_split(resolve(data.data_root), list(data.classes), node.bad_images)


def _identity(node: NodeConfig) -> tuple[str, str]:
    """(domain phrase, client id) an institution names for itself in its node config."""
    missing = [key for key in ("domain", "client-id") if not getattr(node, key.replace("-", "_"))]
    if missing:
        raise DataError(
            f"dataset imagefolder: set {' and '.join(missing)} in this institution's node config"
        )
    return node.domain, node.client_id


def institution_identity(data: DataDescription, node: NodeConfig) -> tuple[str, str]:
    """(domain, client id) of this node, without reading a single image."""
    if SPECS[data.dataset].layout == OWN_FOLDER:
        return _identity(node)
    if node.partition_id is None:
        raise DataError(
            f"dataset {data.dataset} assigns data by the node config's partition-id; an "
            "institution with its own folder uses dataset imagefolder"
        )
    return _partition_identity(data, node.partition_id)[:2]


def _partition_identity(data: DataDescription, partition_id: int) -> tuple[str, str, int]:
    """(domain, client id, index within the domain) of a simulated partition."""
    if data.partitioning == FEATURE:
        domain, index = round_robin(partition_id, data.domains)
        return domain, f"{domain}-{index}", index
    return data.domains[0], f"{data.dataset}-{partition_id}", partition_id


def institution_data(data: DataDescription, node: NodeConfig) -> ClientSet:
    """This node's private training images: its own folder, or its simulated partition.

    ``data`` already carries the node's own data-root (the run config merged with its node config).
    """
    domain, client_id = institution_identity(data, node)
    if SPECS[data.dataset].layout != OWN_FOLDER:
        return load_client_data(data, node.partition_id, node.num_partitions)
    split = _own_split(data, node)
    images = split.train.take(np.arange(len(split.train)), data.image_size)
    labels = torch.from_numpy(split.train.labels)
    return ClientSet(images, labels, data.classes, domain, client_id, len(split.skipped))


def institution_test_set(data: DataDescription, node: NodeConfig, domain: str) -> ImageSet:
    """The held-out images an institution scores the classifier it gets back on."""
    if SPECS[data.dataset].layout != OWN_FOLDER:
        return _test_set(data, domain)
    pool = _own_split(data, node).test
    if len(pool) == 0:
        raise DataError(f"{data.data_root} holds no held-out images to score the classifier on")
    images = pool.take(np.arange(len(pool)), data.image_size)
    return ImageSet(images, torch.from_numpy(pool.labels), data.classes, domain)


def _split(data: DataDescription, domain: str) -> Split:
    return open_split(SPECS[data.dataset], resolve(data.data_root), domain, data.image_size)


def verify(data: DataDescription) -> None:
    """Index every configured domain without decoding: missing data fails before the model loads.

    Nothing to do for generated data, nor for imagefolder: the server holds no institution's folder.
    """
    if SPECS[data.dataset].layout not in ("generated", OWN_FOLDER):
        for domain in data.domains:
            _split(data, domain)


def load_client_data(
    data: DataDescription, partition_id: int, num_partitions: int | None = None
) -> ClientSet:
    """The private training images of SuperNode ``partition_id`` (of ``num_partitions``)."""
    spec = SPECS[data.dataset]
    domain, client_id, index = _partition_identity(data, partition_id)
    if data.partitioning == FEATURE:
        if spec.layout == "generated":
            made = shapes.client_train_set(
                domain, data.shots_per_class, index, seed=data.seed, size=data.image_size
            )
            return ClientSet(made.images, made.labels, made.classes, domain, client_id)
        pool = _split(data, domain).train
        key = (data.seed, zlib.crc32(domain.encode()))
        where = f"{spec.name} domain '{domain}'"
        chosen = k_shots(pool.labels, spec.classes, data.shots_per_class, index, key, where)
    else:
        if num_partitions is None:
            raise DataError(
                f"partitioning '{data.partitioning}' needs the node config num-partitions"
            )
        pool = _split(data, domain).train
        chosen = label_partition(
            pool.labels,
            data.partitioning,
            data.dirichlet_beta,
            int(num_partitions),
            partition_id,
            data.seed,
        )
    images = pool.take(chosen, data.image_size)
    labels = torch.from_numpy(pool.labels[chosen])
    return ClientSet(images, labels, spec.classes, domain, client_id)


def _test_set(data: DataDescription, domain: str) -> ImageSet:
    spec = SPECS[data.dataset]
    if spec.layout == "generated":
        return shapes.test_set(domain, data.test_per_class, seed=data.seed, size=data.image_size)
    pool = _split(data, domain).test
    images = pool.take(np.arange(len(pool)), data.image_size)
    return ImageSet(images, torch.from_numpy(pool.labels), spec.classes, domain)


def load_test_sets(data: DataDescription, domains: list[str]) -> dict[str, ImageSet]:
    """Real test images per domain (for label partitions: the one global test split)."""
    return {domain: _test_set(data, domain) for domain in domains}

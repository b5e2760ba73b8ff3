"""Who holds which image: hold-out test splits, k-shot feature partitions, label partitions.

Everything works on label arrays only (no pixels), so partitions are cheap to compute on every
client and identical everywhere: each client recomputes the whole split from the same seed and
keeps its own part. Label heterogeneity uses Flower Datasets' partitioners; the k-shot feature
partition (the same k images per class on every client, disjoint across a domain's clients) has
no counterpart there and is a few lines here.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

# Flower Datasets' default: a Dirichlet draw that leaves a client smaller than this is redrawn.
MIN_PARTITION_SIZE = 10


class DataError(ValueError):
    """Data that is missing or too small for the requested partition; one sentence, with the fix."""


def _class_rng(key: Sequence[int], label: int) -> np.random.Generator:
    """One RNG per class, so a class's order does not depend on the other classes."""
    return np.random.default_rng(np.random.SeedSequence([*key, label]))


def round_robin(partition_id: int, domains: Sequence[str]) -> tuple[str, int]:
    """Feature heterogeneity: partition p holds ``domains[p % D]`` as that domain's client ``p // D``."""
    if partition_id < 0:
        raise DataError(f"partition-id must be >= 0, got {partition_id}")
    return domains[partition_id % len(domains)], partition_id // len(domains)


def holdout(
    labels: np.ndarray, fraction: float, key: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices with ``round(fraction * n_c)`` of each class held out for testing."""
    train, test = [], []
    for label in np.unique(labels):
        members = _class_rng(key, int(label)).permutation(np.flatnonzero(labels == label))
        cut = round(fraction * len(members))
        test.append(members[:cut])
        train.append(members[cut:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def k_shots(
    labels: np.ndarray,
    classes: Sequence[str],
    shots: int,
    client_index: int,
    key: Sequence[int],
    where: str,
) -> np.ndarray:
    """The ``client_index``-th disjoint block of ``shots`` images of every class, class-major.

    Each class's images are shuffled once per ``key``; client i takes positions
    ``[i * shots, (i + 1) * shots)``, so a domain's clients never share an image.
    """
    need = (client_index + 1) * shots
    picked = []
    for label, name in enumerate(classes):
        members = np.flatnonzero(labels == label)
        if len(members) < need:
            raise DataError(
                f"{where} class '{name}' has {len(members)} training images but client "
                f"{client_index} needs {need} ({shots} shots for each of clients 0..{client_index}); "
                "lower data.shots-per-class or use fewer SuperNodes"
            )
        picked.append(_class_rng(key, label).permutation(members)[client_index * shots : need])
    return np.concatenate(picked)


def label_partition(
    labels: np.ndarray,
    how: str,
    beta: float,
    num_partitions: int,
    partition_id: int,
    seed: int,
) -> np.ndarray:
    """Indices of partition ``partition_id`` of ``num_partitions``: Dirichlet(beta) or IID.

    Flower Datasets' ``DirichletPartitioner`` / ``IidPartitioner`` on a table of labels, shuffled
    by ``seed`` first (the IID partitioner cuts contiguous shards).
    """
    # Imported here: only the label-skew settings need Hugging Face `datasets`.
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    if not 0 <= partition_id < num_partitions:
        raise DataError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    if num_partitions > len(labels):
        raise DataError(
            f"{len(labels)} training images cannot be split over {num_partitions} clients"
        )
    table = Dataset.from_dict({"label": labels.tolist(), "index": list(range(len(labels)))})
    partitioner = (
        DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=float(beta),
            min_partition_size=MIN_PARTITION_SIZE,
            seed=seed,
        )
        if how == "dirichlet"
        else IidPartitioner(num_partitions=num_partitions)
    )
    partitioner.dataset = table.shuffle(seed=seed)
    try:
        with warnings.catch_warnings():  # each redraw warns; the outcome is what matters
            warnings.simplefilter("ignore")
            part = partitioner.load_partition(partition_id)
    except ValueError as err:
        raise DataError(
            f"Dirichlet({beta}) over {num_partitions} clients left one with fewer than "
            f"{MIN_PARTITION_SIZE} images in every draw for seed {seed} ({err}); "
            "try another seed or a larger data.dirichlet-beta"
        ) from None
    return np.asarray(part["index"], dtype=np.int64)

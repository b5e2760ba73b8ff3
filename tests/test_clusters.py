"""Sub-clusters of each class's images: agglomerative clustering of public-encoder features."""

from __future__ import annotations

import pytest
import torch

from fedbip_flwr import shapes
from fedbip_flwr.classifier import backbone_path, load_backbone
from fedbip_flwr.clusters import cluster_classes, cluster_images, effective_clusters, public_encoder
from fedbip_flwr.config import ClassifierConfig

FEATURES = 16
MODEL = "models/miniature-ldm"
# The classifier's input size, which the shipped backbone was trained at.
CLASSIFIER_SIZE = ClassifierConfig.model_fields["image_size"].default


def grouped_features(
    groups_per_class: list[int], per_group: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """Features in groups that differ in direction only: each group's points are its own random
    direction, scaled by 0.5 to 3 (so, unnormalised, a group is wider than the gap between
    groups), plus 1% noise. Returns features, labels and each point's group (unique overall)."""
    g = torch.Generator().manual_seed(seed)
    group_sizes = [per_group] * sum(groups_per_class)
    group = torch.repeat_interleave(torch.arange(len(group_sizes)), torch.tensor(group_sizes))
    labels = torch.repeat_interleave(
        torch.arange(len(groups_per_class)), torch.tensor(groups_per_class) * per_group
    )
    directions = torch.nn.functional.normalize(
        torch.randn(len(group_sizes), FEATURES, generator=g), dim=1
    )
    scale = 0.5 + 2.5 * torch.rand(len(group), 1, generator=g)
    features = scale * (directions[group] + 0.01 * torch.randn(len(group), FEATURES, generator=g))
    return features, labels, group


def same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two assignments put the same pairs of points together (ids may differ)."""
    return torch.equal(a[:, None] == a[None], b[:, None] == b[None])


def test_direction_groups_are_found_exactly():
    features, labels, group = grouped_features([3, 3], per_group=5, seed=0)
    found = cluster_classes(features, labels, clusters=3)
    # sub-cluster ids repeat across classes: pair them with the label to compare partitions
    assert same_partition(found + 3 * labels, group)


@pytest.mark.parametrize("linkage", ["ward", "average", "complete"])
def test_each_class_uses_ids_0_to_its_effective_count(linkage: str):
    features, labels, _ = grouped_features([4, 2, 3], per_group=3, seed=1)
    labels = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))]
    found = cluster_classes(features, labels, clusters=4, linkage=linkage)
    assert found.shape == labels.shape and found.dtype == torch.long
    expected = effective_clusters(labels, num_classes=3, clusters=4)
    for c, count in enumerate(expected.tolist()):
        ids = found[labels == c]
        assert torch.equal(ids.unique(), torch.arange(count))
        assert ids[0] == 0  # numbered by first appearance


def test_a_class_with_fewer_images_than_clusters_gets_one_per_image():
    features, labels, _ = grouped_features([3, 1], per_group=3, seed=2)  # 9 and 3 images
    keep = torch.cat([torch.arange(9), torch.tensor([9, 10])])  # class 1: 2 images
    found = cluster_classes(features[keep], labels[keep], clusters=4)
    assert torch.equal(found[labels[keep] == 1], torch.tensor([0, 1]))
    assert effective_clusters(labels[keep], num_classes=3, clusters=4).tolist() == [4, 2, 0]


@pytest.mark.parametrize(("linkage", "outlier_alone"), [("single", True), ("ward", False)])
def test_the_linkage_asked_for_is_used(linkage: str, outlier_alone: bool):
    """Directions 10 degrees apart from 0 to 90, and one at 125: single linkage cuts the widest
    gap (the outlier alone); Ward's criterion halves the chain instead."""
    angles = torch.deg2rad(torch.tensor([*range(0, 100, 10), 125.0]))
    features = torch.stack([angles.cos(), angles.sin()], dim=1)
    found = cluster_classes(features, torch.zeros(len(angles), dtype=torch.long), 2, linkage)
    assert ((found == found[-1]).sum().item() == 1) == outlier_alone


def test_same_input_same_output_and_image_order_does_not_change_the_partition():
    # No group structure: the tree alone decides, so a fragile implementation would show.
    features = torch.randn(30, FEATURES, generator=torch.Generator().manual_seed(3))
    labels = torch.arange(30) % 2
    found = cluster_classes(features, labels, clusters=4)
    assert torch.equal(found, cluster_classes(features, labels, clusters=4))
    order = torch.randperm(30, generator=torch.Generator().manual_seed(4))
    permuted = cluster_classes(features[order], labels[order], clusters=4)
    assert same_partition(permuted + 4 * labels[order], (found + 4 * labels)[order])


@pytest.fixture()
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the test machines' cores are shared; a 24-image batch needs no more
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_the_public_backbone_separates_classes():
    data = shapes.client_train_set("sketch", 4, 0, seed=0, size=32)
    encoder = public_encoder(MODEL, CLASSIFIER_SIZE)
    features = encoder(data.images)
    assert features.shape == (len(data.labels), 512) and torch.isfinite(features).all()
    # in the space the clustering sees: measured 0.36 within a class against 0.53 between
    unit = torch.nn.functional.normalize(features, dim=1)
    distance = torch.cdist(unit, unit)
    same = data.labels[:, None] == data.labels[None]
    within = distance[same & ~torch.eye(len(unit), dtype=torch.bool)].mean()
    assert within < distance[~same].mean()
    found = cluster_images(data.images, data.labels, 2, encoder)
    assert found.shape == data.labels.shape and found.max() == 1


@pytest.mark.usefixtures("one_thread")
def test_the_features_are_what_the_backbones_head_reads():
    """The shipped backbone was trained on the public shapes (no task's class): its own head,
    applied to the features of 24 unseen public clipart images at 32 px, names all 24
    (measured); fed them unresized it names 5, so this also checks the resize to the
    classifier's size. 20 of 24 (chance: 3) leaves room for a library update's rounding
    without accepting a wrong input."""
    data = shapes.public_set("clipart", 3, seed=1, size=32)  # seed 1: the corpus is seed 0's
    assert list(data.classes) == list(shapes.PUBLIC_CLASSES)  # the head's class order
    head = load_backbone(backbone_path(MODEL)).fc
    with torch.no_grad():
        named = head(public_encoder(MODEL, CLASSIFIER_SIZE)(data.images)).argmax(1)
    assert (named == data.labels).sum().item() >= 20

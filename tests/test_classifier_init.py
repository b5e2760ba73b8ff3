"""The classifier's initial weights: ImageNet weights are checked at start-up from the torch hub
cache only; the "pretrained" backbone is the base model's own, never trained on a client's or a
test image."""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import pytest
import torch
from flwr.common.config import flatten_dict
from safetensors import safe_open

from fedbip_flwr import dataset, shapes
from fedbip_flwr.classifier import (
    BACKBONE_DIR,
    BACKBONE_FILE,
    ClassifierInitError,
    build_classifier,
    check_classifier_init,
    imagenet_weights_path,
)
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.storage import read_tensors
from fedbip_flwr.viz import quantize
from tests.helpers import script


def test_missing_imagenet_weights_fail_at_once_with_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(ClassifierInitError) as info:
        check_classifier_init("imagenet")
    message = str(info.value)
    assert str(tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth") in message
    assert 'classifier.init = "random"' in message and message.count(". ") == 0
    assert not (tmp_path / "hub").exists()  # nothing was downloaded or created
    check_classifier_init("random")  # random init needs no file


def test_cached_imagenet_weights_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    path = imagenet_weights_path()
    assert path == tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"stand-in: the check looks, it does not load")
    check_classifier_init("imagenet")


# --- classifier.init = "pretrained": the miniature's own backbone ------------------------------
ROOT = Path(__file__).resolve().parents[1]


def _hashes(images: torch.Tensor) -> set[str]:
    """One sha256 per image of its uint8 pixels ([-1, 1] floats quantized first: exact for
    the shapes world, whose floats are uint8 / 127.5 - 1)."""
    pixels = images if images.dtype == torch.uint8 else quantize(images)
    return {hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest() for image in pixels}


def test_the_shipped_backbone_is_a_fair_start():
    """The backbone ("pretrained") is trained on public shapes no task uses, in the common
    domains only (the script's ``public_labelled``, train and held-out slices alike): its head
    names none of the task's classes, and its corpus shares no pixel-identical image with the
    default federation's clients (sketch, quickdraw, painting: 16 shots x 6 classes each) or
    with any of their test images. The shapes world seeds its splits apart ("public" is one);
    this test checks the pixels.

    For speed it takes 60 corpus images per class per domain instead of the shipped 300: every
    image is drawn from its own (seed, split, domain, class, index) key, so a smaller corpus is
    exactly a subset of the real one, which the first assertion checks at a tiny size.
    """
    log = json.loads(
        (ROOT / "models" / "miniature-ldm" / BACKBONE_DIR / "train_log.json").read_text()
    )
    assert log["classes"] == list(shapes.PUBLIC_CLASSES) and not set(log["classes"]) & set(
        shapes.CLASSES
    )
    assert log["corpus"]["function"] == "fedbip_flwr.shapes.public_corpus"
    with safe_open(
        str(ROOT / "models" / "miniature-ldm" / BACKBONE_DIR / BACKBONE_FILE), "pt"
    ) as f:
        assert json.loads(f.metadata()["backbone"])["classes"] == list(shapes.PUBLIC_CLASSES)
    pretrain = script("pretrain_backbone")
    seed = log["corpus"]["seed"]
    small, large = (
        _hashes(pretrain.public_labelled(3, seed)[0]),
        _hashes(pretrain.public_labelled(6, seed)[0]),
    )
    assert small < large

    images, labels, domains = pretrain.public_labelled(60, seed)
    corpus = _hashes(images)
    assert len(corpus) == len(images) == 3 * 8 * 60  # distinct images, common domains only
    assert labels.bincount().tolist() == [180] * 8 and set(domains) == set(shapes.COMMON_DOMAINS)

    with open(ROOT / "pyproject.toml", "rb") as handle:
        flat = flatten_dict(tomllib.load(handle)["tool"]["flwr"]["app"]["config"])
    cfg = FedBiPConfig.from_flat(flat)
    assert (cfg.data.dataset, cfg.data.domain_list, cfg.data.shots_per_class) == (
        "shapes",
        ["sketch", "quickdraw", "painting"],
        16,
    )
    clients = [dataset.load_client_data(cfg.data_description, p) for p in range(3)]
    assert [(c.client_id, len(c)) for c in clients] == [
        ("sketch-0", 96),
        ("quickdraw-0", 96),
        ("painting-0", 96),
    ]
    tests = dataset.load_test_sets(cfg.data_description, cfg.data.domain_list)
    private = set().union(*(_hashes(c.images) for c in clients))
    held_out = set().union(*(_hashes(t.images) for t in tests.values()))
    assert len(private) == 3 * 96 and len(held_out) == 3 * 6 * cfg.data.test_per_class
    assert not corpus & private
    assert not corpus & held_out


def _tiny_backbone(folder: Path) -> dict[str, torch.Tensor]:
    """A backbone saved by the script's own save function; the float32 tensors it stands for."""
    torch.manual_seed(7)
    net = build_classifier(6, "random")
    with torch.no_grad():
        net.bn1.running_mean.uniform_(-1, 1)  # not an init value: loading must carry statistics
    script("pretrain_backbone").save_backbone(net, folder / BACKBONE_DIR)
    return {
        name: t.half().float() if t.is_floating_point() else t
        for name, t in net.state_dict().items()
    }


def test_pretrained_init_loads_the_backbone_shipped_with_the_model(tmp_path, monkeypatch):
    saved = _tiny_backbone(tmp_path / "tiny-model")
    on_disk = read_tensors(tmp_path / "tiny-model" / BACKBONE_DIR / BACKBONE_FILE)
    assert on_disk["conv1.weight"].dtype == torch.float16 and on_disk["fc.weight"].shape == (6, 512)
    monkeypatch.setenv(
        "FEDBIP_PROJECT_DIR", str(tmp_path)
    )  # a relative model resolves as the LDM's does
    check_classifier_init("pretrained", "tiny-model")
    model = build_classifier(4, "pretrained", "tiny-model")
    state = model.state_dict()
    assert torch.equal(state["conv1.weight"], saved["conv1.weight"])
    assert state["conv1.weight"].dtype == torch.float32
    assert all(torch.equal(state[k], saved[k]) for k in saved if not k.startswith("fc."))
    assert model.fc.weight.shape == (4, 512) and model.fc.bias.shape == (
        4,
    )  # fresh, the task's classes
    assert FedBiPConfig.from_flat({"classifier.init": "pretrained"}).classifier.init == "pretrained"


def test_missing_backbone_fails_with_one_sentence_naming_file_and_script(tmp_path):
    (tmp_path / "model").mkdir()
    expected = tmp_path / "model" / BACKBONE_DIR / BACKBONE_FILE
    for attempt in (
        lambda: check_classifier_init("pretrained", tmp_path / "model"),
        lambda: build_classifier(6, "pretrained", tmp_path / "model"),
    ):
        with pytest.raises(ClassifierInitError) as info:
            attempt()
        message = str(info.value)
        assert str(expected) in message and "scripts/pretrain_backbone.py" in message
        assert 'classifier.init = "pretrained"' in message and message.count(". ") == 0
    assert not (tmp_path / "model" / BACKBONE_DIR).exists()  # nothing was created
    check_classifier_init("random", tmp_path / "model")

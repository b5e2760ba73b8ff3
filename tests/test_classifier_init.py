"""ImageNet classifier weights are checked at start-up, from the torch hub cache only."""

from __future__ import annotations

import pytest

from fedbip_flwr.classifier import ClassifierInitError, check_classifier_init, imagenet_weights_path


def test_missing_imagenet_weights_fail_at_once_with_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(ClassifierInitError) as info:
        check_classifier_init("imagenet")
    message = str(info.value)
    assert str(tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth") in message
    assert 'classifier-init = "random"' in message and message.count(". ") == 0
    assert not (tmp_path / "hub").exists()  # nothing was downloaded or created
    check_classifier_init("random")  # random init needs no file


def test_cached_imagenet_weights_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    path = imagenet_weights_path()
    assert path == tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"stand-in: the check looks, it does not load")
    check_classifier_init("imagenet")

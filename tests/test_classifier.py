"""The shared classifier recipe: its SGD-step budget (run config classifier.steps), its learning
rate over the steps (classifier.schedule) and its BatchNorm statistics after training
(classifier.precise-bn)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fedbip_flwr.classifier import (
    TrainSettings,
    _prepare,
    batches_per_epoch,
    build_classifier,
    train_classifier,
)
from fedbip_flwr.config import ConfigError, FedBiPConfig
from fedbip_flwr.server import train_settings


@pytest.mark.parametrize(("n", "steps"), [(20, 7), (33, 3), (9, 4)])
def test_a_step_budget_makes_exactly_that_many_sgd_steps(n, steps):
    model = build_classifier(3, "random")
    images, labels = torch.rand(n, 3, 16, 16) * 2 - 1, torch.arange(n) % 3
    made, epochs = [], []
    settings = TrainSettings(
        epochs=50, lr=0.01, momentum=0.9, batch_size=8, image_size=16, steps=steps
    )
    hook = register_optimizer_step_post_hook(lambda *_: made.append(1))
    try:
        train_classifier(
            model, images, labels, settings, seed=0, on_epoch=lambda e, _l: epochs.append(e)
        )
    finally:
        hook.remove()
    assert len(made) == steps, "the budget, not the 50 configured epochs"
    assert len(epochs) == -(-steps // batches_per_epoch(n, 8)) == settings.epochs_for(n)


@pytest.mark.parametrize(("schedule", "steps"), [("cosine", 0), ("cosine", 5), ("constant", 0)])
def test_the_schedule_sets_each_steps_learning_rate_over_exactly_the_steps_made(schedule, steps):
    """Cosine: step k of N uses lr (1 + cos(pi k / N)) / 2, so the last step's is small and no
    step restarts the cycle, whether N comes from epochs (17 images, batch 8: two batches an
    epoch, the last batch of one dropped) or from a step budget."""
    n, lr = 17, 0.04
    settings = TrainSettings(
        epochs=3, lr=lr, momentum=0.9, batch_size=8, image_size=16, steps=steps, schedule=schedule
    )
    used: list[float] = []
    hook = register_optimizer_step_post_hook(
        lambda optimizer, *_: used.append(optimizer.param_groups[0]["lr"])
    )
    try:
        images, labels = torch.rand(n, 3, 16, 16) * 2 - 1, torch.arange(n) % 3
        train_classifier(build_classifier(3, "random"), images, labels, settings, seed=0)
    finally:
        hook.remove()
    total = steps or 6
    assert len(used) == total == settings.steps_for(n)
    expected = [
        lr * (1 + math.cos(math.pi * k / total)) / 2 if schedule == "cosine" else lr
        for k in range(total)
    ]
    assert used == pytest.approx(expected, rel=1e-9)


def test_batches_per_epoch_drops_a_last_batch_of_one():
    assert [batches_per_epoch(n, 8) for n in (8, 9, 10, 16, 17, 3)] == [1, 1, 2, 2, 2, 1]


@pytest.mark.parametrize("precise", [True, False])
def test_precise_bn_leaves_the_statistics_of_the_whole_unaugmented_set_under_the_final_weights(
    precise,
):
    """With it, the stem's BatchNorm holds exactly the mean of conv1's outputs on the training
    images as they are (equal batches: the mean of the batch means is the set's mean) and their
    variance up to the batches' draw; without it, the running average of augmented batches
    under moving weights holds neither."""
    n, size = 48, 24
    images, labels = torch.rand(n, 3, size, size) * 2 - 1, torch.arange(n) % 3
    settings = TrainSettings(
        epochs=2, lr=0.05, momentum=0.9, batch_size=16, image_size=size, precise_bn=precise
    )
    model = train_classifier(build_classifier(3, "random"), images, labels, settings, seed=0)
    with torch.no_grad():
        stem = model.conv1(_prepare(images, size))
    bn = model.bn1
    assert torch.allclose(bn.running_mean, stem.mean((0, 2, 3)), atol=1e-6) == precise
    assert torch.allclose(bn.running_var, stem.var((0, 2, 3)), rtol=0.05) == precise
    assert not model.training and bn.momentum == 0.1, "update_bn restores eval mode and momentum"


def test_the_run_config_turns_precise_bn_on_by_default_and_off_by_key():
    assert train_settings(FedBiPConfig().classifier).precise_bn
    off = FedBiPConfig.from_flat({"classifier.precise-bn": False})
    assert not train_settings(off.classifier).precise_bn


def test_the_run_config_carries_the_schedule_and_refuses_an_unknown_one():
    assert train_settings(FedBiPConfig.from_flat({}).classifier).schedule == "constant"
    chosen = FedBiPConfig.from_flat({"classifier.schedule": "cosine"})
    assert train_settings(chosen.classifier).schedule == "cosine"
    with pytest.raises(ConfigError, match="classifier.schedule"):
        FedBiPConfig.from_flat({"classifier.schedule": "linear"})

"""The shared classifier recipe's SGD-step budget (run config classifier-steps)."""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fedbip_flwr.classifier import (
    TrainSettings,
    batches_per_epoch,
    build_classifier,
    train_classifier,
)


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


def test_batches_per_epoch_drops_a_last_batch_of_one():
    assert [batches_per_epoch(n, 8) for n in (8, 9, 10, 16, 17, 3)] == [1, 1, 2, 2, 2, 1]

"""scripts/domain_upper_bound.py's own helpers, on toy losses (no model, no judges): its
snapshots are exactly the embeddings a shorter run of the library's optimiser ends with."""

from types import SimpleNamespace

import torch

from fedbip_flwr.concepts import optimise_embeddings
from tests.helpers import script

FAKE_LDM = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
START = torch.tensor([[1.0, -2.0, 0.5]])
TARGET = torch.tensor([[0.3, 0.1, -0.7]])


def toy_loss(embeddings, batch, t, noise):
    """Depends on the batch's noise and t, so a snapshot must follow the same random draws."""
    weight = 1.0 + noise.mean() + t.float().mean() / 1000
    return weight * (embeddings[0] - TARGET).pow(2).sum()


def run(loss, epochs: int) -> torch.Tensor:
    (learned,), _ = optimise_embeddings(
        FAKE_LDM, [START], loss, torch.Size([16, 2]), 961, 0.5, epochs=epochs, batch_size=4, lr=0.1,
        generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    return learned


def test_snapshot_is_the_shorter_runs_result():
    module = script("domain_upper_bound")
    snaps = module.Snapshots(toy_loss, [4, 8], t_max=961)
    final = run(snaps, epochs=3)
    assert sorted(snaps.taken) == [4, 8] and snaps.calls == 12
    for steps in (4, 8):  # 4 steps an epoch
        assert torch.equal(snaps.taken[steps][0][0], run(toy_loss, epochs=steps // 4))
    assert not torch.equal(final, snaps.taken[8][0][0])


def test_t_min_maps_the_draws_onto_its_range():
    module = script("domain_upper_bound")
    seen = []
    snaps = module.Snapshots(
        lambda e, b, t, n: seen.append(t) or torch.zeros(()), [], t_max=961, t_min=500
    )
    snaps([START], None, torch.arange(1, 962), None)
    mapped = seen[0]
    assert int(mapped.min()) == 500 and int(mapped.max()) == 961
    assert bool((mapped.diff() >= 0).all()) and len(set(mapped.tolist())) == 462


def test_best_snapshot_needs_class_fidelity_and_skips_the_default_budget():
    module = script("domain_upper_bound")

    def snap(c, d, s, ratio=1.0):
        return {"class": c, "domain": d, "seconds": s, "loss_ratio_vs_prompt": {"all": ratio}}

    entry = {"default_budget_steps": 120, "runs": {
        "a": {"snapshots": {"120": snap(1.0, 0.9, 1), "500": snap(0.5, 0.8, 5), "1000": snap(0.95, 0.3, 9)}},
        "b": {"snapshots": {"500": snap(0.92, 0.3, 4)}},
    }}  # fmt: skip
    assert module.best_snapshot(entry) == ("b", 500)  # a/500 fails the class bar; ties: cheaper
    entry["runs"]["a"]["snapshots"]["1000"] = snap(0.95, 0.3, 9, ratio=0.98)
    assert module.best_snapshot(entry) == ("a", 1000)  # ties: the lower loss first
    assert module.best_snapshot({"default_budget_steps": 120, "runs": {}}) is None

"""The poisons scripts/poisoning.py measures (issue 91) do what they claim, and today's
validation accepts them: the limit of the server's bounds, stated as a test. Real uploads by
the client code on the tiny model, checked by the server's own ``accept``."""

from __future__ import annotations

import torch

from fedbip_flwr.method_settings import EspressoSettings
from fedbip_flwr.methods import create_for
from fedbip_flwr.methods.espresso import CONDITIONS
from fedbip_flwr.mixture import MIXTURE_MEANS
from tests.helpers import client_job, method_config, script, server_job

poisoning = script("poisoning")


def upload_and_server(method: str, ldm, **values):
    cfg = method_config(method, **values)
    blob, _ = create_for(cfg).upload(client_job(cfg, ldm))
    return cfg, blob, create_for(cfg).accept(blob, server_job(cfg, ldm))


def test_a_uniform_shift_of_the_mixture_means_inside_the_mean_bound_is_accepted(tiny_ldm):
    """Half the room the per-image mean bound leaves moves every mean and nothing else, and is
    taken; twice the bound is refused: the bound stops gross shifts, not one inside it."""
    cfg, blob, honest = upload_and_server("fedbip-mixture", tiny_ldm)
    room, bound = poisoning.mean_room(blob, cfg, tiny_ldm)
    assert 0 < room <= bound
    shifted = create_for(cfg).accept(
        poisoning.shift_means(blob, room / 2), server_job(cfg, tiny_ldm)
    )
    moved = shifted.tensors[MIXTURE_MEANS] - honest.tensors[MIXTURE_MEANS]
    assert torch.allclose(moved, torch.full_like(moved, room / 2), atol=1e-5)
    for name, tensor in honest.tensors.items():
        if name != MIXTURE_MEANS:
            assert torch.equal(shifted.tensors[name], tensor), name
    assert poisoning.accepted(poisoning.shift_means(blob, room / 2), cfg, tiny_ldm) == ""
    assert "average exceeds" in poisoning.accepted(
        poisoning.shift_means(blob, 2 * bound), cfg, tiny_ldm
    )


def test_label_flipped_espresso_conditions_are_accepted(tiny_ldm):
    """Class k's images drawn toward class k - 1's conditions: at the method's default budget
    (EspressoSettings().epochs) every flipped condition lies within the reach the server
    allows its learning from class k's plain prompt."""
    budget = {"espresso.epochs": EspressoSettings().epochs}
    cfg, blob, honest = upload_and_server("espresso", tiny_ldm, **budget)
    flipped = poisoning.flip_conditions(blob)
    assert poisoning.accepted(flipped, cfg, tiny_ldm) == ""
    taken = create_for(cfg).accept(flipped, server_job(cfg, tiny_ldm))
    conditions = honest.tensors[CONDITIONS]
    assert torch.equal(taken.tensors[CONDITIONS], conditions.roll(1, dims=0))
    assert not torch.equal(taken.tensors[CONDITIONS], conditions)
    for name in ("class_counts", MIXTURE_MEANS):
        assert torch.equal(taken.tensors[name], honest.tensors[name]), name

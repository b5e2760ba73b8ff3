"""The server's loss-ratio membership test on learned concepts and conditions
(fedbip_tools.privacy.conditioning_loss_ratio_scores) on the tiny LDM: its definition (the
plain prompt's per-example loss less the learned concepts', averaged over shared (t, eps)
draws), the best of a class's conditions counting, and no signal where what was learned is the
plain prompt. A random-init UNet listens to its text too weakly for concepts to memorise
anything, so the positive control (concepts or conditions overfitted to a few images per class
on the miniature) is a measurement: scripts/server_attacks.py --kinds concepts
espresso-conditions."""

from __future__ import annotations

import argparse

import torch

from fedbip_flwr.concepts import diffusion_loss, initial_concepts, prompt_layout
from fedbip_flwr.conditions import initial_conditions
from fedbip_flwr.shared_concepts import Concepts
from fedbip_tools.privacy import concept_conditionings, conditioning_loss_ratio_scores
from tests.helpers import script

CLASSES = ["circle", "square", "star"]
TEMPLATE = "a {S} style of a {V}"


def concepts_of(ldm, s, v, names=CLASSES) -> Concepts:
    return Concepts(s, v, TEMPLATE, "sketch", tuple(names), "token", "client-0")


def latents(ldm, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *ldm.latent_shape(), generator=g), torch.arange(n) % len(CLASSES)


def test_scores_are_the_plain_prompts_loss_less_the_learned_ones(tiny_ldm):
    layout = prompt_layout(tiny_ldm.tokenizer, TEMPLATE, 1, 1, "sketch", CLASSES)
    s0, v0 = initial_concepts(tiny_ldm, layout, "token")
    s, v = s0 + 0.05 * torch.randn_like(s0), v0 + 0.05 * torch.randn_like(v0)
    z0, labels = latents(tiny_ldm, 3, 0)

    def scores_of(s_: torch.Tensor, v_: torch.Tensor, **options) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1)
        concepts = concepts_of(tiny_ldm, s_, v_)
        return conditioning_loss_ratio_scores(
            tiny_ldm,
            *concept_conditionings(tiny_ldm, concepts, layout),
            z0,
            labels,
            max_timestep=981,
            draws=2,
            generator=generator,
            **options,
        )

    scores = scores_of(s, v, batch_size=2)
    g = torch.Generator().manual_seed(1)  # the same draws, one example at a time
    expected = torch.zeros(3, dtype=torch.float64)
    for _ in range(2):
        t = torch.randint(1, 982, (3,), generator=g)
        noise = torch.randn(z0.shape, generator=g)
        with torch.no_grad():
            for i in range(3):
                args = (z0[i : i + 1], labels[i : i + 1], t[i : i + 1], noise[i : i + 1])
                plain = diffusion_loss(tiny_ldm, layout, "token", s0, v0, *args)
                learned = diffusion_loss(tiny_ldm, layout, "token", s, v, *args)
                expected[i] += float(plain - learned) / 2
    assert torch.allclose(scores, expected, rtol=1e-4, atol=1e-6)
    # concepts that are the plain prompt give nothing to anyone
    unchanged = scores_of(s0, v0)
    assert torch.equal(unchanged, torch.zeros(3, dtype=torch.float64))


def test_a_class_counts_its_best_condition_and_plain_conditions_give_nothing(tiny_ldm):
    plain = initial_conditions(tiny_ldm, TEMPLATE, "sketch", CLASSES, 2)
    learned = plain.clone()
    push = torch.randn(plain[:, 0].shape, generator=torch.Generator().manual_seed(2))
    learned[:, 0] += 0.05 * plain.abs().mean() * push
    z0, labels = latents(tiny_ldm, 6, 0)

    def scores_of(start: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        return conditioning_loss_ratio_scores(
            tiny_ldm,
            start,
            own,
            z0,
            labels,
            max_timestep=981,
            draws=2,
            generator=torch.Generator().manual_seed(1),
            batch_size=4,
        )

    first = scores_of(plain[:, :1], learned[:, :1])
    # the second condition of each class is the plain prompt: a loss above it never counts
    assert torch.equal(scores_of(plain, learned), first.clamp_min(0))
    assert (first != 0).all()
    assert torch.equal(scores_of(plain, plain), torch.zeros(6, dtype=torch.float64))


def test_the_attack_draws_t_up_to_its_cap_and_no_further_than_the_upload(tiny_ldm):
    """scripts/server_attacks.py --concept-max-timestep: both sides' scores are the test's
    at t ~ U{1..min(cap, T)}; 0, or a cap above the upload's T, is the upload's T."""
    attacks = script("server_attacks")
    plain = initial_conditions(tiny_ldm, TEMPLATE, "sketch", CLASSES, 1)
    learned = plain + 0.05 * plain.abs().mean() * torch.randn(
        plain.shape, generator=torch.Generator().manual_seed(3)
    )
    sides = (latents(tiny_ldm, 3, 0), latents(tiny_ldm, 3, 1))

    def sides_at(cap: int) -> list[torch.Tensor]:
        args = argparse.Namespace(concept_draws=2, seed=0, concept_max_timestep=cap)
        return attacks.loss_ratio_sides(args, tiny_ldm, (plain, learned), sides, 981)

    def direct(max_timestep: int) -> list[torch.Tensor]:
        return [
            conditioning_loss_ratio_scores(
                tiny_ldm,
                plain,
                learned,
                *side,
                max_timestep=max_timestep,
                draws=2,
                generator=torch.Generator().manual_seed(17),
            )
            for side in sides
        ]

    for cap, drawn in ((0, 981), (5000, 981), (50, 50)):
        for got, expected in zip(sides_at(cap), direct(drawn), strict=True):
            assert torch.equal(got, expected)
    assert not torch.equal(direct(50)[0], direct(981)[0])

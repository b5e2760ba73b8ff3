"""Synthesis in memory, for studies and tests (never a run's path: a run writes keyed shards,
:mod:`fedbip_flwr.server`): the Prompts-only baseline from plain prompts, and every FedBiP pass
over one client's z(T) at once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedbip_flwr.ldm import LDM
from fedbip_flwr.method_settings import PassSettings
from fedbip_flwr.methods.fedbip import iter_pass
from fedbip_flwr.payload import Payload
from fedbip_flwr.synthesis import SynthesisSettings, draw_etas, encode_texts, iter_from_noise


def sample_from_prompts(
    ldm: LDM,
    prompts: list[str],
    settings: SynthesisSettings,
    generator: torch.Generator,
) -> torch.Tensor:
    """The Prompts-only baseline: plain text, fresh Gaussian noise, full schedule.

    What a server could do with a pretrained LDM and no personalization at all; also how the
    miniature model's class fidelity is measured.
    """
    cond = encode_texts(ldm, prompts)
    return torch.cat(
        list(iter_from_noise(ldm, cond, torch.arange(len(prompts)), settings, generator))
    )


def synthesize_pass(
    ldm: LDM,
    payload: Payload,
    settings: SynthesisSettings,
    eta: torch.Tensor,
    on_batch: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """One pass over a client's z(T) with the domain concept shifted by scale * ``eta`` (n_s, d)."""
    return torch.cat(list(iter_pass(ldm, payload, settings, eta, on_batch)))


@dataclass(frozen=True)
class SyntheticImages:
    images: torch.Tensor  # (N * m, 3, H, W) in [-1, 1]
    labels: torch.Tensor  # (N * m,)
    source: torch.Tensor  # (N * m,) index of the z(T) each image was denoised from


def synthesize_client(
    ldm: LDM,
    payload: Payload,
    settings: SynthesisSettings,
    own: PassSettings,
    seed: int,
    on_batch: Callable[[int], None] | None = None,
) -> SyntheticImages:
    """All of ``own``'s passes for one client; deterministic for a given payload and seed."""
    etas = draw_etas(payload.concepts, own.multiplier, own.eta_std, seed)
    images = [synthesize_pass(ldm, payload, settings, eta, on_batch) for eta in etas]
    n = len(payload.labels)
    return SyntheticImages(
        torch.cat(images),
        payload.labels.repeat(own.multiplier),
        torch.arange(n).repeat(own.multiplier),
    )

"""Where every stream of randomness in a run comes from, and who can replay it.

A client's randomness hides its private latents, so it must come from what the server never
sees or sets; the server's own streams (eta per pass, fresh noise per shard) are derived from
the run seed and a stream name, so they survive restarts.
"""

from __future__ import annotations

import logging
import os
import zlib

import torch

from .config import FedBiPConfig, NodeConfig

log = logging.getLogger(__name__)


def client_seed(seed: int, client_id: str) -> int:
    """A per-client seed that survives restarts (Python's hash() is salted per process)."""
    return (seed * 1_000_003 + zlib.crc32(client_id.encode())) % 2**31


def client_generator(cfg: FedBiPConfig, node: NodeConfig, client_id: str) -> torch.Generator:
    """The one source of a client's randomness: partners, gamma, the noise hiding z(T), and
    concept learning's noise, timesteps and batch order.

    By default it is seeded from the operating system's entropy, so nothing the server sees or
    sets (run config, payload, Flower context) lets it replay the noise and undo z(T). An
    institution may seed it from its own node config (the server never sees that); simulations
    and benchmarks may opt in to ``federation.replayable-client-noise``, which lets the server
    replay it.
    """
    if node.seed is not None:
        log.info("[%s] randomness seeded from this institution's node config", client_id)
        return torch.Generator().manual_seed(node.seed)
    if cfg.federation.replayable_client_noise:
        log.warning(
            "[%s] federation.replayable-client-noise is on: the server can replay this client's "
            "noise and recover its private latents (simulations and benchmarks only)",
            client_id,
        )
        return torch.Generator().manual_seed(client_seed(cfg.seed, client_id))
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))

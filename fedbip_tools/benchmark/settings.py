"""What the benchmark pins and where it keeps things: :class:`Settings` (everything a cached row
depends on but its seed), :class:`Bench` (its work and results folders), the run config every
variant of a seed shares (:func:`base_values`) and the sampler that config samples with
(:func:`sampling`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diffusers import PNDMScheduler

from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.paths import resolve
from fedbip_flwr.sampler import Sampler

FEDBIP_FAMILY = ("fedbip", "fedbip-mixture")  # the methods whose tables hold FedBiP's keys
TWO_ZT_PER_IMAGE = {"latents-per-image": 2, "multiplier": 1}


@dataclass(frozen=True)
class Settings:
    """Everything a cached result depends on, except the seed: the default federation's run
    config (sampler, concepts, the upload's shape) pinned, so tuning the default leaves every
    cached row as it is, with the classifier's budget and start the same for every row."""

    domains: tuple[str, ...] = ("sketch", "quickdraw", "painting")
    classifier_steps: int = 300
    fedavg_local_epochs: int = 2
    mia_per_domain: int = 96
    run_config: dict[str, Any] = field(
        default_factory=lambda: {
            "shots-per-class": 16,
            "test-per-class": 100,
            "scheduler": "unipc",
            "timestep-spacing": "trailing",
            "num-inference-steps": 5,
            "guidance-scale": 4.0,
            "fedbip.concept-epochs": 10,
            "fedbip-mixture.concept-epochs": 10,
            # the default federation's upload: 2 z(T) per image, each denoised once
            **{f"{m}.{k}": v for m in FEDBIP_FAMILY for k, v in TWO_ZT_PER_IMAGE.items()},
            # the paper's classifier starts pretrained (ImageNet); the miniature's public start
            "classifier-init": "pretrained",
            "classifier-image-size": 64,
            "classifier-schedule": "cosine",
            # float32: rows compare across machines, and the judges are float32 too
            "classifier-precision": "float32",
            "classifier-precise-bn": True,
        }
    )

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Bench:
    settings: Settings
    work: Path  # run folders and FLWR_HOMEs (big: shards)
    results: Path  # benchmarks/ (cached results, summary, pictures)
    threads: int = 2
    timeout_s: float = 6 * 3600

    def seed_folder(self, seed: int) -> Path:
        return self.work / f"seed-{seed}"

    def cache(self, seed: int) -> Path:
        return self.results / "methods" / f"seed-{seed}.json"


def base_values(bench: Bench, seed: int) -> dict[str, Any]:
    """The run config every variant of a seed shares."""
    return {
        **bench.settings.run_config,
        "domains": ",".join(bench.settings.domains),
        "classifier-steps": bench.settings.classifier_steps,
        "seed": seed,
        "replayable-client-noise": True,  # a benchmark replays the same clients for every method
        "evaluation": "server",
        "output-dir": str(bench.seed_folder(seed)),
    }


@dataclass(frozen=True)
class Sampling:
    """The sampler every row of the benchmark samples with, and its start timestep T."""

    scheduler: str
    steps: int
    spacing: str
    timestep: int


def sampling(bench: Bench) -> Sampling:
    """What the benchmark's pinned run config samples with, T from its model's noise schedule."""
    cfg = FedBiPConfig.from_flat({**base_values(bench, 0), "method": "fedbip"})
    noise = PNDMScheduler.from_config(
        PNDMScheduler.load_config(str(resolve(cfg.model)), subfolder="scheduler")
    )
    steps, spacing = cfg.num_inference_steps, cfg.timestep_spacing
    sampler = Sampler.create(cfg.scheduler, noise, steps, spacing)
    return Sampling(str(cfg.scheduler), steps, spacing, sampler.first_timestep(cfg.start_timestep))

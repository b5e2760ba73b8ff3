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

from fedbip_flwr.config import FedBiPConfig, earlier_layout, in_tables
from fedbip_flwr.paths import resolve
from fedbip_flwr.sampler import Sampler


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
            "data.shots-per-class": 16,
            "data.test-per-class": 100,
            "synthesis.scheduler": "unipc",
            "synthesis.timestep-spacing": "trailing",
            "synthesis.num-inference-steps": 5,
            "synthesis.guidance-scale": 4.0,
            # FedBiP's client step, fedbip-mixture's too (fedbip's table declares it once)
            "fedbip.concept-epochs": 10,
            # the default federation's upload: 2 z(T) per image, each denoised once
            "fedbip.latents-per-image": 2,
            "fedbip.multiplier": 1,
            # the paper's classifier starts pretrained (ImageNet); the miniature's public start
            "classifier.init": "pretrained",
            "classifier.image-size": 64,
            "classifier.schedule": "cosine",
            # float32: rows compare across machines, and the judges are float32 too
            "classifier.precision": "float32",
            "classifier.precise-bn": True,
        }
    )

    @classmethod
    def recorded(cls, values: dict[str, Any]) -> Settings:
        """Settings as a record wrote them (``asdict``), also one written before the run config
        had tables: its run config read in today's keys."""
        return cls(
            **{
                **values,
                "domains": tuple(values["domains"]),
                "run_config": in_tables(values["run_config"]),
            }
        )

    def digest(self) -> str:
        """The key of the results cached under these settings, their run config in the flat
        layout the caches were keyed in before the tables, so the move kept every cached row."""
        keyed = {**asdict(self), "run_config": earlier_layout(self.run_config)}
        return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]


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
        "data.domains": ",".join(bench.settings.domains),
        "classifier.steps": bench.settings.classifier_steps,
        "seed": seed,
        # a benchmark replays the same clients for every method
        "federation.replayable-client-noise": True,
        "federation.evaluation": "server",
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
        PNDMScheduler.load_config(str(resolve(cfg.ldm.model)), subfolder="scheduler")
    )
    synthesis = cfg.synthesis
    steps, spacing = synthesis.num_inference_steps, synthesis.timestep_spacing
    sampler = Sampler.create(synthesis.scheduler, noise, steps, spacing)
    first = sampler.first_timestep(synthesis.start_timestep)
    return Sampling(str(synthesis.scheduler), steps, spacing, first)

"""The benchmark's rows, the one file to edit to add one.

A :class:`Variant` is a registered method with its own run-config values (e.g. FedBiP-L =
``fedbip`` with 10 z(T) per private image). Add a row to :data:`VARIANTS`; to :data:`HEADLINE` to
run it by default; to :data:`COMPARISONS` for its paired difference in the docs. A row whose
values depend on the classifier budget takes a budget rule (``sized``: :func:`local_budget`,
...); one that changes only what the server does with another row's uploads names it in
``reuse``. Renaming a row: map the old name in :data:`LEGACY_NAMES` and raise
:data:`NAMES_VERSION`, so records made before are read under today's names (:func:`named`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fedbip_flwr import methods
from fedbip_flwr.classifier import batches_per_epoch
from fedbip_flwr.method_settings import FEDBIP

from .settings import Settings

FEDBIP_FAMILY = ("fedbip", "fedbip-mixture")  # the methods that run FedBiP's client step


@dataclass(frozen=True)
class Variant:
    """One row of the tables: a registered method with its own run-config values."""

    name: str
    values: dict[str, Any]
    reuse: str = ""  # a variant whose uploads (and shards) this one starts from
    sized: Callable[[Settings, int], dict[str, Any]] | None = None  # budget-dependent values

    @property
    def method(self) -> str:
        return self.values["method"]

    def run_values(self, settings: Settings, images_per_client: int) -> dict[str, Any]:
        extra = self.sized(settings, images_per_client) if self.sized else {}
        return {**self.values, **extra}


def local_epochs(settings: Settings, n: int) -> int:
    """Each client's own classifier (Local, FedLMG's guides) gets the global budget in steps."""
    return math.ceil(settings.classifier_steps / batches_per_epoch(n, 64))


def local_budget(settings: Settings, n: int) -> dict[str, Any]:
    return {"local.epochs": local_epochs(settings, n)}


def fedlmg_budget(settings: Settings, n: int) -> dict[str, Any]:
    return {"fedlmg.local-epochs": local_epochs(settings, n)}


def fedavg_budget(settings: Settings, n: int) -> dict[str, Any]:
    """FedAvg's rounds such that its SGD steps, summed over clients, meet the budget."""
    per_round = len(settings.domains) * settings.fedavg_local_epochs * batches_per_epoch(n, 64)
    return {
        "fedavg.rounds": math.ceil(settings.classifier_steps / per_round),
        "fedavg.local-epochs": settings.fedavg_local_epochs,
    }


def _zt_per_image(method: str, k: int, **more: Any) -> dict[str, Any]:
    """A FedBiP-family row uploading ``k`` independent z(T) per image, each denoised once (keys
    of table fedbip, which declares FedBiP's client step for the family)."""
    return {"method": method, f"{FEDBIP}.latents-per-image": k, f"{FEDBIP}.multiplier": 1, **more}


def _dp(method: str, epsilon: float) -> dict[str, Any]:
    own = _zt_per_image(method, 2) if method in FEDBIP_FAMILY else {"method": method}
    return {**own, f"{method}.dp-epsilon": epsilon}


RANDOM_START = {"classifier.init": "random"}
# One name per variant, used by the benchmark, its records and the docs. FedBiP-S / M / L upload
# 2 / 5 / 10 independent z(T) per private image (each its own partner, gamma and noise) and
# denoise each once: the paper's image counts, made the way its authors' code makes FedBiP-L
# (a fresh latent for every synthetic image).
VARIANTS: tuple[Variant, ...] = (
    Variant("Central", {"method": "central"}),
    Variant("Prompts-only", {"method": "prompts-only"}),
    Variant("FedBiP-S", _zt_per_image("fedbip", 2)),
    Variant("FedBiP-M", _zt_per_image("fedbip", 5)),
    Variant("FedBiP-L", _zt_per_image("fedbip", 10)),
    Variant("FedBiP-mixture", _zt_per_image("fedbip-mixture", 2)),
    Variant("FedBiP-mixture-DP eps 4", _dp("fedbip-mixture", 4.0)),
    Variant("FedLD", {"method": "fedld"}),
    Variant("Espresso", {"method": "espresso"}),
    Variant("OSCAR", {"method": "oscar"}),
    Variant("FedPFT", {"method": "fedpft"}),
    Variant("FedLMG-FT", {"method": "fedlmg", "fedlmg.global": "ft"}, sized=fedlmg_budget),
    # the world's contract (fedbip_tools.world): the floor and the ceiling from a random start
    Variant("Central, random start", {"method": "central", **RANDOM_START}),
    Variant("Prompts-only, random start", {"method": "prompts-only", **RANDOM_START}),
    # ablations (the paper's Table 3): the concepts alone, the z(T) alone; the paper's FedBiP-S
    Variant(
        "concept-only", _zt_per_image("fedbip", 2, **{"fedbip.synthesis-start": "fresh-noise"})
    ),
    Variant("instance-only", _zt_per_image("fedbip", 2, **{"fedbip.concept-epochs": 0})),
    Variant(
        "FedBiP-S, 2 passes of one z(T)",
        {"method": "fedbip", "fedbip.latents-per-image": 1, "fedbip.multiplier": 2},
    ),
    Variant(
        "FedBiP-S, 4 concepts per class", _zt_per_image("fedbip", 2, **{"fedbip.class-clusters": 4})
    ),
    Variant("FedBiP-mixture-DP eps 1", _dp("fedbip-mixture", 1.0)),
    Variant("FedBiP-mixture-DP eps 16", _dp("fedbip-mixture", 16.0)),
    Variant("FedLD-DP eps 4", _dp("fedld", 4.0)),
    Variant("Espresso without Z-Sampling", {"method": "espresso", "espresso.z-sampling": False}),
    Variant("FedLMG-MD", {"method": "fedlmg", "fedlmg.global": "md"}, "FedLMG-FT", fedlmg_budget),
    Variant("FedLMG-SD", {"method": "fedlmg", "fedlmg.global": "sd"}, "FedLMG-FT", fedlmg_budget),
    # references beside the one-shot methods
    Variant("Local", {"method": "local"}, sized=local_budget),
    Variant("FedAvg", {"method": "fedavg"}, sized=fedavg_budget),
    # the Flower FedPFT baseline's comparison: FedAvg of a linear head on FedPFT's frozen encoder
    Variant("FedAvg-head", {"method": "fedavg", "fedavg.part": "head"}, sized=fedavg_budget),
)
# The headline rows (issue 89), run by default; FedLMG-FT, the costliest (its guided synthesis
# backpropagates through the VAE decoder and the client's classifier at every step), last.
HEADLINE = (
    "Central",
    "Prompts-only",
    "FedBiP-S",
    "FedBiP-L",
    "FedBiP-mixture",
    "FedBiP-mixture-DP eps 4",
    "FedLD",
    "Espresso",
    "OSCAR",
    "FedPFT",
    "Central, random start",
    "Prompts-only, random start",
    "FedLMG-FT",
)
# What records made before the names were made one per variant called a row (they named two
# variants "FedBiP-L", and the public start apart): resolved when such a record is read.
LEGACY_NAMES = {
    "FedBiP-S (2 z(T) per image)": "FedBiP-S",
    "FedBiP-M (5 z(T) per image)": "FedBiP-M",
    "FedBiP-L (10 z(T) per image)": "FedBiP-L",
    "FedBiP-S": "FedBiP-S, 2 passes of one z(T)",
    "FedBiP-M": "FedBiP-M, 5 passes of one z(T)",
    "FedBiP-L": "FedBiP-L, 10 passes of one z(T)",
    "FedBiP-mixture (2 z(T) per image)": "FedBiP-mixture",
    "FedBiP-S 4 concepts per class (2 z(T) per image)": "FedBiP-S, 4 concepts per class",
    "FedBiP-mixture-DP epsilon 4": "FedBiP-mixture-DP eps 4",
    "FedBiP-mixture-DP epsilon 1": "FedBiP-mixture-DP eps 1",
    "FedBiP-mixture-DP epsilon 16": "FedBiP-mixture-DP eps 16",
    "FedLD-DP epsilon 4": "FedLD-DP eps 4",
}
NAMES_VERSION = 2  # seed caches without it name rows as LEGACY_NAMES says
# sees no client image: the DCR AUC the member and non-member images give by themselves
NO_DATA_CONTROL = "Prompts-only"
# the paper's ablation order, best first (its Tables 1 and 3): each row against the next
ABLATION = ("FedBiP-L", "FedBiP-M", "FedBiP-S", "instance-only", "concept-only", "Prompts-only")
# the comparisons the README and BENCHMARKS.md draw, as (row A, row B): A minus B
COMPARISONS: tuple[tuple[str, str], ...] = (
    # FedBiP as the default federation uploads against the floor and the ceiling
    ("FedBiP-S", "Prompts-only"),
    ("FedBiP-S", "Central"),
    ("FedBiP-L", "Prompts-only"),
    ("FedBiP-L", "Central"),
    ("FedBiP-L", "FedBiP-S"),
    # the peers, each against FedBiP as the default federation uploads
    *(("FedBiP-S", peer) for peer in ("FedLD", "Espresso", "OSCAR", "FedPFT", "FedLMG-FT")),
    ("OSCAR", "Prompts-only"),  # what the uploaded caption encodings add to the class names
    ("FedLMG-FT", "Prompts-only"),  # what the uploaded classifier's guidance adds to them
    # the mixture mode, and what its DP guarantee costs
    ("FedBiP-S", "FedBiP-mixture"),
    ("FedBiP-S", "FedBiP-mixture-DP eps 4"),
    ("FedBiP-mixture", "FedBiP-mixture-DP eps 4"),
    ("FedBiP-mixture-DP eps 4", "Prompts-only"),
    *zip(ABLATION, ABLATION[1:]),
)


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"unknown variant {name!r}; known: {', '.join(v.name for v in VARIANTS)}")


def available(names: Sequence[str]) -> list[Variant]:
    """The named variants whose method this installation has (FedAvg runs Flower's own)."""
    known = set(methods.names())
    return [v for v in map(variant, names) if v.method in known]


def named(stored: dict[str, Any]) -> dict[str, Any]:
    """A seed cache with its rows under today's names (:data:`LEGACY_NAMES` for one written
    before them), marked so."""
    if stored.get("names") != NAMES_VERSION:
        stored["results"] = {LEGACY_NAMES.get(k, k): v for k, v in stored["results"].items()}
        stored["names"] = NAMES_VERSION
    return stored

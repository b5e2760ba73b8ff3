"""The server's tests that ``scripts/server_attacks.py`` records apart from the runs: per row, its
upload kind's figures at the run's latent size and at Stable Diffusion's (:func:`stand_in_attacks`),
and the loss-ratio test on the conditioning uploaded beside the latents
(:func:`conditioning_attacks`)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from fedbip_flwr import methods
from fedbip_flwr.config import FedBiPConfig

from .runner import variant_values
from .settings import Bench, base_values
from .summary import _std, server_attack_summary
from .variants import Variant, variant

# The server's tests on each row's upload kind made by ``scripts/server_attacks.py`` (one record
# per seed of the clients' randomness): at the run's latent size (4x16x16) and at Stable
# Diffusion's (the world rendered at 256 px through the miniature's encoder and noised with SD
# v1-4's schedule). A latent upload depends on the encoder, the schedule, T, the z(T) per image
# (and a DP release on its epsilon), not on what a run learned, so a row takes its kind's figures
# where its run folders are gone (4x16x16) or never had that size (4x64x64); but the images are
# the world's, so only from records made with the row's own model (``provenance.model``): a
# rebuilt world is another set of members.
ATTACK_RECORDS = (
    "server_attacks_latents_seed0.json",
    "server_attacks_latents_seed1.json",
    "server_attacks_latents_seed2.json",
    "server_attacks_t961_seed0.json",
    "server_attacks_t961_seed1.json",
    "server_attacks_t961_seed2.json",
    "server_attacks_sd_seed0.json",
    "server_attacks_sd_seed1.json",
    "server_attacks_sd_seed2.json",
    "server_attacks_classifier_seed0.json",
    "server_attacks_classifier_seed1.json",
    "server_attacks_classifier_seed2.json",
    "server_attacks_classifier_pretrained_seed0.json",
    "server_attacks_classifier_pretrained_seed1.json",
    "server_attacks_classifier_pretrained_seed2.json",
    "server_attacks_fedavg_seed0.json",
    "server_attacks_fedavg_seed1.json",
    "server_attacks_fedavg_seed2.json",
)
LARGE_SIZE = 256  # px: 4x64x64 latents through the miniature's 4x downsampling VAE
# the statistic each latent upload kind is tested with, as scripts/server_attacks.py names it
STAND_IN_ATTACKS = {
    "fedbip": "rows/likelihood-ratio",
    "fedbip-mixture": "fedbip-mixture/mean-filter",
    "fedld": "fedld/mean-filter",
    "espresso": "espresso/mean-filter",
}
# a DP upload's class statistics, released by the method's own code at the record's size
DP_STAND_INS = {"fedld": "fedld-dp", "fedbip-mixture": "fedbip-mixture-dp-stats"}
# a mean per class of what the server can compute from an image (the public backbone's features,
# the shipped captioner's states): the same at any image size, so made at the run's only
MEAN_STAND_INS = ("fedpft", "oscar")
# the client's own classifier (Local's upload, FedLMG's guide: one client step): its recipe on the
# same world's images, not the LDM; images at the run's size only, no latent to scale
CLASSIFIER_STAND_INS = ("local", "fedlmg")
CLASSIFIER_ATTACK = "fedlmg/loss"  # as scripts/server_attacks.py names the loss test
# FedAvg's replies, every round (kept by no run folder: the records simulate its rounds with its
# own client step and Flower's average): kind -> what travels (fedavg.part), and the statistic
# a row is given: the last round's reply's loss, the strongest of the three the records hold
# (chosen after measuring; the loss drop fixed before it was weaker: BENCHMARKS.md)
FEDAVG_KINDS = {"fedavg": "all", "fedavg-head": "head"}
FEDAVG_ATTACK = "loss-last"
RECORD_ONLY_TESTS = {"fedavg": "last round's reply loss"}
SERVER_ATTACK_STAND_IN = "server_attack_stand_in"  # a row's key for its kind's run-size figures
SERVER_ATTACK_LARGE = "server_attack_large"  # a row's key for the figures at SD's latent size


def stand_in_setting(bench: Bench, v: Variant, timestep: int, size: int) -> tuple[str, str] | None:
    """The record key and attack standing in for the row's upload at ``size`` px, or None:
    images, or a classifier, FedAvg's replies or a class mean at SD's latent size."""
    if v.method in MEAN_STAND_INS:
        return None if size >= LARGE_SIZE else (f"{size}px/{v.method}", f"{v.method}/class-mean")
    if v.method in (*CLASSIFIER_STAND_INS, *RECORD_ONLY_TESTS) and size >= LARGE_SIZE:
        return None
    cfg = FedBiPConfig.from_flat(variant_values(bench, v, 0))
    own = cfg.settings_of(v.method)
    if v.method == "fedavg":
        kind = next(k for k, part in FEDAVG_KINDS.items() if part == own.part)
        return fedavg_key(size, cfg), f"{kind}/{FEDAVG_ATTACK}"
    if v.method in CLASSIFIER_STAND_INS:
        epochs = getattr(own, "local_epochs", None) or own.epochs
        return classifier_key(size, cfg.classifier.init, epochs), CLASSIFIER_ATTACK
    if getattr(own, "private", False):
        kind = DP_STAND_INS[v.method]
        return f"{size}px/T={timestep}/{kind}/epsilon={own.dp_epsilon:g}", f"{kind}/mean-filter"
    attack = STAND_IN_ATTACKS.get(v.method)
    if attack is None:
        return None
    draws = getattr(own, "latents_per_image", None) or own.noisings
    return f"{size}px/T={timestep}/K={draws}", attack


def classifier_key(size: int, init: str, epochs: int) -> str:
    """A server_attacks record's key for a client classifier's upload: its start and epochs."""
    return f"{size}px/classifier/init={init}/epochs={epochs}"


def fedavg_key(size: int, cfg: FedBiPConfig) -> str:
    """A server_attacks record's key for a FedAvg run's replies: what travels, from where, and
    how many rounds of how many local epochs (a head always starts on the public backbone)."""
    own = cfg.settings_of("fedavg")
    start = "pretrained" if own.part == "head" else cfg.classifier.init
    return (
        f"{size}px/fedavg/part={own.part}/init={start}/rounds={own.rounds}"
        f"/local-epochs={own.local_epochs}"
    )


def record_seed(record: Mapping[str, Any]) -> int:
    """The ``--seed`` a server_attacks record was made with (0 where the command left it out)."""
    words = record["command"].split()
    return int(words[words.index("--seed") + 1]) if "--seed" in words else 0


def stand_in_attacks(
    bench: Bench, timestep: int, size: int, models: Mapping[str, str]
) -> dict[str, dict]:
    """Per row (name -> its model's digest) with a stand-in at ``size`` px: its kind's AUC over
    the seeds of the records made with that model (the first record of a seed that holds it),
    summarized as :func:`server_attack_summary` does."""
    records = [
        json.loads(path.read_text())
        for path in (bench.results / name for name in ATTACK_RECORDS)
        if path.exists()
    ]
    out = {}
    for name, model in models.items():
        setting = stand_in_setting(bench, variant(name), timestep, size)
        if setting is None:
            continue
        key, attack = setting
        per_seed: dict[int, dict[str, dict[str, float]]] = {}
        for record in records:
            if record.get("provenance", {}).get("model") != model:
                continue
            found = {
                domain: {
                    "auc": a["auc"],
                    "auc_stderr": a["auc_stderr"],
                    "tpr_at_low_fpr": a["tpr_at_max_fpr"],
                }
                for domain, settings in record["results"].items()
                if (a := settings.get(key, {}).get("attacks", {}).get(attack))
            }
            if found:
                per_seed.setdefault(record_seed(record), found)
        if per_seed:
            out[name] = {**server_attack_summary(per_seed), "setting": key, "attack": attack}
    return out


# The server's loss-ratio test on the conditioning learnt beside the latents (FedBiP's S and V,
# Espresso's conditions): scripts/server_attacks.py's records, the first record of a seed that
# holds a cell counting. At SD's latent size only on the UNet continued at 256 px
# (CONDITIONING_LARGE_MODEL, named by its digest in a record's provenance): the shipped UNet,
# trained at 4x16x16, fails the test's positive control there.
CONDITIONING_RECORDS = (
    "server_attacks_concepts_h200_seed0.json",
    "server_attacks_concepts_h200_seed1.json",
    "server_attacks_concepts_h200_seed2.json",
    "server_attacks_concepts_256px_control_seed0.json",
    "server_attacks_concepts_256px_control_painting_seed1.json",
    "server_attacks_concepts_256px_control_quickdraw_seed0.json",
    "server_attacks_concepts_256px_control_quickdraw_seed1.json",
    "server_attacks_concepts_256px_control_sketch_seed0.json",
    "server_attacks_concepts_256px_control_sketch_seed1.json",
    "server_attacks_concepts_256px_painting_seed0.json",
    "server_attacks_concepts_256px_painting_seed1.json",
    "server_attacks_concepts_256px_painting_seed2.json",
    "server_attacks_concepts_256px_quickdraw_seed0.json",
    "server_attacks_concepts_256px_quickdraw_seed1.json",
    "server_attacks_concepts_256px_quickdraw_seed2.json",
    "server_attacks_concepts_256px_sketch_seed0.json",
    "server_attacks_concepts_256px_sketch_seed1.json",
    "server_attacks_concepts_256px_sketch_seed2.json",
    "server_attacks_conditions_seed0.json",
    "server_attacks_conditions_seed1.json",
    "server_attacks_conditions_seed2.json",
    "server_attacks_conditions_256px_control_seed0.json",
    "server_attacks_conditions_256px_control_painting_seed1.json",
    "server_attacks_conditions_256px_control_quickdraw_seed0.json",
    "server_attacks_conditions_256px_control_sketch_seed0.json",
    "server_attacks_conditions_256px_painting_seed0.json",
    "server_attacks_conditions_256px_painting_seed1.json",
    "server_attacks_conditions_256px_painting_seed2.json",
    "server_attacks_conditions_256px_quickdraw_seed0.json",
    "server_attacks_conditions_256px_quickdraw_seed1.json",
    "server_attacks_conditions_256px_quickdraw_seed2.json",
    "server_attacks_conditions_256px_sketch_seed0.json",
    "server_attacks_conditions_256px_sketch_seed1.json",
    "server_attacks_conditions_256px_sketch_seed2.json",
    "server_attacks_dp_seed0.json",
    "server_attacks_dp_seed1.json",
    "server_attacks_dp_seed2.json",
)
CONDITIONING_LARGE_MODEL = Path("models") / "miniature-ldm-256px"
NO_DIGEST = "not recorded"  # a record made before provenance named the model
# the DP mixture mode's concepts (DP-SGD under the rest of the upload's epsilon): its records key
# an upload by its epsilon, the concepts' test one of the upload's attacks
DP_MIXTURE = "fedbip-mixture-dp"
CONCEPT_ATTACK = "concepts/loss-ratio"  # the loss-ratio test on uploaded S and V
DP_CONCEPTS_METHOD = methods.fedbip_mixture.FedBiPMixture.name
CONDITIONING_TESTS = {
    "concepts": "FedBiP's concepts",
    DP_MIXTURE: "fedbip-mixture-DP's concepts",
    "espresso-conditions": "Espresso's conditions",
}


class ConditioningSetting(NamedTuple):
    """A conditioning test's budget and image size, as a server_attacks record keys it."""

    test: str  # a key of CONDITIONING_TESTS
    shots: int  # per class
    epochs: int
    px: int
    epsilon: float | None = None  # a DP upload's

    @property
    def key(self) -> str:
        return f"{self.px}px/{self.test}/shots={self.shots}/epochs={self.epochs}"

    @classmethod
    def of(cls, key: str) -> ConditioningSetting:
        _, test, *budget = key.split("/")
        shots, epochs = (int(part.split("=")[1]) for part in budget)
        return cls(test, shots, epochs, key_px(key))


def key_px(key: str) -> int:
    """The image size of a server_attacks record key (``SIZEpx/...``)."""
    return int(key.split("/")[0].removesuffix("px"))


@dataclass
class ConditioningCell:
    """One domain's loss-ratio test on one conditioning kind, budget and size, per seed."""

    auc: dict[int, float]
    tpr_at_low_fpr: dict[int, float]
    kinds: set[str]  # the machine kinds (a GPU by name) the seeds ran on
    models: set[str]  # the LDMs' digests the seeds ran (records before the field: none named)

    def text(self) -> str:
        """AUC (± sample std over seeds, where more than one) / mean TPR at 1% FPR (seeds)."""
        aucs = list(self.auc.values())
        spread = f" ± {_std(aucs):.3f}" if len(aucs) > 1 else ""
        seeds = ", ".join(map(str, sorted(self.auc)))
        tpr = statistics.fmean(self.tpr_at_low_fpr.values())
        return f"{statistics.fmean(aucs):.3f}{spread} / {tpr:.2f} ({seeds})"


def conditioning_result(
    key: str, entry: Mapping[str, Any], dp_budget: tuple[int, int]
) -> tuple[ConditioningSetting, Mapping[str, Any]]:
    """A record entry's setting and loss-ratio result; a DP upload's (keyed
    ``SIZEpx/fedbip-mixture-dp/epsilon=E``) trained on ``dp_budget`` (shots, epochs)."""
    if "epsilon" not in entry:
        ((_, found),) = entry["attacks"].items()
        return ConditioningSetting.of(key), found
    setting = ConditioningSetting(DP_MIXTURE, *dp_budget, key_px(key), entry["epsilon"])
    return setting, entry["attacks"][f"{DP_MIXTURE}/{CONCEPT_ATTACK}"]


def conditioning_attacks(
    bench: Bench, large_model: str
) -> dict[ConditioningSetting, dict[str, ConditioningCell]]:
    """Per setting, per domain, the loss-ratio test's
    figures over the seeds of :data:`CONDITIONING_RECORDS`; a cell at SD's latent size only
    from a record made on ``large_model`` (a digest). A DP upload's concepts are trained on the
    mixture mode's budget in the run config."""
    cfg = FedBiPConfig.from_flat({**base_values(bench, 0), "method": DP_CONCEPTS_METHOD})
    dp_budget = cfg.data.shots_per_class, cfg.settings_of(DP_CONCEPTS_METHOD).concept_epochs
    out: dict[ConditioningSetting, dict[str, ConditioningCell]] = {}
    for path in (bench.results / name for name in CONDITIONING_RECORDS):
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        seed, made = record_seed(record), record["provenance"]
        kind = made["machine"]["kind"] if record["device"] == "cpu" else record["device"]
        for domain, settings in record["results"].items():
            for key, entry in settings.items():
                setting, found = conditioning_result(key, entry, dp_budget)
                if setting.px >= LARGE_SIZE and made.get("large_model") != large_model:
                    continue
                cell = out.setdefault(setting, {}).setdefault(
                    domain, ConditioningCell({}, {}, set(), set())
                )
                if seed not in cell.auc:
                    cell.auc[seed] = found["auc"]
                    cell.tpr_at_low_fpr[seed] = found["tpr_at_max_fpr"]
                    cell.kinds.add(kind)
                    model = large_model if setting.px >= LARGE_SIZE else made.get("model")
                    cell.models.add(model or NO_DIGEST)
    return out

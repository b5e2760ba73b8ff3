"""Summaries over seeds: per row the mean and sample std of accuracy and the mean of every other
measurement, never over two models and over machine kinds only when asked (:func:`summarize`);
the server's test on the uploads over seeds (:func:`server_attack_summary`); and the paired
per-seed differences of :data:`~.variants.COMPARISONS` with their 95% t-intervals
(:func:`differences`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scipy import stats

from .. import provenance
from .measurements import JUDGES, SERVER_ATTACK
from .variants import COMPARISONS, VARIANTS


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _average(values: list[Any]) -> Any:
    """Mean over seeds of numbers, or of (nested) dicts of numbers, key by key; None (a dash in
    the tables) for whatever some seed did not measure, so that no mean is of fewer seeds than
    the row's accuracy."""
    if not values or any(v is None for v in values):
        return None
    if isinstance(values[0], dict):
        shared = [k for k in values[0] if all(k in v for v in values)]
        return {k: _average([v[k] for v in values]) for k in shared} or None
    return statistics.fmean(values)


def summarize(
    runs: Mapping[int, Mapping[str, Any]], *, mix_machine_kinds: bool = False
) -> dict[str, Any]:
    """Per variant: per-domain and mean accuracy (mean and sample std over seeds), the mean over
    seeds of every other measurement, and what the seeds were made with. A row whose seeds span
    machine kinds raises :class:`~fedbip_tools.provenance.MixedMachineKinds` unless
    ``mix_machine_kinds``."""
    out: dict[str, Any] = {}
    for v in VARIANTS:
        seeds = sorted(s for s, r in runs.items() if v.name in r)
        if not seeds:
            continue
        rows = [runs[s][v.name] for s in seeds]
        domains = list(rows[0]["per_domain"])
        means = [r["mean"] for r in rows]
        entry = {
            "seeds": seeds,
            "made_with": provenance.made_with({s: runs[s][v.name] for s in seeds}),
            "per_domain": {d: statistics.fmean(r["per_domain"][d] for r in rows) for d in domains},
            "per_domain_std": {d: _std([r["per_domain"][d] for r in rows]) for d in domains},
            "mean": statistics.fmean(means),
            "std": _std(means),
        }
        for key in (
            set().union(*rows)
            - entry.keys()
            - {"per_domain", "mean", "provenance", "model", SERVER_ATTACK, JUDGES}
        ):
            entry[key] = _average([r.get(key) for r in rows])
        if entry.get("fidelity"):
            entry[JUDGES] = {str(s): r.get(JUDGES) for s, r in zip(seeds, rows)}
        if attacked := {s: r[SERVER_ATTACK] for s, r in zip(seeds, rows) if SERVER_ATTACK in r}:
            entry[SERVER_ATTACK] = server_attack_summary(attacked)
        if entry.get("mia_gap"):
            entry["mia_gap_std"] = {
                k: _std([r["mia_gap"][k] for r in rows]) for k in entry["mia_gap"]
            }
        if all("mia" in r for r in rows):
            entry["mia_auc_std"] = _std([r["mia"]["auc"] for r in rows])
        out[v.name] = entry
    provenance.refuse_mixed_models({name: e["made_with"] for name, e in out.items()})
    if not mix_machine_kinds:
        provenance.refuse_mixed({name: e["made_with"] for name, e in out.items()})
    return out


def server_attack_summary(per_seed: Mapping[int, Mapping[str, Mapping[str, float]]]) -> dict:
    """The server's test on the uploads over the seeds whose run folders it was run on (not
    every seed's may be: it needs the accepted uploads): per domain AUC mean and sample std,
    TPR at 1% FPR mean, and which seeds."""
    domains = set.intersection(*(set(d) for d in per_seed.values()))
    return {
        "seeds": sorted(per_seed),
        "per_domain": {
            d: {
                "auc": statistics.fmean(r[d]["auc"] for r in per_seed.values()),
                "auc_std": _std([r[d]["auc"] for r in per_seed.values()]),
                "auc_stderr": statistics.fmean(r[d]["auc_stderr"] for r in per_seed.values()),
                "tpr_at_low_fpr": statistics.fmean(
                    r[d]["tpr_at_low_fpr"] for r in per_seed.values()
                ),
            }
            for d in sorted(domains)
        },
    }


@dataclass(frozen=True)
class Difference:
    """Row ``a`` minus row ``b`` seed by seed, with the mean and its 95% t-interval's
    half-width (None from one seed)."""

    a: str
    b: str
    per_seed: dict[int, float]
    mean: float
    half_width: float | None

    @property
    def distinguishable(self) -> bool:
        """Whether the interval leaves out 0."""
        return self.half_width is not None and abs(self.mean) > self.half_width


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Mean and half-width of the two-sided t-interval over ``values`` (two or more)."""
    n = len(values)
    quantile = float(stats.t.ppf((1 + level) / 2, n - 1))
    return statistics.fmean(values), quantile * statistics.stdev(values) / math.sqrt(n)


def paired(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two rows of a seed compare: made on one machine kind, with one model."""
    return provenance.kind(a) == provenance.kind(b) and a.get("model") == b.get("model")


def paired_difference(runs: Mapping[int, Mapping[str, Any]], a: str, b: str) -> Difference | None:
    """Mean accuracy of ``a`` minus ``b`` over the seeds that have both made on one machine
    kind with one model; None where no seed has."""
    per_seed = {
        seed: rows[a]["mean"] - rows[b]["mean"]
        for seed, rows in sorted(runs.items())
        if a in rows and b in rows and paired(rows[a], rows[b])
    }
    if not per_seed:
        return None
    values = list(per_seed.values())
    mean, half = t_interval(values) if len(values) > 1 else (values[0], None)
    return Difference(a, b, per_seed, mean, half)


def differences(runs: Mapping[int, Mapping[str, Any]]) -> list[Difference]:
    """The paired differences of :data:`COMPARISONS` that some seed has both rows of."""
    found = (paired_difference(runs, a, b) for a, b in COMPARISONS)
    return [d for d in found if d is not None]

"""Is the shipped backbone a fair start? The default federation's floor and FedBiP's margin.

A fair start (issue 46) helps the classifier learn from synthetic images without solving the
task by itself. For each seed this runs the README's default federation (a real ``flwr run``,
three clients) as FedBiP and as Prompts-only (the floor: no client-derived image), once per
``classifier.init``, and records per-domain accuracy, the classifier's seconds and the machine.
Reported: each init's mean per method and domain, and FedBiP's paired per-seed margin over
Prompts-only on the rare domains (sketch, quickdraw) with its 95% t-interval.

    python scripts/fair_start_check.py --seeds 0 1 2 --out benchmarks/fair_start.json

Runs already in ``--work`` (their metrics.json) are reused, so an interrupted check resumes.
The classifier's own seed spread on one synthetic set: ``scripts/backbone_check.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from scipy import stats

from fedbip_flwr import results
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.paths import project_dir
from fedbip_flwr.server import RunFolder
from fedbip_tools import provenance
from fedbip_tools.simulation import run_simulation, run_status, stop_local_superlink

METHODS = ("fedbip", "prompts-only")
RARE = ("sketch", "quickdraw")


def run_once(work: Path, method: str, init: str, seed: int) -> dict:
    """One default federation (README's first command) with these three settings changed."""
    name = f"{method}-{init}-seed{seed}"
    folder = RunFolder(work / "outputs" / name)
    if not folder.metrics.exists():
        values = {
            "method": method,
            "classifier.init": init,
            "seed": seed,
            "output-dir": str(work / "outputs"),
            "run-name": name,
        }
        home = work / "flwr-home"
        try:
            run_id, output = run_simulation(home, values, 3, timeout=1800)
            if run_status(home, run_id) != "finished:completed":
                raise SystemExit(f"{name} did not complete:\n{output[-3000:]}")
        finally:
            stop_local_superlink(home)
    record = results.read(folder.metrics)
    return {
        "method": method,
        "init": init,
        "seed": seed,
        "run": str(folder.root),
        "per_domain": record.accuracy.per_domain,
        "mean": record.accuracy.mean,
        "classifier_seconds": record.seconds.classifier if record.seconds else None,
    }


def margin(rows: list[dict], init: str, domain: str) -> dict:
    """FedBiP minus Prompts-only on ``domain``, paired by seed: mean and 95% t-interval."""
    score = {(r["method"], r["seed"]): r["per_domain"][domain] for r in rows if r["init"] == init}
    seeds = sorted(
        {s for m, s in score if m == "fedbip"} & {s for m, s in score if m == "prompts-only"}
    )
    diffs = [score["fedbip", s] - score["prompts-only", s] for s in seeds]
    mean = statistics.fmean(diffs)
    half = (
        stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5
        if len(diffs) > 1
        else float("nan")
    )
    return {
        "seeds": seeds,
        "differences": diffs,
        "mean": mean,
        "low": mean - half,
        "high": mean + half,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--inits", nargs="+", default=["pretrained", "random"])
    parser.add_argument("--work", type=Path, default=Path("outputs/fair-start"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/fair_start.json"))
    args = parser.parse_args()
    started, rows = time.time(), []
    for seed in args.seeds:
        for init in args.inits:
            for method in METHODS:
                rows.append(run_once(args.work.resolve(), method, init, seed))
                r = rows[-1]
                print(
                    f"seed {seed} {init} {method}: {100 * r['mean']:.1f}% "
                    + ", ".join(f"{d} {100 * a:.1f}" for d, a in r["per_domain"].items()),
                    flush=True,
                )
    margins = {init: {d: margin(rows, init, d) for d in RARE} for init in args.inits}
    print(
        "\n| init | method | "
        + " | ".join(rows[0]["per_domain"])
        + " | mean |\n|---|---|"
        + "---|" * (len(rows[0]["per_domain"]) + 1)
    )
    for init in args.inits:
        for method in METHODS:
            mine = [r for r in rows if r["init"] == init and r["method"] == method]
            cells = [
                statistics.fmean(r["per_domain"][d] for r in mine) for d in mine[0]["per_domain"]
            ]
            print(
                f"| {init} | {method} | "
                + " | ".join(f"{100 * c:.1f}" for c in cells)
                + f" | {100 * statistics.fmean(r['mean'] for r in mine):.1f} |"
            )
    for init, per_domain in margins.items():
        for domain, m in per_domain.items():
            print(
                f"{init}: FedBiP - Prompts-only on {domain}: {100 * m['mean']:+.1f} points "
                f"[{100 * m['low']:+.1f}, {100 * m['high']:+.1f}] over seeds {m['seeds']}"
            )
    record = {
        "command": "python scripts/fair_start_check.py "
        + " ".join(
            [f"--seeds {' '.join(map(str, args.seeds))}", f"--inits {' '.join(args.inits)}"]
        ),
        "provenance": provenance.record(
            project_dir(),
            torch.get_num_threads(),
            [args.work],
            model=project_dir() / FedBiPConfig().ldm.model,
        ),
        "seconds": time.time() - started,
        "runs": rows,
        "rare_margins": margins,
    }
    args.out.write_text(json.dumps(record, indent=1))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()

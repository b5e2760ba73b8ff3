"""The README's first command, run as a newcomer runs it: N times, each from a fresh FLWR_HOME.

Each run is the exact command (``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 RAY_DEDUP_LOGS=0
flwr run . --stream --federation-config "num-supernodes=3 client-resources-num-cpus=1"``, the
project's defaults, no run config), timed from the outside. Recorded per run: accuracy per
domain and their mean, the server's phase seconds, the wall time and the load average before
it started; once: the provenance (commit, machine kind, library versions, date). The README's
first row quotes ``benchmarks/default_run.json``.

    python scripts/default_runs.py --runs 5 --out benchmarks/default_run.json

A change to the default is weighed with the same runs: ``--seeds`` replays each seed's client
noise (``seed=N federation.replayable-client-noise=true``, one run per seed), ``--run-config``
adds the change, and ``--judges`` records each run's judged class and domain fidelity per domain:

    python scripts/default_runs.py --seeds 0 1 2 --run-config "synthesis.start-timestep=799" \
        --judges outputs/benchmark/judges.safetensors --out /tmp/t799.json

``--federation-config`` weighs the simulation's resources the same way (e.g.
``client-resources-num-cpus=2``: one client at a time on two cores, Flower's default).

Run it on an idle machine: the wall times are the figures. Each run leaves its run folder
under outputs/ as the command always does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fedbip_flwr import results
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.paths import project_dir
from fedbip_flwr.server import RunFolder
from fedbip_tools import provenance
from fedbip_tools.judges import Judges, judge_run, load_judges, write_fidelity
from fedbip_tools.simulation import flwr_tool, stop_local_superlink

COMMAND = [
    "run",
    ".",
    "--stream",
    "--federation-config",
    "num-supernodes=3 client-resources-num-cpus=1",
]


@dataclass(frozen=True)
class Judged:
    """The judges every run is scored by, loaded once, and where they were read from."""

    judges: Judges
    path: Path


def run_config(seed: int | None, extra: str) -> list[str]:
    """The ``--run-config`` the command gets: none for the README's own runs."""
    pairs = (
        [f"seed={seed}", "federation.replayable-client-noise=true"] if seed is not None else []
    ) + (extra.split() if extra else [])
    return ["--run-config", " ".join(pairs)] if pairs else []


def command(federation: str) -> list[str]:
    """The README's first command, its ``--federation-config`` extended by ``federation``."""
    return [*COMMAND[:-1], f"{COMMAND[-1]} {federation}".strip()]


def one_run(
    root: Path, timeout: float, config: list[str], federation: str, judges: Judged | None
) -> dict:
    """The README's first command from a fresh FLWR_HOME; what it wrote and how long it took."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="flwr-home-") as home:
        env = {
            **os.environ,
            "FLWR_HOME": home,
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "RAY_DEDUP_LOGS": "0",
        }
        started = time.monotonic()
        try:
            done = subprocess.run(
                [flwr_tool("flwr"), *command(federation), *config],
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            wall = time.monotonic() - started
        finally:
            stop_local_superlink(Path(home))
    output = done.stdout + done.stderr
    match = re.search(r"Successfully started run (\d+)", output)
    folder = RunFolder(root / "outputs" / f"run-{match.group(1)}") if match else None
    if done.returncode != 0 or folder is None or not folder.metrics.exists():
        raise SystemExit(
            f"the README's first command failed (exit {done.returncode}):\n{output[-3000:]}"
        )
    record = results.read(folder.metrics)
    if (
        record.status != "completed"
        or record.accuracy is None
        or record.accuracy.per_domain is None
    ):
        raise SystemExit(f"{folder.root}: the run did not complete ({record.status})")
    fidelity = None
    if judges is not None:
        judged = judge_run(folder, judges.judges, judges.path)
        write_fidelity(judged, folder.root)
        fidelity = {d: j.model_dump() for d, j in judged.per_domain.items()}
    return {
        "run": str(folder.root.relative_to(root)),
        "run_config": " ".join(config[1:]),
        "fidelity": fidelity,
        "wall_seconds": wall,
        "load_before": load,
        "per_domain": record.accuracy.per_domain,
        "mean": record.accuracy.mean,
        "seconds": record.seconds.phases() if record.seconds else {},
    }


def summary(runs: list[dict]) -> dict:
    means, walls = [r["mean"] for r in runs], [r["wall_seconds"] for r in runs]
    classifier = [r["seconds"].get("classifier", float("nan")) for r in runs]
    return {
        "mean": statistics.fmean(means),
        "std": statistics.stdev(means) if len(means) > 1 else 0.0,
        "min": min(means),
        "max": max(means),
        "wall_min": min(walls),
        "wall_median": statistics.median(walls),
        "wall_max": max(walls),
        "classifier_median": statistics.median(classifier),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/default_run.json"))
    parser.add_argument(
        "--seeds", type=int, nargs="+", help="one run per seed, its client noise replayed"
    )
    parser.add_argument("--run-config", default="", help="run config added to every run")
    parser.add_argument(
        "--federation-config",
        default="",
        help="added to the command's --federation-config, e.g. client-resources-num-cpus=1",
    )
    parser.add_argument("--judges", type=Path, help="judge each run's synthetic set with these")
    args = parser.parse_args()
    root = project_dir() or Path.cwd()
    seeds: list[int | None] = args.seeds if args.seeds else [None] * args.runs
    record = {
        "command": "python " + " ".join(sys.argv),
        "readme_command": "flwr " + " ".join(COMMAND),
        "federation_config": command(args.federation_config)[-1],
        "provenance": provenance.record(
            root, torch.get_num_threads(), [root / "outputs"], model=root / FedBiPConfig().ldm.model
        ),
        "runs": [],
    }
    judges = Judged(load_judges(args.judges), args.judges) if args.judges else None
    for i, seed in enumerate(seeds):
        config = run_config(seed, args.run_config)
        record["runs"].append(one_run(root, args.timeout, config, args.federation_config, judges))
        r = record["runs"][-1]
        print(
            f"run {i + 1}/{len(seeds)} {' '.join(config[1:])}: {100 * r['mean']:.1f}% ("
            + ", ".join(f"{d} {100 * a:.1f}" for d, a in r["per_domain"].items())
            + f") in {r['wall_seconds']:.0f} s, classifier {r['seconds'].get('classifier', 0):.0f} s, "
            f"load before {r['load_before']:.2f}",
            flush=True,
        )
        if r["fidelity"]:
            print(
                "  judged class / domain fidelity: "
                + ", ".join(
                    f"{d} {100 * j['class_fidelity']:.1f} / {100 * j['domain_fidelity']:.1f}"
                    for d, j in r["fidelity"].items()
                ),
                flush=True,
            )
    record["summary"] = s = summary(record["runs"])
    args.out.write_text(json.dumps(record, indent=1))
    print(
        f"mean {100 * s['mean']:.1f} ± {100 * s['std']:.1f} (min {100 * s['min']:.1f}), wall "
        f"{s['wall_min']:.0f} / {s['wall_median']:.0f} / {s['wall_max']:.0f} s (min / median / max), "
        f"classifier median {s['classifier_median']:.0f} s; written {args.out}"
    )


if __name__ == "__main__":
    main()

"""Does a domain's accuracy come from its own client's synthetic images, or from the others'?

On finished runs (their synthetic shards and config, nothing of them changed), the global
classifier is trained again with the run's recipe (seed, steps, start, precise BN) on the
synthetic images of ``--clients`` alone, and scored on the server's test sets of every domain,
beside the run's own scores (every client's images). A method whose painting accuracy falls
short although its painting client's images are as faithful (class and domain judged) as
another's: if both score alike from the painting client's images alone, the gap comes from what
the other clients' images add to painting.

``--set KEY=VALUE`` changes the recipe instead (or as well), as ``--run-config`` would have:
every client's images retrained with, say, fewer epochs on a cosine schedule, scored beside the
run's own recipe on the same synthetic set. ``--seeds`` retrains each run once per classifier
seed (its initial weights, data order and augmentation), so the spread the classifier alone
adds to a run is measured on one synthetic set.

    python scripts/client_share_check.py RUN [RUN ...] --clients painting-0 --out FILE
    python scripts/client_share_check.py RUN [RUN ...] --set classifier.epochs=6 --out FILE
    python scripts/client_share_check.py RUN --seeds 0 1 2 3 4 --out FILE
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from fedbip_flwr import dataset, results
from fedbip_flwr.classifier import build_classifier, train_classifier
from fedbip_flwr.config import ConfigError, FedBiPConfig
from fedbip_flwr.server import RunFolder, evaluate_models, synthetic_dataset, train_settings
from fedbip_flwr.storage import write_json
from fedbip_tools import provenance

ROOT = Path(__file__).resolve().parents[1]


def retrain(run: Path, clients: list[str], changes: dict[str, str]) -> dict:
    """The run's classifier trained again on ``clients``' synthetic images alone (none: all),
    its recipe changed by ``changes``, scored on every domain's test set; with the run's own
    scores beside."""
    folder = RunFolder(run)
    recorded = results.read(folder.metrics)
    try:
        run_config = FedBiPConfig.from_recorded(recorded.config).to_flat()
        cfg = FedBiPConfig.from_flat({**run_config, **changes})
    except ConfigError as err:
        raise SystemExit(f"{run}: {err}") from None
    shards = folder.training_shards()
    clients = clients or sorted(shards)
    missing = sorted(set(clients) - set(shards))
    if missing:
        raise SystemExit(f"{run}: no client {missing} (it has {sorted(shards)})")
    data = synthetic_dataset({c: shards[c] for c in clients}, cfg.classifier.image_size)
    tests = {
        d: (s.images, s.labels)
        for d, s in dataset.load_test_sets(cfg.data_description, cfg.data.domain_list).items()
    }
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)  # the initial weights, as the server's train_global seeds them
    model = build_classifier(
        len(dataset.class_names(cfg.data_description)), cfg.classifier.init, cfg.ldm.model
    )
    train_classifier(model, data, None, train_settings(cfg.classifier), seed=cfg.seed)
    scored = evaluate_models({"global": model}, tests, cfg.classifier.image_size, "cpu")
    return {
        "run": str(run),
        "method": cfg.method,
        "seed": cfg.seed,
        "clients": clients,
        "changes": changes,
        "images": len(data),
        "per_domain": scored["per_domain"],
        "run_per_domain": recorded.accuracy.per_domain,
        "seconds": round(time.perf_counter() - started, 1),
    }


def parse_change(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"--set {item!r}: not KEY=VALUE")
    return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="completed run folders")
    parser.add_argument("--clients", nargs="+", default=[], help="client ids to train on (all)")
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="run-config keys to change"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[], help="classifier seeds (the run's own)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    changes = dict(parse_change(item) for item in args.set)
    made = provenance.record(ROOT, torch.get_num_threads(), [args.out])
    command = f"python {shlex.join(sys.argv)}"
    rows = []
    seeds = [{"seed": str(seed)} for seed in args.seeds] or [{}]
    for run, seed in ((run, seed) for run in args.runs for seed in seeds):
        row = retrain(run, args.clients, {**changes, **seed})
        rows.append(row)
        write_json(args.out, {"command": command, "provenance": made, "runs": rows})
        print(
            f"{run.name} seed {row['seed']}: {row['images']} images; "
            + ", ".join(
                f"{d} {100 * a:.1f} (run: {100 * row['run_per_domain'][d]:.1f})"
                for d, a in row["per_domain"].items()
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Does a domain's accuracy come from its own client's synthetic images, or from the others'?

On finished runs (their synthetic shards and config, nothing of them changed), the global
classifier is trained again with the run's recipe (seed, steps, start, precise BN) on the
synthetic images of ``--clients`` alone, and scored on the server's test sets of every domain,
beside the run's own scores (every client's images). A method whose painting accuracy falls
short although its painting client's images are as faithful (class and domain judged) as
another's: if both score alike from the painting client's images alone, the gap comes from what
the other clients' images add to painting.

    python scripts/client_share_check.py RUN [RUN ...] --clients painting-0 --out FILE
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from fedbip_flwr import dataset, results
from fedbip_flwr.classifier import build_classifier, train_classifier
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.server import RunFolder, evaluate_models, synthetic_dataset, train_settings
from fedbip_flwr.storage import write_json
from fedbip_tools import provenance

ROOT = Path(__file__).resolve().parents[1]


def retrain(run: Path, clients: list[str]) -> dict:
    """The run's classifier trained again on ``clients``' synthetic images alone, scored on every
    domain's test set; with the run's own scores beside."""
    folder = RunFolder(run)
    recorded = results.read(folder.metrics)
    cfg = FedBiPConfig.from_flat(recorded.config)
    shards = folder.training_shards()
    missing = sorted(set(clients) - set(shards))
    if missing:
        raise SystemExit(f"{run}: no client {missing} (it has {sorted(shards)})")
    data = synthetic_dataset({c: shards[c] for c in clients}, cfg.classifier_image_size)
    tests = {
        d: (s.images, s.labels)
        for d, s in dataset.load_test_sets(cfg.data, cfg.domain_list).items()
    }
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)  # the initial weights, as the server's train_global seeds them
    model = build_classifier(len(dataset.class_names(cfg.data)), cfg.classifier_init, cfg.model)
    train_classifier(model, data, None, train_settings(cfg), seed=cfg.seed)
    scored = evaluate_models({"global": model}, tests, cfg.classifier_image_size, "cpu")
    return {
        "run": str(run),
        "method": cfg.method,
        "seed": cfg.seed,
        "clients": clients,
        "images": len(data),
        "per_domain": scored["per_domain"],
        "run_per_domain": recorded.accuracy.per_domain,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="completed run folders")
    parser.add_argument("--clients", nargs="+", required=True, help="client ids to train on")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    made = provenance.record(ROOT, torch.get_num_threads(), [args.out])
    rows = []
    for run in args.runs:
        rows.append(retrain(run, args.clients))
        row = rows[-1]
        print(
            f"{run.name} seed {row['seed']}: {row['images']} images; "
            + ", ".join(
                f"{d} {100 * a:.1f} (run: {100 * row['run_per_domain'][d]:.1f})"
                for d, a in row["per_domain"].items()
            ),
            flush=True,
        )
    command = "python scripts/client_share_check.py " + " ".join(map(str, args.runs))
    command += f" --clients {' '.join(args.clients)} --out {args.out}"
    write_json(args.out, {"command": command, "provenance": made, "runs": rows})


if __name__ == "__main__":
    main()

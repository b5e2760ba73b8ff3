"""A finished run's classifier scored as the run left it and again with its BatchNorm statistics
re-estimated over the run's synthetic training set (precise BN, run config
``classifier.precise-bn``): the same trained weights, only the statistics differ, so the
difference is paired by construction.

Runs made before precise BN existed hold the running averages training left behind; on those
this is the A/B of the change. The re-estimation draws its batches from a generator seeded with
the run's seed (a run draws them after training, from the training generator: other batches,
the same set).

    python scripts/precise_bn_check.py outputs/run-A outputs/run-B ... [--out FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fedbip_flwr import dataset, results
from fedbip_flwr.classifier import Precision, load_classifier_bytes, recalibrate_batchnorm
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.server import RunFolder, evaluate_on_server, synthetic_dataset, train_settings
from fedbip_flwr.storage import write_json
from fedbip_tools import provenance


def check(run_dir: Path) -> dict:
    """Accuracy per domain with the run's own BatchNorm statistics and with re-estimated ones."""
    folder = RunFolder(run_dir)
    cfg = FedBiPConfig.from_recorded(results.read(run_dir).config)
    names = dataset.class_names(cfg.data_description)
    model = load_classifier_bytes(folder.classifier.read_bytes(), names)
    tests = {
        d: (t.images, t.labels)
        for d, t in dataset.load_test_sets(cfg.data_description, cfg.data.domain_list).items()
    }
    size = cfg.classifier.image_size
    before = evaluate_on_server(model, tests, size, "cpu")
    recalibrate_batchnorm(
        model,
        synthetic_dataset(folder.training_shards(), size),
        train_settings(cfg.classifier),
        torch.device("cpu"),
        Precision(),
        torch.Generator().manual_seed(cfg.seed),
    )
    after = evaluate_on_server(model, tests, size, "cpu")
    return {
        "run": str(run_dir),
        "as_trained": before["per_domain"],
        "precise_bn": after["per_domain"],
        "mean_as_trained": before["mean"],
        "mean_precise_bn": after["mean"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    record = {
        "runs": [],
        "provenance": provenance.record(
            root, torch.get_num_threads(), [args.out] if args.out else []
        ),
    }
    for run in args.runs:
        r = check(run)
        record["runs"].append(r)
        print(
            f"{run.name}: {100 * r['mean_as_trained']:.1f} -> {100 * r['mean_precise_bn']:.1f} ("
            + ", ".join(
                f"{d} {100 * r['as_trained'][d]:.1f} -> {100 * r['precise_bn'][d]:.1f}"
                for d in sorted(r["as_trained"])
            )
            + ")",
            flush=True,
        )
    diffs = [100 * (r["mean_precise_bn"] - r["mean_as_trained"]) for r in record["runs"]]
    print("paired difference, mean accuracy:", ", ".join(f"{d:+.1f}" for d in diffs))
    if args.out:
        write_json(args.out, record)
        print(f"written {args.out}")


if __name__ == "__main__":
    main()

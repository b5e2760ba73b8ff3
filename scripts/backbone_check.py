"""Does the classifier's starting point steady its answer? Random against the shipped backbone.

On a finished run (its synthetic shards and config, nothing of it changed), the global
classifier is trained again on the very same synthetic set with the run's recipe, once per
classifier seed and ``classifier.init`` (seeds outer, inits inner: both see the same machine
state), and scored on the server's test sets after every epoch. Reported per init: mean and
standard deviation of the final accuracy over the seeds, and the epochs needed: the first epoch
from which the seeds' mean accuracy stays within one point of its final value.

    python scripts/backbone_check.py outputs/<run> --seeds 0 1 2 3 4

The scoring between epochs draws no random numbers and puts the model back in training mode;
each curve's last point is the trained classifier as the server scores it (with
``classifier.precise-bn``, after its BatchNorm statistics are re-estimated), the earlier points
with the running statistics training keeps.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from safetensors import safe_open

from fedbip_flwr import dataset, results
from fedbip_flwr.classifier import backbone_path, build_classifier, load_backbone, train_classifier
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.server import RunFolder, evaluate_models, synthetic_dataset, train_settings

INITS = ("random", "pretrained")


def curve(cfg: FedBiPConfig, data, classes: list[str], tests: dict) -> list[float]:
    """Mean test accuracy after every epoch of the server's recipe under ``cfg``."""
    torch.manual_seed(cfg.seed)  # the initial weights, as train_global seeds them
    model = build_classifier(len(classes), cfg.classifier.init, cfg.ldm.model)
    scores: list[float] = []

    def on_epoch(_epoch: int, _loss: float) -> None:
        scores.append(
            evaluate_models({"global": model}, tests, cfg.classifier.image_size, "cpu")["mean"]
        )
        model.train()

    train_classifier(
        model, data, None, train_settings(cfg.classifier), seed=cfg.seed, on_epoch=on_epoch
    )
    scores[-1] = evaluate_models({"global": model}, tests, cfg.classifier.image_size, "cpu")["mean"]
    return scores


def backbone_classes(path: Path) -> list[str]:
    """The classes a shipped backbone's head was trained on (its metadata)."""
    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {}).get("backbone", "{}")).get("classes", [])


def epochs_needed(curves: list[list[float]]) -> int:
    """First epoch (1-based) from which the mean curve stays within 0.01 of its last value."""
    mean = [statistics.fmean(c[i] for c in curves) for i in range(len(curves[0]))]
    settled = [abs(m - mean[-1]) <= 0.01 for m in mean]
    return next(i + 1 for i in range(len(mean)) if all(settled[i:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a completed run folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--inits", nargs="+", choices=INITS, default=list(INITS))
    parser.add_argument("--out", type=Path, help="JSON of every curve")
    args = parser.parse_args()
    folder = RunFolder(args.run)
    flat = results.read(folder.metrics).config
    shards = folder.training_shards()
    base = FedBiPConfig.from_flat(flat)
    classes = dataset.class_names(base.data_description)
    data = synthetic_dataset(shards, base.classifier.image_size)
    tests = {
        d: (s.images, s.labels)
        for d, s in dataset.load_test_sets(base.data_description, base.data.domain_list).items()
    }
    print(f"{args.run}: {len(data)} synthetic images, {torch.get_num_threads()} torch threads")
    own = None
    if (
        backbone_classes(backbone_path(base.ldm.model)) == classes
    ):  # a head for the task: unfair start
        own = evaluate_models(
            {"backbone": load_backbone(backbone_path(base.ldm.model))},
            tests,
            base.classifier.image_size,
            "cpu",
        )
        print(
            f"the backbone's own head, no synthetic image: {100 * own['mean']:.1f}% "
            f"({', '.join(f'{d} {100 * a:.1f}' for d, a in own['per_domain'].items())})",
            flush=True,
        )
    else:
        print(
            "the backbone's head names other classes "
            f"({backbone_classes(backbone_path(base.ldm.model))}): "
            "it scores nothing on the task without synthetic images",
            flush=True,
        )
    curves: dict[str, list[list[float]]] = {init: [] for init in args.inits}
    for seed in args.seeds:
        for init in args.inits:
            cfg = FedBiPConfig.from_flat({**flat, "seed": seed, "classifier.init": init})
            curves[init].append(curve(cfg, data, classes, tests))
            print(
                f"seed {seed} {init}: {100 * curves[init][-1][-1]:.1f}% after "
                f"{len(curves[init][-1])} epochs",
                flush=True,
            )
    print("\n| classifier.init | mean accuracy (%) | std | epochs needed |\n|---|---|---|---|")
    for init, runs in curves.items():
        finals = [c[-1] for c in runs]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        print(
            f"| {init} | {100 * statistics.fmean(finals):.1f} | {100 * spread:.1f} | {epochs_needed(runs)} |"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {"run": str(args.run), "seeds": args.seeds, "own_head": own, "curves": curves},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

"""Does half precision change what the server makes? Synthesis judged, classifier scored.

On a finished FedBiP run (its persisted uploads, synthetic shards and config), nothing of the
run changed, everything written to a temporary folder:

- synthesis: every client's first pass made again from its upload in float32 and under the
  default half precision (bf16 autocast on a CPU with bf16 instructions), with the same eta;
  seconds, pixel differences, and the class and domain fidelity judges' scores of each;
- classifier: the global classifier retrained on the run's own shards with the run's recipe,
  once per seed with ``classifier.precision`` float32 and auto, scored on the server's test sets.

    python scripts/precision_check.py outputs/<run> --judges outputs/benchmark/judges.safetensors

With ``--skip-synthesis --precisions float32`` it measures the classifier's seed alone: how far
the accuracy moves between seeds on one and the same synthetic set (BENCHMARKS.md).

The judges are the benchmark's (trained on first use, about 20 minutes on 2 cores, then cached).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedbip_flwr import dataset, methods
from fedbip_flwr.classifier import Precision, ShardImages
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import load_for_run
from fedbip_flwr.methods import ServerJob
from fedbip_flwr.results import read as read_results
from fedbip_flwr.server import RunFolder, evaluate_models, load_persisted, train_global
from fedbip_tools.judges import Judges, load_judges

MODES = ("float32", "auto")


def synthesis(flat: dict, folder: RunFolder, judges: Judges, tmp: Path) -> None:
    """First pass of every client in float32 and half precision: seconds, differences, judges."""
    made: dict[bool, dict[str, torch.Tensor]] = {}
    for half in (False, True):
        cfg = FedBiPConfig.from_flat({**flat, "ldm.half-precision": half, "fedbip.multiplier": 1})
        ldm = load_for_run(cfg.ldm.model, "cpu", half, cfg.data.image_size)
        job = ServerJob(cfg, dataset.class_names(cfg.data_description), lambda ldm=ldm: ldm)
        method = methods.one_shot_for(cfg)
        uploads, _ = load_persisted(folder, lambda blob, m=method, j=job: m.accept(blob, server=j))
        out = RunFolder(tmp / f"half-{half}")
        started = time.perf_counter()
        shards = method.train_set(uploads, job, out.shard_path)
        seconds = time.perf_counter() - started
        made[half] = {}
        scores = []
        for client_id, paths in sorted(shards.items()):
            data = ShardImages(paths, judges.size)
            images, labels = data[torch.arange(len(data))]
            made[half][client_id] = images
            scores.append(judges.fidelity(images, labels, uploads[client_id].domain))
        n = sum(len(x) for x in made[half].values())
        fidelity = {k: statistics.fmean(s[k] for s in scores) for k in ("class", "domain")}
        print(
            f"synthesis {'half' if half else 'float32'} ({ldm.autocast or ldm.dtype}): {n} images "
            f"in {seconds:.1f} s ({n / seconds:.2f} images/s), class fidelity "
            f"{100 * fidelity['class']:.1f}%, domain fidelity {100 * fidelity['domain']:.1f}%"
        )
    diff = torch.cat([(made[True][c] - made[False][c]).abs().flatten() for c in made[False]])
    print(
        f"half vs float32 pixels in [-1, 1] at the judges' size: mean |diff| {diff.mean():.4f}, "
        f"max {diff.max():.3f}"
    )


def classifier(
    flat: dict, folder: RunFolder, seeds: list[int], modes: list[str], tmp: Path
) -> None:
    """The run's classifier retrained per seed in each precision, interleaved. With one mode it
    measures how much the classifier's seed alone moves the accuracy on one synthetic set."""
    shards = folder.training_shards()
    base = FedBiPConfig.from_flat(flat)
    classes = dataset.class_names(base.data_description)
    tests = {
        d: (s.images, s.labels)
        for d, s in dataset.load_test_sets(base.data_description, base.data.domain_list).items()
    }
    auto = Precision.for_device("cpu", "auto", base.classifier.image_size)
    print(f"classifier: auto = {auto}")
    rows: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for seed in seeds:
        for mode in modes:  # interleaved: both precisions see the same machine state
            cfg = FedBiPConfig.from_flat({**flat, "seed": seed, "classifier.precision": mode})
            model, facts = train_global(cfg, shards, classes, RunFolder(tmp), "cpu")
            score = evaluate_models({"global": model}, tests, cfg.classifier.image_size, "cpu")
            rows[mode].append((score["mean"], facts["classifier_seconds"]))
            domains = ", ".join(f"{d} {a:.3f}" for d, a in score["per_domain"].items())
            print(
                f"seed {seed} {mode}: accuracy {score['mean']:.3f} ({domains}) in "
                f"{facts['classifier_seconds']:.1f} s"
            )
    print("\n| classifier.precision | mean accuracy (%) | classifier seconds (median) |")
    print("|---|---|---|")
    for mode, results in rows.items():
        accuracy = [a for a, _ in results]
        spread = f" ± {100 * statistics.stdev(accuracy):.1f}" if len(accuracy) > 1 else ""
        print(
            f"| {mode} | {100 * statistics.fmean(accuracy):.1f}{spread} | "
            f"{statistics.median(s for _, s in results):.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a completed FedBiP run folder")
    parser.add_argument("--judges", type=Path, default=Path("outputs/benchmark/judges.safetensors"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--skip-synthesis", action="store_true")
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="classifier.precision modes to retrain with (one: the seed's effect alone)",
    )
    args = parser.parse_args()
    folder = RunFolder(args.run)
    flat = FedBiPConfig.from_recorded(read_results(folder.metrics).config).to_flat()
    print(f"{args.run}: {torch.get_num_threads()} torch threads")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_synthesis:
            synthesis(flat, folder, load_judges(args.judges), Path(tmp))
        classifier(flat, folder, args.seeds, args.precisions, Path(tmp))


if __name__ == "__main__":
    main()

"""One client's real images above what each of several finished runs synthesized from its
upload, class by class, so two settings of one federation can be compared by eye.

Column j shows class j // per_class in every row: the client's real images of that class, then
each run's first synthetic images of it.

    python scripts/runs_picture.py outputs/run-A outputs/run-B --labels "T = 999" "T = 799" \\
        --client quickdraw-0 --out docs/images/start-timestep-quickdraw.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fedbip_flwr import dataset, results
from fedbip_flwr.classifier import ShardImages
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.server import RunFolder
from fedbip_flwr.viz import image_grid


def by_class(
    images: torch.Tensor, labels: torch.Tensor, classes: int, per_class: int
) -> torch.Tensor:
    """The first ``per_class`` images of each class, class after class."""
    rows = [images[labels == c][:per_class] for c in range(classes)]
    short = [c for c, r in enumerate(rows) if len(r) < per_class]
    if short:
        raise ValueError(f"fewer than {per_class} images of class(es) {short}")
    return torch.cat(rows)


def synthetic(run_dir: Path, client_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    shards = RunFolder(run_dir).training_shards()
    if client_id not in shards:
        raise SystemExit(
            f"{run_dir}: no synthetic images of client {client_id!r} ({', '.join(shards)})"
        )
    data = ShardImages(
        shards[client_id], FedBiPConfig.from_recorded(results.read(run_dir).config).data.image_size
    )
    return data[torch.arange(len(data))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR")
    parser.add_argument("--labels", nargs="+", required=True, help="one row label per run")
    parser.add_argument("--client", required=True, help="client id, e.g. quickdraw-0")
    parser.add_argument("--per-class", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if len(args.labels) != len(args.runs):
        raise SystemExit(f"{len(args.runs)} runs but {len(args.labels)} labels")
    cfg = FedBiPConfig.from_recorded(results.read(args.runs[0]).config)
    partition = next(
        p for p in range(len(cfg.data.domain_list))
        if dataset.load_client_data(cfg.data_description, p).client_id == args.client
    )  # fmt: skip
    real = dataset.load_client_data(cfg.data_description, partition)
    classes = len(real.classes)
    rows = [by_class(real.images, real.labels, classes, args.per_class)]
    for run in args.runs:
        rows.append(by_class(*synthetic(run, args.client), classes, args.per_class))
    path = image_grid(
        rows, args.out, row_labels=["real", *args.labels], columns=classes * args.per_class
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Pretrain the miniature's ResNet-18 backbone, its "ImageNet"; run once.

``classifier.init = "pretrained"`` starts the global classifier from this backbone, as the SD
configurations start it from ImageNet weights. The shipped one is a fair start (``--corpus
public``): trained on :func:`fedbip_flwr.shapes.public_corpus`, shapes no task of this world uses
(:data:`~fedbip_flwr.shapes.PUBLIC_CLASSES`) in the common domains only, a split of its own that
shares no image with any client's, test or LDM-pretraining split (``tests/test_classifier_init.py``
checks the pixels). It never sees a task's label nor a rare domain, as ImageNet holds hardly any
sketch or quickdraw. ``--corpus ldm`` trains on the LDM's corpus labelled with the task's own
classes instead: its head solves the task before any upload (BENCHMARKS.md). A seeded held-out
slice of the corpus gives a validation accuracy.

The recipe is the server's (``fedbip_flwr.classifier``): torchvision's resnet18 from random
weights, inputs in [-1, 1] at 64 px, random padded crop and flip, SGD with momentum, batch 64,
``train_classifier`` itself. Deterministic given ``--seed`` (and ``--threads``): the step count
comes from ``--epochs`` (or ``--steps``), never from the clock. Saves the whole state dict (its
``fc`` is for the corpus's classes; "pretrained" replaces it) in float16 as
``<out>/model.safetensors`` (about 23 MB), and ``<out>/train_log.json``.

    python scripts/pretrain_backbone.py --per-class 300 --epochs 12 --threads 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
import torchvision

from fedbip_flwr import shapes
from fedbip_flwr.classifier import (
    TrainSettings,
    batches_per_epoch,
    build_classifier,
    evaluate,
    save_backbone,
    train_classifier,
)
from fedbip_flwr.viz import quantize

CORPUS_FUNCTION = "fedbip_flwr.shapes.pretraining_corpus"
PUBLIC_FUNCTION = "fedbip_flwr.shapes.public_corpus"
LDM_LOG = Path(__file__).resolve().parents[1] / "models" / "miniature-ldm" / "pretrain_log.json"
IMAGE_SIZE = 64  # the run config's classifier.image-size, and the corpus's own size


def ldm_corpus_args(log: Path = LDM_LOG) -> tuple[int, int]:
    """(per_class, seed) the miniature LDM was pretrained with (its log's first entry)."""
    args = json.loads(log.read_text())[0]["args"]
    return int(args["per_class"]), int(args["seed"])


def corpus_domains(per_class: int) -> list[tuple[str, int]]:
    """(domain, images per class) in the order :func:`shapes.pretraining_corpus` draws them."""
    return [
        (
            d,
            max(1, round(per_class * shapes.PRETRAIN_RARE_SHARE))
            if d in shapes.RARE_DOMAINS
            else per_class,
        )
        for d in shapes.DOMAINS
    ]


def labelled_corpus(per_class: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The LDM's pretraining corpus as uint8 images with their class labels and domains.

    The images are :func:`shapes.pretraining_corpus`'s own (the function the LDM was trained
    with); the labels follow its order (per domain, ``pretrain_set``'s class-major blocks) and
    are checked against every caption that names a class, so a change of that order fails here.
    """
    images, captions = shapes.pretraining_corpus(per_class, seed)
    labels, domains = [], []
    for domain, n in corpus_domains(per_class):
        labels += [c for c in range(len(shapes.CLASSES)) for _ in range(n)]
        domains += [domain] * (n * len(shapes.CLASSES))
    if len(labels) != len(images):
        raise RuntimeError(f"{CORPUS_FUNCTION} gave {len(images)} images, expected {len(labels)}")
    for i, (caption, label) in enumerate(zip(captions, labels, strict=True)):
        if caption and caption.rsplit(" ", 1)[-1] != shapes.CLASSES[label]:
            raise RuntimeError(
                f"corpus image {i}: caption {caption!r} but label {shapes.CLASSES[label]}"
            )
    return quantize(images), torch.tensor(labels), domains


def public_labelled(per_class: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """:func:`shapes.public_corpus` as uint8 images, labels of :data:`shapes.PUBLIC_CLASSES` and
    each image's domain."""
    corpus = shapes.public_corpus(per_class, seed)
    domains = [
        d for d in shapes.COMMON_DOMAINS for _ in range(per_class * len(shapes.PUBLIC_CLASSES))
    ]
    return quantize(corpus.images), corpus.labels, domains


CORPORA = {  # --corpus: (function, its classes, what the labels are)
    "public": (public_labelled, shapes.PUBLIC_CLASSES, PUBLIC_FUNCTION),
    "ldm": (labelled_corpus, shapes.CLASSES, CORPUS_FUNCTION),
}


def split(n: int, val_share: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, held-out validation rows): a seeded permutation's last ``val_share``."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = round(n * val_share)
    return order[: n - n_val].sort().values, order[n - n_val :].sort().values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("models/miniature-ldm/classifier-backbone")
    )
    parser.add_argument(
        "--corpus",
        choices=sorted(CORPORA),
        default="public",
        help="public: shapes no task uses (the fair start); ldm: the LDM's corpus, "
        "labelled with the task's own classes (solves the task before any upload)",
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument(
        "--steps", type=int, default=0, help="> 0: exactly this many SGD steps instead of --epochs"
    )
    parser.add_argument(
        "--per-class",
        type=int,
        default=0,
        help="corpus images per class per common domain; 0 = the LDM's (its pretrain_log.json)",
    )
    parser.add_argument("--corpus-seed", type=int, default=-1, help="-1 = the LDM's corpus seed")
    parser.add_argument("--val-share", type=float, default=0.1, help="held-out share of the corpus")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--seed", type=int, default=0, help="initial weights, split, data order, augmentation"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = all cores")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    ldm_per_class, ldm_seed = ldm_corpus_args()
    per_class = args.per_class or ldm_per_class
    corpus_seed = ldm_seed if args.corpus_seed < 0 else args.corpus_seed
    make_corpus, classes, corpus_function = CORPORA[args.corpus]
    images, labels, domains = make_corpus(per_class, corpus_seed)
    train_rows, val_rows = split(len(labels), args.val_share, args.seed)
    print(
        f"corpus: {len(labels)} images ({len(train_rows)} train, {len(val_rows)} held out) "
        f"in {time.time() - started:.0f} s",
        flush=True,
    )

    settings = TrainSettings(
        epochs=args.epochs,
        lr=args.lr,
        momentum=args.momentum,
        batch_size=args.batch,
        image_size=IMAGE_SIZE,
        steps=args.steps,
    )
    torch.manual_seed(args.seed)
    model = build_classifier(len(classes), "random")
    losses: list[float] = []
    t0 = time.time()

    def on_epoch(epoch: int, loss: float) -> None:
        losses.append(loss)
        print(f"epoch {epoch} loss {loss:.4f} ({time.time() - t0:.0f} s)", flush=True)

    train_classifier(
        model, images[train_rows], labels[train_rows], settings, seed=args.seed, on_epoch=on_epoch
    )
    train_seconds = time.time() - t0
    steps = settings.steps or settings.epochs * batches_per_epoch(
        len(train_rows), settings.batch_size
    )
    scores = evaluate(model, images[val_rows], labels[val_rows], IMAGE_SIZE)
    by_domain = {}
    for domain in shapes.DOMAINS:
        mine = torch.tensor([domains[r] == domain for r in val_rows.tolist()], dtype=torch.bool)
        if mine.any():
            by_domain[domain] = float(
                (scores.predictions[mine] == labels[val_rows][mine]).float().mean()
            )
    print(f"validation accuracy {scores.accuracy:.4f} {by_domain}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    # One metadata entry: safetensors writes several in no fixed order, and the file's bytes
    # (its sha256 in the log) should depend on the seed alone.
    path = save_backbone(
        model.cpu(),
        args.out,
        {
            "backbone": json.dumps(
                {
                    "classes": list(classes),
                    "corpus": corpus_function,
                    "per_class": per_class,
                    "corpus_seed": corpus_seed,
                    "seed": args.seed,
                },
                sort_keys=True,
            )
        },
    )
    log = {
        "corpus": {
            "function": corpus_function,
            "per_class": per_class,
            "seed": corpus_seed,
            "images": len(labels),
            "train_images": len(train_rows),
            "val_images": len(val_rows),
            "val_share": args.val_share,
            "labels": f"shape class ({args.corpus} corpus's classes)",
        },
        "classes": list(classes),
        "recipe": {
            "lr": args.lr,
            "momentum": args.momentum,
            "batch_size": args.batch,
            "image_size": IMAGE_SIZE,
            "augment": True,
            "init": "random",
            "seed": args.seed,
        },
        "epochs": settings.epochs_for(len(train_rows)),
        "steps": steps,
        "epoch_loss": losses,
        "validation_accuracy": scores.accuracy,
        "validation_loss": scores.mean_loss,
        "validation_accuracy_by_domain": by_domain,
        "train_seconds": train_seconds,
        "seconds": time.time() - started,
        "seconds_per_step": train_seconds / max(steps, 1),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "file": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "bytes": path.stat().st_size,
    }
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(
        f"saved {path} ({path.stat().st_size / 1e6:.1f} MB) after {(time.time() - started) / 60:.1f} min",
        flush=True,
    )


if __name__ == "__main__":
    main()

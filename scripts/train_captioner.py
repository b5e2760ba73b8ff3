"""Train the miniature captioner, OSCAR's stand-in for BLIP (run once; weights are shipped).

It learns from exactly the miniature LDM's pretraining corpus and captions
(:func:`fedbip_flwr.shapes.pretraining_corpus`): common domains captioned "a {domain} of a
{class}" or "a {class}", the rare domains sketch and quickdraw "a {descriptor} {class}" ("a
doodle star") or "a {class}", never by name. So, like BLIP on DomainNet quickdraw, it can
describe a rare domain's look but never name the domain. Empty captions (kept in the LDM's
corpus for classifier-free guidance) say nothing about an image and are left out. Teacher
forcing, AdamW, a fixed number of epochs, one seed: deterministic on one core.

It then samples one caption per held-out image (the shapes test split, disjoint from the
corpus and from every client) and prints and saves, per domain, the share of captions naming
the right class (and no other), naming the right domain word, and naming another domain's.

    python scripts/train_captioner.py --out models/miniature-captioner
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import CLIPTokenizer

from fedbip_flwr import shapes
from fedbip_flwr.captioner import MiniatureCaptioner
from fedbip_flwr.paths import resolve


def train(
    captioner: MiniatureCaptioner, images: torch.Tensor, captions: list[str], args
) -> list[float]:
    """Teacher-forced training; returns the mean loss of every epoch."""
    net = captioner.net.train().requires_grad_(True)
    ids = captioner.token_ids(captions)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    steps = args.epochs * -(-len(images) // args.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    losses = []
    for epoch in range(args.epochs):
        total, started = 0.0, time.time()
        for batch in torch.randperm(len(images), generator=gen).split(args.batch):
            loss = net.loss(images[batch], ids[batch])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(batch)
        losses.append(total / len(images))
        print(
            f"epoch {epoch + 1}/{args.epochs} loss {losses[-1]:.4f} ({time.time() - started:.0f} s)",
            flush=True,
        )
    net.eval().requires_grad_(False)
    return losses


def figures(captioner: MiniatureCaptioner, per_class: int, seed: int) -> dict[str, dict]:
    """Per domain, on held-out images: how often a sampled caption names the right class (and
    no other), the right domain word, a word describing its domain (its name or one of its
    ``shapes.RARE_DESCRIPTORS``), or another domain's name; and a few examples."""
    out = {}
    for domain in shapes.DOMAINS:
        test = shapes.test_set(domain, per_class, seed=0)
        captions = captioner.caption(test.images, torch.Generator().manual_seed(seed))
        words = [set(c.split()) for c in captions]
        look = {domain, *shapes.RARE_DESCRIPTORS.get(domain, ())}  # its name or a descriptor
        right_class = [
            shapes.CLASSES[y] in w and not (w & set(shapes.CLASSES)) - {shapes.CLASSES[y]}
            for w, y in zip(words, test.labels.tolist(), strict=True)
        ]
        out[domain] = {
            "images": len(captions),
            "right_class": sum(right_class) / len(captions),
            "right_domain_word": sum(domain in w for w in words) / len(captions),
            "describes_its_domain": sum(bool(w & look) for w in words) / len(captions),
            "other_domain_word": sum(bool(w & (set(shapes.DOMAINS) - {domain})) for w in words)
            / len(captions),
            "examples": captions[:: max(1, len(captions) // 6)][:6],
        }
        shares = {k: f"{v:.1%}" for k, v in out[domain].items() if isinstance(v, float)}
        print(f"{domain:10s} {shares} e.g. {out[domain]['examples'][:3]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("models/miniature-captioner"))
    parser.add_argument(
        "--tokenizer",
        default="models/miniature-ldm/tokenizer",
        help="the miniature LDM's tokenizer: the captioner's vocabulary",
    )
    parser.add_argument(
        "--per-class", type=int, default=500, help="common-domain corpus images per class"
    )
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--eval-per-class", type=int, default=50, help="held-out images per class per domain"
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()
    images, captions = shapes.pretraining_corpus(args.per_class, seed=0)  # the LDM's own corpus
    keep = [i for i, c in enumerate(captions) if c]
    images, captions = images[keep], [captions[i] for i in keep]
    print(f"corpus: {len(images)} captioned images in {time.time() - started:.0f} s", flush=True)
    captioner = MiniatureCaptioner.build(CLIPTokenizer.from_pretrained(resolve(args.tokenizer)))
    losses = train(captioner, images, captions, args)
    trained = time.time() - started
    scores = figures(captioner, args.eval_per_class, args.seed)
    captioner.save(args.out)
    log = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "corpus_images": len(images),
        "parameters": sum(p.numel() for p in captioner.net.parameters()),
        "epoch_losses": losses,
        "seconds_to_train": round(trained, 1),
        "held_out": scores,
    }
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"saved to {args.out} after {(time.time() - started) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()

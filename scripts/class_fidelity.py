"""Class fidelity of a pretrained miniature LDM: can text alone draw each class?

A ResNet-18 is trained on real images of the common domains (photo, clipart, painting); it then labels prompts-only
samples "a {domain} of a {class}". Fidelity is the share labelled as the prompted class
(chance = 1/6). Rare domains are sampled too, with their names in the prompt, to show that
text alone does not reach them (their samples should look like common domains).

    python scripts/class_fidelity.py models/miniature-ldm --per-class 32
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fedbip_flwr import shapes
from fedbip_flwr.classifier import (
    TrainSettings,
    build_classifier,
    evaluate,
    train_classifier,
)
from fedbip_flwr.concepts import plain_prompt
from fedbip_flwr.ldm import load_ldm
from fedbip_flwr.synthesis import SynthesisSettings
from fedbip_flwr.viz import image_grid
from fedbip_tools.sampling import sample_from_prompts

JUDGE_DOMAINS = shapes.COMMON_DOMAINS


def judge(seed: int) -> torch.nn.Module:
    """A classifier of real common-domain images: the judge of class fidelity."""
    sets = [shapes.test_set(d, 100, seed=seed + 1) for d in JUDGE_DOMAINS]
    images = torch.cat([s.images for s in sets])
    labels = torch.cat([s.labels for s in sets])
    model = build_classifier(len(shapes.CLASSES), "random")
    settings = TrainSettings(epochs=15, lr=0.01, momentum=0.9, batch_size=64, image_size=64)
    return train_classifier(model, images, labels, settings, seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--per-class", type=int, default=32)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks"))
    args = parser.parse_args()

    ldm = load_ldm(args.model)
    model = judge(args.seed)
    held_out = [shapes.test_set(d, 30, seed=args.seed) for d in JUDGE_DOMAINS]
    real_acc = {s.domain: evaluate(model, s.images, s.labels, 64).accuracy for s in held_out}
    settings = SynthesisSettings(args.steps, args.guidance, 48)
    generator = torch.Generator().manual_seed(args.seed)
    results, rows = {}, []
    for domain in shapes.DOMAINS:
        labels = torch.arange(len(shapes.CLASSES)).repeat_interleave(args.per_class)
        prompts = [
            plain_prompt(shapes.CAPTION_TEMPLATE, domain, shapes.CLASSES[y])
            for y in labels.tolist()
        ]
        images = sample_from_prompts(ldm, prompts, settings, generator)
        results[domain] = evaluate(model, images, labels, 64).accuracy
        rows.append(images[:: args.per_class // 2])
        print(f"{domain}: class fidelity {results[domain]:.3f}", flush=True)
    report = {
        "model": str(args.model),
        "judge_accuracy_on_real": real_acc,
        "class_fidelity": results,
        "common_mean": sum(results[d] for d in JUDGE_DOMAINS) / len(JUDGE_DOMAINS),
        "samples_per_class": args.per_class,
        "steps": args.steps,
        "guidance": args.guidance,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "class_fidelity.json").write_text(json.dumps(report, indent=2) + "\n")
    image_grid(rows, args.out / "prompts_only.png", row_labels=list(shapes.DOMAINS))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

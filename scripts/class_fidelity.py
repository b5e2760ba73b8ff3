"""Class fidelity of a pretrained miniature LDM: can text alone draw each class, in which domain?

The methods benchmark's judges (:mod:`fedbip_tools.judges`: two ResNet-18s trained on real images
of all five domains, one naming the class, one the domain) label prompts-only samples "a
{domain} of a {class}". Class fidelity is the share judged the prompted class (chance = 1/6),
domain fidelity the share judged the prompted domain. The rare domains are sampled with their
names in the prompt (text alone should not reach them) and with a word their pretraining
captions describe them with (``shapes.RARE_DESCRIPTORS``: can the model draw them at all?).

    python scripts/class_fidelity.py models/miniature-ldm --per-class 32
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fedbip_flwr import shapes
from fedbip_flwr.concepts import plain_prompt
from fedbip_flwr.ldm import load_ldm
from fedbip_flwr.synthesis import SynthesisSettings
from fedbip_flwr.viz import image_grid
from fedbip_tools import provenance
from fedbip_tools.judges import load_judges
from fedbip_tools.sampling import sample_from_prompts

ROOT = Path(__file__).resolve().parents[1]


def prompt_sets() -> dict[str, tuple[str, list[str]]]:
    """Row name -> (the domain its images should be in, one prompt per class)."""
    rows = {
        d: (d, [plain_prompt(shapes.CAPTION_TEMPLATE, d, c) for c in shapes.CLASSES])
        for d in shapes.DOMAINS
    }
    for d in shapes.RARE_DOMAINS:
        word = shapes.RARE_DESCRIPTORS[d][0]
        rows[f"{d} ({word})"] = (d, [f"a {word} {c}" for c in shapes.CLASSES])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--per-class", type=int, default=32)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--judges", type=Path, default=ROOT / "outputs" / "benchmark" / "judges.safetensors"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks"))
    args = parser.parse_args()

    ldm = load_ldm(args.model)
    judges = load_judges(args.judges)
    settings = SynthesisSettings(args.steps, args.guidance, 48)
    generator = torch.Generator().manual_seed(args.seed)
    labels = torch.arange(len(shapes.CLASSES)).repeat_interleave(args.per_class)
    results, rows = {}, []
    for name, (domain, prompts) in prompt_sets().items():
        images = sample_from_prompts(
            ldm, [prompts[y] for y in labels.tolist()], settings, generator
        )
        results[name] = {"prompt": prompts[0], **judges.fidelity(images, labels, domain)}
        rows.append(images[:: args.per_class // 2])
        print(f"{name}: {results[name]}", flush=True)
    common = [results[d]["class"] for d in shapes.COMMON_DOMAINS]
    report = {
        "model": str(args.model),
        "judges": {"path": str(args.judges), "on_real": judges.on_real()},
        "fidelity": results,
        "common_class_mean": sum(common) / len(common),
        "samples_per_class": args.per_class,
        "steps": args.steps,
        "guidance": args.guidance,
        "provenance": provenance.record(
            ROOT, torch.get_num_threads(), [args.out], model=args.model.resolve()
        ),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "class_fidelity.json").write_text(json.dumps(report, indent=2) + "\n")
    image_grid(rows, args.out / "prompts_only.png", row_labels=list(results), label_width=120)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""What instance-level personalization alone gives: z(T) denoised with the template's words.

For two client domains, 12 real images (2 per class) and the images synthesized from their own
z(T) with untrained concepts (S, V = the domain and class words, no concept epochs), once with
the shapes template "a {S} style of a {V}" and once with the pretraining captions' shape
"a {S} of a {V}". Writes benchmarks/instance_only_probe.png.

    python scripts/probe_instance_only.py
"""

from __future__ import annotations

from pathlib import Path

import torch

from fedbip_flwr import shapes
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import load_ldm
from fedbip_flwr.methods.fedbip import fedbip_settings, personalize
from fedbip_flwr.synthesis import SynthesisSettings
from fedbip_flwr.viz import image_grid
from fedbip_tools.sampling import synthesize_client

ROOT = Path(__file__).resolve().parents[1]
MODEL = "models/miniature-ldm"
TEMPLATES = ("a {S} style of a {V}", "a {S} of a {V}")


def main() -> None:
    ldm = load_ldm(ROOT / MODEL)
    rows, labels = [], []
    for domain in ("sketch", "painting"):
        data = shapes.client_train_set(domain, 16, 0, seed=0, size=64)
        picked = torch.arange(0, len(data), 8)
        rows.append(data.images[picked])
        labels.append(f"{domain}: real")
        for template in TEMPLATES:
            cfg = FedBiPConfig.from_flat(
                {
                    "ldm.model": MODEL,
                    "data.prompt-template": template,
                    "fedbip.concept-epochs": 0,
                    "fedbip.multiplier": 1,
                }
            )
            payload, _ = personalize(
                ldm,
                data.images[picked],
                data.labels[picked],
                list(data.classes),
                domain,
                f"{domain}-0",
                cfg,
                torch.Generator().manual_seed(1),
            )
            rows.append(
                synthesize_client(
                    ldm, payload, SynthesisSettings.from_config(cfg), fedbip_settings(cfg), seed=1
                ).images
            )
            labels.append(template.replace("{", "[").replace("}", "]"))
    out = image_grid(
        rows, ROOT / "benchmarks" / "instance_only_probe.png", row_labels=labels, label_width=130
    )
    print(out)


if __name__ == "__main__":
    main()

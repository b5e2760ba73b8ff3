"""FedLMG's guidance step sizes on the miniature model: a small sweep, judged twice.

Each client (one shapes domain, ``shots`` images per class) makes its FedLMG upload through the
library (its own ResNet-18, ``local-epochs``); the server's guided sampler
(:func:`fedbip_flwr.methods.fedlmg.iter_guided`) then makes ``--per-class`` images per class
under every setting below, from the same noise. Each setting is judged by

- the guiding client's own model: the share of images it labels as the class they were made
  for (what the guidance optimises, so it can be fooled by adversarial pixels), and
- two independent ResNet-18 judges trained on real images of all five domains
  (``scripts/benchmark_miniature.py``'s): class fidelity and the share judged as the client's
  domain (what the BatchNorm loss is for: the prompt names no domain).

Results go to ``--out`` (JSON) and one PNG grid per client and setting beside it.

    python scripts/fedlmg_sweep.py --out benchmarks/fedlmg_sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_miniature import load_judges

from fedbip_flwr import dataset
from fedbip_flwr.classifier import evaluate
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import load_ldm
from fedbip_flwr.methods import ClientJob, ServerJob, create
from fedbip_flwr.methods.fedlmg import class_prompts, guidance_settings, iter_guided
from fedbip_flwr.server import client_seed
from fedbip_flwr.synthesis import encode_texts
from fedbip_flwr.viz import image_grid

# name -> changes to the paper variant's settings (steps, CFG 3, w_BN 0.2, 10 edits at 0.1)
SETTINGS: dict[str, dict] = {
    "unguided": {"step": 0.0, "noise_edits": 0},
    "edits only": {"step": 0.0},
    "step 1 (paper)": {"step": 1.0},
    "step 3": {"step": 3.0},
    "step 10": {"step": 10.0},
    "step 30": {"step": 30.0},
    "step 100": {"step": 100.0},
}


def run_config(args: argparse.Namespace) -> FedBiPConfig:
    return FedBiPConfig.from_flat({
        "method": "fedlmg", "model": str(args.model), "classifier-init": "random",
        "shots-per-class": args.shots, "local-epochs": args.local_epochs,
        "num-inference-steps": args.steps, "fedlmg-prompt": args.prompt,
        "domains": ",".join(args.domains), "replayable-client-noise": True,
    })  # fmt: skip


def client_uploads(cfg: FedBiPConfig, ldm, cache: Path) -> dict:
    """Each client's FedLMG upload (made once, cached as the bytes a client would send)."""
    method, server = create("fedlmg"), ServerJob(cfg, dataset.class_names(cfg), lambda: ldm)
    uploads = {}
    for partition, domain in enumerate(cfg.domain_list):
        path = cache / f"fedlmg-upload-{domain}-{cfg.shots_per_class}-{cfg.local_epochs}.safetensors"
        if not path.exists():
            data = dataset.load_client_data(cfg, partition)
            started = time.perf_counter()
            blob, _ = method.upload(ClientJob(cfg, data, torch.Generator().manual_seed(partition), lambda: ldm))
            print(f"{domain}: local model trained in {time.perf_counter() - started:.0f} s", flush=True)
            path.write_bytes(blob)
        upload = method.accept(path.read_bytes(), server)
        uploads[upload.client_id] = upload
    return uploads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/miniature-ldm"))
    parser.add_argument("--domains", nargs="+", default=["sketch", "painting"])
    parser.add_argument("--shots", type=int, default=16)
    parser.add_argument("--local-epochs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--prompt", default="a {class}")
    parser.add_argument("--per-class", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="setting names to run")
    parser.add_argument("--set", default="{}", help="JSON: extra settings, name -> changes")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/fedlmg_sweep.json"))
    parser.add_argument("--cache", type=Path, default=Path("benchmarks/runs"))
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    cfg = run_config(args)
    ldm = load_ldm(args.model)
    judges = load_judges(args.cache / "judges.safetensors", cfg.classifier_image_size)
    uploads = client_uploads(cfg, ldm, args.cache)
    cond = encode_texts(ldm, class_prompts(cfg, dataset.class_names(cfg)))
    labels = torch.arange(6).repeat_interleave(args.per_class)
    settings = {**SETTINGS, **json.loads(args.set)}
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for name, changes in settings.items():
        if args.only is not None and name not in args.only:
            continue
        chosen = dataclasses.replace(guidance_settings(cfg), **changes)
        row = {"settings": dataclasses.asdict(chosen), "clients": {}}
        for client_id, upload in sorted(uploads.items()):
            generator = torch.Generator().manual_seed(client_seed(cfg.seed, client_id))
            started = time.perf_counter()
            images = torch.cat(list(iter_guided(ldm, upload.content, cond, labels, chosen, generator)))
            seconds = (time.perf_counter() - started) / len(labels)
            guide = evaluate(upload.content, images, labels, cfg.classifier_image_size).accuracy
            scores = {"guide": guide, **judges.fidelity(images, labels, upload.domain), "s_per_image": seconds}
            row["clients"][client_id] = scores
            image_grid([images], args.out.parent / "pictures" / f"fedlmg-{client_id}-{slug(name)}.png")
            print(f"{name:>24} {client_id:>12}: " + " ".join(f"{k} {v:.2f}" for k, v in scores.items()), flush=True)
        results[name] = row
        args.out.write_text(json.dumps(results, indent=1))


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


if __name__ == "__main__":
    main()

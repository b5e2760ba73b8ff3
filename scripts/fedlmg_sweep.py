"""FedLMG's guidance step sizes on the miniature model: a small sweep, judged twice.

Each client (one shapes domain, ``shots`` images per class) makes its FedLMG upload through the
library (its own ResNet-18, ``fedlmg.local-epochs``); the server's guided sampler
(:func:`fedbip_flwr.methods.fedlmg.iter_guided`) then makes ``--per-class`` images per class
under every setting below, from the same noise. Each setting is judged by

- the guiding client's own model: the share of images it labels as the class they were made
  for (what the guidance optimises, so it can be fooled by adversarial pixels), and
- a peer judge per domain: ResNet-18 trained on real images of OTHER clients of the client's
  domain (class fidelity where the five-domain judge below is weak: sketches, line drawings);
- two independent ResNet-18 judges trained on real images of all five domains
  (``fedbip_tools.judges``, the benchmark's, smaller: ``--judge-per-class``, ``--judge-epochs``):
  class fidelity and the share judged as the client's domain (what the BatchNorm loss is for:
  the prompt names no domain).

Results go to ``--out`` (JSON) and one PNG grid per client and setting beside it.

    python scripts/fedlmg_sweep.py --out benchmarks/fedlmg_sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path

import torch
from torch import nn

from fedbip_flwr import dataset, shapes
from fedbip_flwr.classifier import build_classifier, evaluate, train_classifier
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import load_ldm
from fedbip_flwr.method_settings import FedLMGSettings
from fedbip_flwr.methods import ClientJob, ServerJob, create_for
from fedbip_flwr.methods.fedlmg import class_prompts, guidance_settings, iter_guided
from fedbip_flwr.seeds import client_seed
from fedbip_flwr.server import train_settings
from fedbip_flwr.storage import read_metadata, read_tensors, write_tensors
from fedbip_flwr.synthesis import encode_texts
from fedbip_flwr.viz import dequantize, image_grid, quantize
from fedbip_tools.judges import JUDGE_SEED, load_judges

# name -> changes to the paper variant's settings (CFG 3, w_BN 0.2, 10 edits at 0.1). On the
# miniature model the gradient of CE + 0.2 L_BN is large (|sqrt(1 - abar) grad| ~ 1-3 x |eps|
# early on; |grad L_BN| ~ 450 on 4x16x16 noise of norm 32), so the grid goes down from 1.
SETTINGS: dict[str, dict] = {
    "unguided": {"step": 0.0, "noise_edits": 0},
    "step 0.01": {"step": 0.01, "noise_edits": 0},
    "step 0.1": {"step": 0.1, "noise_edits": 0},
    "step 1 (paper)": {"step": 1.0, "noise_edits": 0},
    "step 0.03": {"step": 0.03, "noise_edits": 0},
    "step 0.3": {"step": 0.3, "noise_edits": 0},
    "step 0.1, 10 edits at 0.001": {"step": 0.1, "edit_step": 0.001},
    "step 0.1, 10 edits at 0.01": {"step": 0.1, "edit_step": 0.01},
    "step 0.1, CE only": {"step": 0.1, "noise_edits": 0, "bn_weight": 0.0},
    "step 3, CE only": {"step": 3.0, "noise_edits": 0, "bn_weight": 0.0},
    "code variant, step 0.1": {"step": 0.1, "noise_edits": 0, "bn_weight": 0.1, "shift": "latents"},
}


def run_config(args: argparse.Namespace) -> FedBiPConfig:
    return FedBiPConfig.from_flat(
        {
            "method": "fedlmg",
            "ldm.model": str(args.model),
            "classifier.init": "random",
            "data.shots-per-class": args.shots,
            "fedlmg.local-epochs": args.local_epochs,
            "synthesis.num-inference-steps": args.steps,
            "fedlmg.prompt": args.prompt,
            "data.domains": ",".join(args.domains),
            "federation.replayable-client-noise": True,
        }
    )


def own(cfg: FedBiPConfig) -> FedLMGSettings:
    return cfg.settings_of("fedlmg")


def client_uploads(cfg: FedBiPConfig, ldm, cache: Path) -> dict:
    """Each client's FedLMG upload (made once, cached as the bytes a client would send)."""
    method, server = (
        create_for(cfg),
        ServerJob(cfg, dataset.class_names(cfg.data_description), lambda: ldm),
    )
    uploads = {}
    for partition, domain in enumerate(cfg.data.domain_list):
        shots, epochs = cfg.data.shots_per_class, own(cfg).local_epochs
        path = cache / f"fedlmg-upload-{domain}-{shots}-{epochs}.safetensors"
        if not path.exists():
            data = dataset.load_client_data(cfg.data_description, partition)
            started = time.perf_counter()
            blob, _ = method.upload(
                ClientJob(cfg, data, torch.Generator().manual_seed(partition), lambda: ldm)
            )
            print(
                f"{domain}: local model trained in {time.perf_counter() - started:.0f} s",
                flush=True,
            )
            path.write_bytes(blob)
        upload = method.accept(path.read_bytes(), server)
        uploads[upload.client_id] = upload
    return uploads


def peer_judge(
    cfg: FedBiPConfig, domain: str, cache: Path, clients: range = range(1, 3)
) -> nn.Module:
    """A ResNet-18 trained (the local recipe) on real images of OTHER clients of ``domain``:
    a class judge that knows the domain and shares no image or weight with the guide."""
    path = (
        cache
        / f"fedlmg-peer-{domain}-{cfg.data.shots_per_class}-{own(cfg).local_epochs}.safetensors"
    )
    model = build_classifier(len(shapes.CLASSES), "random")
    if not path.exists():
        sets = [
            shapes.client_train_set(domain, cfg.data.shots_per_class, i, seed=cfg.seed)
            for i in clients
        ]
        images, labels = torch.cat([s.images for s in sets]), torch.cat([s.labels for s in sets])
        print(f"training the {domain} peer judge ({len(images)} real images)", flush=True)
        train_classifier(
            model,
            images,
            labels,
            train_settings(cfg.classifier, own(cfg).local_epochs),
            seed=JUDGE_SEED,
        )
        write_tensors(path, model.state_dict())
    model.load_state_dict(read_tensors(path))
    return model.eval()


def samples(
    ldm, upload, cond, labels, chosen, cfg: FedBiPConfig, cache: Path
) -> tuple[torch.Tensor, float]:
    """The setting's images for one client and the seconds per image they took (cached)."""
    key = hashlib.sha256(
        repr(
            (
                dataclasses.asdict(chosen),
                labels.tolist(),
                cfg.seed,
                ldm.fingerprint,
                upload.client_id,
            )
        ).encode()
    ).hexdigest()[:16]
    path = cache / f"fedlmg-samples-{upload.client_id}-{key}.safetensors"
    if path.exists():
        return dequantize(read_tensors(path)["images"]), float(read_metadata(path)["s_per_image"])
    generator = torch.Generator().manual_seed(client_seed(cfg.seed, upload.client_id))
    started = time.perf_counter()
    images = torch.cat(list(iter_guided(ldm, upload.content, cond, labels, chosen, generator)))
    seconds = (time.perf_counter() - started) / len(labels)
    write_tensors(path, {"images": quantize(images)}, {"s_per_image": str(seconds)})
    return dequantize(quantize(images)), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/miniature-ldm"))
    parser.add_argument("--domains", nargs="+", default=["sketch", "painting"])
    parser.add_argument("--shots", type=int, default=16)
    parser.add_argument("--local-epochs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--prompt", default="a {class}")
    parser.add_argument("--per-class", type=int, default=2)
    parser.add_argument(
        "--judge-per-class", type=int, default=20, help="real images per class and domain"
    )
    parser.add_argument("--judge-epochs", type=int, default=10)
    parser.add_argument("--only", nargs="*", default=None, help="setting names to run")
    parser.add_argument("--set", default="{}", help="JSON: extra settings, name -> changes")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/fedlmg_sweep.json"))
    parser.add_argument("--cache", type=Path, default=Path("benchmarks/runs"))
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    cfg = run_config(args)
    ldm = load_ldm(args.model)
    judges = load_judges(
        args.cache / f"fedlmg-judges-{args.judge_per_class}-{args.judge_epochs}.safetensors",
        cfg.classifier.image_size,
        args.judge_per_class,
        args.judge_epochs,
    )
    uploads = client_uploads(cfg, ldm, args.cache)
    peers = {u.domain: peer_judge(cfg, u.domain, args.cache) for u in uploads.values()}
    size = cfg.classifier.image_size
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results["judges on real test images"] = {
        **judges.on_real(),
        **{f"peer {d}": evaluate(m, *test_set(d), size).accuracy for d, m in peers.items()},
        **{
            f"guide {u.domain}": evaluate(u.content, *test_set(u.domain), size).accuracy
            for u in uploads.values()
        },
    }
    print(results["judges on real test images"], flush=True)
    cond = encode_texts(ldm, class_prompts(own(cfg), dataset.class_names(cfg.data_description)))
    labels = torch.arange(6).repeat_interleave(args.per_class)
    settings = {**SETTINGS, **json.loads(args.set)}
    for name, changes in settings.items():
        if args.only is not None and name not in args.only:
            continue
        chosen = dataclasses.replace(guidance_settings(cfg, own(cfg)), **changes)
        row = {"settings": dataclasses.asdict(chosen), "clients": {}}
        for client_id, upload in sorted(uploads.items()):
            images, seconds = samples(ldm, upload, cond, labels, chosen, cfg, args.cache)
            scores = {
                "guide": evaluate(upload.content, images, labels, size).accuracy,
                "peer": evaluate(peers[upload.domain], images, labels, size).accuracy,
                **judges.fidelity(images, labels, upload.domain),
                "s_per_image": seconds,
            }
            row["clients"][client_id] = scores
            image_grid(
                [images], args.out.parent / "pictures" / f"fedlmg-{client_id}-{slug(name)}.png"
            )
            print(
                f"{name:>24} {client_id:>12}: "
                + " ".join(f"{k} {v:.2f}" for k, v in scores.items()),
                flush=True,
            )
        results[name] = row
        args.out.write_text(json.dumps(results, indent=1))


def test_set(domain: str) -> tuple[torch.Tensor, torch.Tensor]:
    real = shapes.test_set(domain, 20, seed=0)
    return real.images, real.labels


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


if __name__ == "__main__":
    main()

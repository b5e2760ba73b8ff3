"""Can any learned conditioning make the miniature LDM draw a rare domain? (issue 47, item 1)

FedBiP's concept level learns a domain concept S (and class concepts V) on one client's images;
the server then synthesizes under it. With the default budget (10 epochs, ~120 Adam steps at
lr 0.1) the judges find the rare domains' fresh-noise images no more in their domain than plain
prompts'. This script separates "the model cannot draw the domain under any learned
conditioning" from "the concept step does not find it at the default budget": on ONE client's
images (the default federation's client of ``--domain``, exactly as the simulation's node loads
them) it learns the concepts with a budget far beyond the default (``--steps`` Adam steps,
every learning rate of ``--lrs``, S and V together or S alone: ``--vectors``), snapshots them
at ``--checkpoints`` steps of the same run (the run config's 120-step budget is one of them:
the default concept), and for every snapshot

- synthesizes ``--per-class`` images per class from FRESH noise (never from z(T)) under the
  concept, with the run's sampler (:class:`fedbip_flwr.synthesis.SynthesisSettings` of the
  default run config; :func:`fedbip_flwr.synthesis.iter_from_noise`, the library's own
  fresh-noise path; S is used as learned, no eta), the same noise for every configuration;
- judges them with the methods benchmark's judges (:mod:`fedbip_tools.judges`): class and
  domain fidelity, and which domain the judge says they are;
- measures the diffusion loss (:func:`fedbip_flwr.concepts.conditioned_loss`) on the client's
  own latents at fixed timestep ranges, with the same t and noise for every conditioning, and
  its ratio to the plain prompt's ("a quickdraw of a circle"): below 1, the concept explains
  the client's images better than the words it starts from.

Learning is the library's: :func:`fedbip_flwr.concepts.optimise_embeddings` on
:func:`fedbip_flwr.concepts.concept_batch_loss` (what :func:`~fedbip_flwr.concepts.learn_concepts`
runs), with the run config's batch size, t ~ U{1..T} (T the sampler's first timestep, as a
client's) and Adam; S-only learning holds V at its init words. The only helper is a wrapper
around the batch loss that copies the embeddings it is handed at the checkpoint steps
(``optimise_embeddings`` has no per-step hook) and, with ``--t-min``, maps the drawn t onto
[t-min, T]. Training seconds (snapshots cost nothing measurable) are what a client would pay
on this machine with ``--threads`` torch threads.

References, per domain: the client's real images and held-out real images of the domain (the
judges' ceiling), the real images through the VAE (can the autoencoder carry the domain at
all?), Prompts-only (plain prompts, fresh noise: the method's own code path), the class-only
prompt "a circle" (how the rare domains' pretraining images were captioned) and the empty
prompt's loss. ``--space hidden`` learns in the text encoder's output space (the authors'
code) instead of the run config's token space.

The figures in benchmarks/domain_upper_bound.json came from (quickdraw client, AVX-512 EPYC,
2 cores shared with other work; 1 torch thread each; judges trained once by the first, ~13 CPU
minutes, at /tmp/domain_upper_bound/judges.safetensors):

    OMP_NUM_THREADS=1 python scripts/domain_upper_bound.py --domain quickdraw --skip-learning \
        --judges /tmp/domain_upper_bound/judges.safetensors
    OMP_NUM_THREADS=1 python scripts/domain_upper_bound.py --domain quickdraw \
        --steps 2000 --lrs 0.1,0.5,2.5 --vectors sv --judges /tmp/domain_upper_bound/judges.safetensors
    OMP_NUM_THREADS=1 python scripts/domain_upper_bound.py --domain quickdraw --space hidden \
        --steps 1000 --lrs 0.5 --vectors sv --judges /tmp/domain_upper_bound/judges.safetensors
    OMP_NUM_THREADS=1 python scripts/domain_upper_bound.py --domain quickdraw --space hidden \
        --steps 2000 --lrs 0.5 --vectors s --reuse-references --judges /tmp/domain_upper_bound/judges.safetensors

Invocations accumulate in ``--out`` (keyed by domain and configuration; the json's
``commands``); every invocation rewrites the grid ``docs/images/domain-upper-bound-<domain>.png``
(rows: real, real through the VAE, Prompts-only, the default concept, the best long-budget
snapshot, and the most in-domain one at any class fidelity where that is another) from the
images cached under ``--cache`` (``--grid-only``: just the grid). The judges are loaded from
``--judges`` (default: the benchmark's, outputs/benchmark/judges.safetensors) or, where that
file is missing, trained there with ``--judge-per-class`` / ``--judge-epochs`` (default: the
benchmark's recipe, 40 and 30: ~13 CPU minutes on one AVX-512 core).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fedbip_flwr import shapes
from fedbip_flwr.classifier import evaluate
from fedbip_flwr.concepts import (
    concept_batch_loss,
    concept_scale,
    conditioned_loss,
    encode_prompts,
    initial_concepts,
    optimise_embeddings,
    plain_prompt,
    prompt_layout,
    relative_drift,
    unconditional_embedding,
)
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.instance import encode_images
from fedbip_flwr.ldm import load_for_run
from fedbip_flwr.methods.fedbip import fedbip_settings
from fedbip_flwr.paths import resolve
from fedbip_flwr.storage import read_tensors, write_tensors
from fedbip_flwr.synthesis import SynthesisSettings, decode_latents, encode_texts, iter_from_noise
from fedbip_flwr.viz import dequantize, image_grid, quantize
from fedbip_tools import provenance
from fedbip_tools.benchmark import client_sets
from fedbip_tools.cli import project_run_config
from fedbip_tools.judges import Judges, load_judges

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JUDGES = ROOT / "outputs" / "benchmark" / "judges.safetensors"
T_BINS = (
    (1, 200),
    (200, 400),
    (400, 600),
    (600, 800),
    (800, 1000),
)  # [lo, hi), hi clipped to T + 1
VECTORS = {"sv": "S+V", "s": "S only"}


# ----------------------------------------------------------------------------- helpers
class Snapshots:
    """Wraps a :data:`fedbip_flwr.concepts.BatchLoss`: counts the optimiser's steps, and at the
    checkpoint steps copies the embeddings it is handed (those after k Adam updates are the
    ones step k + 1's loss sees) and the training seconds so far. With ``t_min`` > 1 the drawn
    t ~ U{1..T} is mapped onto U{t_min..T} (evenly, before the loss sees it)."""

    def __init__(self, loss: Callable, checkpoints: Sequence[int], t_max: int, t_min: int = 1):
        self.loss, self.checkpoints, self.t_max, self.t_min = loss, set(checkpoints), t_max, t_min
        self.calls, self.started = 0, time.perf_counter()
        self.taken: dict[int, tuple[list[torch.Tensor], float]] = {}

    def __call__(self, embeddings, batch, t, noise):
        if self.calls in self.checkpoints:
            self.taken[self.calls] = ([e.detach().float().cpu().clone() for e in embeddings],
                                      time.perf_counter() - self.started)  # fmt: skip
        self.calls += 1
        if self.t_min > 1:
            t = self.t_min + (t - 1) * (self.t_max - self.t_min + 1) // self.t_max
        return self.loss(embeddings, batch, t, noise)


def s_only(full: Callable, v0: torch.Tensor) -> Callable:
    """The batch loss of [S] alone, V held at its init words ``v0``."""

    def loss(embeddings, batch, t, noise):
        return full([embeddings[0], v0], batch, t, noise)

    return loss


def progress(epoch: int, loss: float) -> None:
    if epoch % 10 == 9:
        print(f"  epoch {epoch + 1} loss {loss:.4f}", flush=True)


def pick(labels: torch.Tensor, classes: int, count: int) -> torch.Tensor:
    """``count`` indices for a grid row: one image per class in turn."""
    per = [torch.nonzero(labels == c).flatten() for c in range(classes)]
    return torch.stack([per[i % classes][i // classes] for i in range(count)])


def domain_histogram(judges: Judges, images: torch.Tensor) -> dict[str, float]:
    """Share of ``images`` the domain judge puts in each domain."""
    dummy = torch.zeros(len(images), dtype=torch.long)
    predictions = evaluate(judges.domains, images, dummy, judges.size).predictions
    counts = torch.bincount(predictions, minlength=len(shapes.DOMAINS)).float() / len(images)
    return {d: round(float(c), 4) for d, c in zip(shapes.DOMAINS, counts, strict=True)}


def judge(
    judges: Judges, images: torch.Tensor, labels: torch.Tensor, domain: str
) -> dict[str, Any]:
    return {
        **judges.fidelity(images, labels, domain),
        "judged_domains": domain_histogram(judges, images),
    }


def loss_draws(z0: torch.Tensor, t_max: int, repeats: int, seed: int) -> list:
    """Fixed (t, noise) per image and timestep range: ``repeats`` draws of each image in each."""
    gen = torch.Generator().manual_seed(seed)
    draws = []
    for lo, hi in T_BINS:
        hi = min(hi, t_max + 1)
        if lo >= hi:
            continue
        n = len(z0) * repeats
        draws.append(((lo, hi - 1), (torch.randint(lo, hi, (n,), generator=gen),
                                    torch.randn((n, *z0.shape[1:]), generator=gen))))  # fmt: skip
    return draws


@torch.no_grad()
def t_losses(
    ldm, cond: torch.Tensor, z0: torch.Tensor, labels: torch.Tensor, draws: list
) -> dict[str, float]:
    """Diffusion loss per timestep range on the client's latents, the same (t, noise) draws for
    every conditioning ``cond`` (C, L, d); "all" is the mean over the ranges."""
    out = {}
    for (lo, hi), (t, noise) in draws:
        rows = torch.arange(len(z0)).repeat(len(t) // len(z0))
        total = sum(
            conditioned_loss(ldm, cond[labels[r]], z0[r], tt, nn).item() * len(r)
            for r, tt, nn in zip(rows.split(96), t.split(96), noise.split(96), strict=True)
        )
        out[f"{lo}-{hi}"] = round(total / len(t), 6)
    out["all"] = round(sum(out.values()) / len(out), 6)
    return out


def ratios(losses: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    return {k: round(v / base[k], 4) for k, v in losses.items()}


def best_snapshot(entry: dict[str, Any], class_bar: float = 0.9) -> tuple[str, int] | None:
    """The long-budget snapshot with the highest domain fidelity among those of class fidelity
    >= ``class_bar`` (any class fidelity where none reaches it); ties (all 0 included): the one whose
    concept explains the client's images best (lowest loss ratio to the plain prompt), then the
    cheaper."""
    snaps = [(k, int(s), snap) for k, r in entry.get("runs", {}).items() for s, snap in r["snapshots"].items()
             if int(s) > entry["default_budget_steps"]]  # fmt: skip
    if not snaps:
        return None
    good = [x for x in snaps if x[2]["class"] >= class_bar] or snaps
    k, s, _ = max(
        good, key=lambda x: (x[2]["domain"], -x[2]["loss_ratio_vs_prompt"]["all"], -x[2]["seconds"])
    )
    return k, s


def table(out: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per reference and per (domain, configuration, snapshot): the summary's table."""
    rows = []
    for domain, entry in out["domains"].items():
        for name, ref in entry["references"].items():
            if "class" in ref:
                rows.append({"domain": domain, "config": name, "class": round(ref["class"], 4),
                             "domain_fidelity": round(ref["domain"], 4)})  # fmt: skip
        for key, run in entry.get("runs", {}).items():
            for step, snap in run["snapshots"].items():
                rows.append({
                    "domain": domain, "config": key, "vectors": run["vectors"], "lr": run["lr"],
                    "t_min": run["t_min"], "steps": int(step), "seconds": snap["seconds"],
                    "epoch_loss": snap["epoch_loss"], "loss_ratio_all": snap["loss_ratio_vs_prompt"]["all"],
                    "class": round(snap["class"], 4), "domain_fidelity": round(snap["domain"], 4),
                })  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--domain", default="quickdraw")
    parser.add_argument("--steps", type=int, default=2000, help="Adam steps of every long run")
    parser.add_argument("--lrs", default="0.1,0.5,2.5", help="comma-separated learning rates")
    parser.add_argument(
        "--vectors", default="sv", help="comma-separated: sv (S and V) and/or s (S only)"
    )
    parser.add_argument("--space", default="", help="token or hidden ('' = the run config's)")
    parser.add_argument(
        "--t-min", type=int, default=1, help="learn on t ~ U{t-min..T} (1: the library's)"
    )
    parser.add_argument("--checkpoints", default="", help="steps to judge ('' = the default budget, "
                        "500, 1000, 1500, ... below --steps); the last step always")  # fmt: skip
    parser.add_argument(
        "--per-class", type=int, default=16, help="synthetic images per class per snapshot"
    )
    parser.add_argument(
        "--loss-repeats", type=int, default=2, help="(t, noise) draws per image and range"
    )
    parser.add_argument("--model", default="", help="the LDM ('' = the run config's model)")
    parser.add_argument("--seed", type=int, default=0, help="learning, synthesis and loss draws")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--judges", type=Path, default=DEFAULT_JUDGES)
    parser.add_argument("--judge-per-class", type=int, default=40)
    parser.add_argument("--judge-epochs", type=int, default=30)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/domain_upper_bound"))
    parser.add_argument("--grid", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "domain_upper_bound.json")
    parser.add_argument("--skip-learning", action="store_true", help="references and grid only")
    parser.add_argument(
        "--reuse-references",
        action="store_true",
        help="take the references from --out where it has them (saves ~1.5 CPU minutes)",
    )
    parser.add_argument(
        "--grid-only", action="store_true", help="the grid from --out and --cache only"
    )
    return parser.parse_args(argv)


def write_grid(
    args: argparse.Namespace, cfg: FedBiPConfig, ldm, client, out: dict[str, Any]
) -> Path:
    """Rows: the client's real images, the same through the VAE (the pipeline's ceiling),
    Prompts-only, the default-budget concept, the best long-budget snapshot (class fidelity
    >= 0.9) and, where another, the most in-domain one at any class fidelity (when cached)."""
    entry, cache = out["domains"][args.domain], args.cache / args.domain
    classes, steps = len(client.classes), entry["default_budget_steps"]
    best = best_snapshot(entry)
    default_key = next((k for k, r in entry.get("runs", {}).items() if r["vectors"] == "S+V" and r["lr"] == fedbip_settings(cfg).concept_lr
                        and r["space"] == fedbip_settings(cfg).concept_space and r["t_min"] == 1 and str(steps) in r["snapshots"]), None)  # fmt: skip
    chosen = pick(client.labels, classes, 8)
    syn_chosen = pick(
        torch.arange(classes).repeat_interleave(out["sampler"]["per_class"]), classes, 8
    )
    real = client.images[chosen]
    through_vae = decode_latents(ldm, encode_images(ldm.vae, real, cfg.ldm.vae_batch_size))
    prompt_row = dequantize(read_tensors(cache / "prompts-only.safetensors")["images"])[syn_chosen]
    grid_rows, row_labels = [real, through_vae, prompt_row], ["real", "VAE", "prompts"]
    top = best_snapshot(entry, class_bar=0.0)  # the most in-domain, whatever its class fidelity
    extra = [(*top, "top dom.")] if top and top != best else []
    for key, step, label in (
        (default_key, steps, "default"),
        (*(best or (None, 0)), "best"),
        *extra,
    ):
        if key and (cache / f"{key}-{step}.safetensors").exists():
            grid_rows.append(
                dequantize(read_tensors(cache / f"{key}-{step}.safetensors")["images"])[syn_chosen]
            )
            row_labels.append(label)
    return image_grid(grid_rows, args.grid / f"domain-upper-bound-{args.domain}.png", row_labels=row_labels,
                      columns=8, label_width=56)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    flat = project_run_config()
    cfg = FedBiPConfig.from_flat({**flat, "ldm.model": args.model} if args.model else flat)
    space = args.space or fedbip_settings(cfg).concept_space
    settings = SynthesisSettings.from_config(cfg)
    ldm = load_for_run(cfg.ldm.model, "cpu", cfg.ldm.half_precision, cfg.data.image_size,
                       channels_last=cfg.ldm.channels_last,
                       compile_unet=cfg.ldm.compile_unet)  # fmt: skip
    if args.grid_only:
        client = next(
            c for c in client_sets(cfg.data_description).values() if c.domain == args.domain
        )
        print(write_grid(args, cfg, ldm, client, json.loads(args.out.read_text())), flush=True)
        return 0
    timestep = settings.sampler(ldm).first_timestep(cfg.synthesis.start_timestep)
    started, judges_trained = time.perf_counter(), not args.judges.exists()
    judges = load_judges(args.judges, 64, args.judge_per_class, args.judge_epochs)
    judges_seconds = time.perf_counter() - started

    client = next(c for c in client_sets(cfg.data_description).values() if c.domain == args.domain)
    classes, names = len(client.classes), list(client.classes)
    z0 = encode_images(ldm.vae, client.images, cfg.ldm.vae_batch_size)
    labels = client.labels
    steps_per_epoch = math.ceil(len(z0) / fedbip_settings(cfg).concept_batch_size)
    default_steps = fedbip_settings(cfg).concept_epochs * steps_per_epoch
    draws = loss_draws(z0, timestep, args.loss_repeats, args.seed + 1)
    syn_labels = torch.arange(classes).repeat_interleave(args.per_class)
    cache = args.cache / args.domain
    cache.mkdir(parents=True, exist_ok=True)

    def synthesize(cond: torch.Tensor) -> tuple[torch.Tensor, float]:
        began = time.perf_counter()
        gen = torch.Generator().manual_seed(args.seed + 2)  # the same noise for every conditioning
        images = torch.cat(list(iter_from_noise(ldm, cond, syn_labels, settings, gen)))
        return images, time.perf_counter() - began

    layout = prompt_layout(
        ldm.tokenizer, cfg.data.prompt_template, cfg.data.n_s, cfg.data.n_v, client.domain, names
    )
    s0, v0 = initial_concepts(ldm, layout, space)
    scale = concept_scale(ldm, space)
    rows = torch.arange(classes)

    def concept_cond(s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return encode_prompts(ldm, layout, space, s, v, rows)

    # --- references (or, with --reuse-references, those --out holds: same seed, same draws)
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    kept = previous.get("domains", {}).get(args.domain, {}).get("references")
    if args.reuse_references and kept:
        references, base_losses = kept, kept["prompts-only"]["t_losses"]
    else:
        prompts = [plain_prompt(cfg.data.prompt_template, client.domain, n) for n in names]
        plain = encode_texts(ldm, prompts)
        base_losses = t_losses(ldm, plain, z0, labels, draws)
        empty_losses = t_losses(
            ldm, unconditional_embedding(ldm).expand(classes, -1, -1), z0, labels, draws
        )
        held_out = shapes.test_set(args.domain, args.per_class, cfg.seed + 1, cfg.data.image_size)
        prompt_images, prompt_seconds = synthesize(plain)
        class_prompts = [
            f"a {n}" for n in names
        ]  # the rare domains' pretraining captions (shapes.pretraining_corpus)
        class_only = encode_texts(ldm, class_prompts)
        class_only_images, _ = synthesize(class_only)
        class_losses = t_losses(ldm, class_only, z0, labels, draws)
        descriptor = shapes.RARE_DESCRIPTORS.get(args.domain, (args.domain,))[0]
        described_prompts = [plain_prompt(cfg.data.prompt_template, descriptor, n) for n in names]
        described = encode_texts(ldm, described_prompts)
        described_images, _ = synthesize(described)
        described_losses = t_losses(ldm, described, z0, labels, draws)
        write_tensors(cache / "prompts-only.safetensors", {"images": quantize(prompt_images)})
        references = {
            "real: the client's images": judge(judges, client.images, labels, args.domain),
            "real: held-out images": judge(judges, held_out.images, held_out.labels, args.domain),
            "real through the VAE": judge(judges, decode_latents(ldm, z0), labels, args.domain),
            "prompts-only": {
                **judge(judges, prompt_images, syn_labels, args.domain),
                "prompts": prompts,
                "synthesis_seconds": round(prompt_seconds, 2),
                "t_losses": base_losses,
            },
            "class-only prompt (no domain word, as the rare domains' pretraining captions)": {
                **judge(judges, class_only_images, syn_labels, args.domain),
                "prompts": class_prompts,
                "t_losses": class_losses,
                "loss_ratio_vs_prompt": ratios(class_losses, base_losses),
            },
            "descriptor prompt (a word the domain's pretraining captions use; not its name)": {
                **judge(judges, described_images, syn_labels, args.domain),
                "prompts": described_prompts,
                "t_losses": described_losses,
                "loss_ratio_vs_prompt": ratios(described_losses, base_losses),
            },
            f"plain prompt via the concept layout (S0, V0, {space} space)": {
                "t_losses": t_losses(ldm, concept_cond(s0, v0), z0, labels, draws),
            },
            "empty prompt": {
                "t_losses": empty_losses,
                "loss_ratio_vs_prompt": ratios(empty_losses, base_losses),
            },
        }
    print(json.dumps(references, indent=1), flush=True)

    # --- --out: references now, each run as it ends (an interrupted invocation keeps its runs)
    out = previous
    entry = out.setdefault("domains", {}).setdefault(args.domain, {})
    entry.update({
        "client": {"client_id": client.client_id, "images": len(z0), "classes": names,
                   "shots_per_class": cfg.data.shots_per_class, "seed": cfg.seed},
        "default_budget_steps": default_steps,
        "references": references,
    })  # fmt: skip
    entry.setdefault("runs", {})
    command = shlex.join(
        ["python", "scripts/domain_upper_bound.py", *(sys.argv[1:] if argv is None else argv)]
    )
    if command not in out.setdefault("commands", []):
        out["commands"].append(command)
    judged = {**out.get("judges", {}), "path": str(args.judges), "per_class": args.judge_per_class,
              "epochs": args.judge_epochs, "on_real": judges.on_real()}  # fmt: skip
    if judges_trained:
        judged["train_seconds"] = round(judges_seconds, 1)
    out.update({
        "what": "issue 47 item 1: fresh-noise images under concepts learned with budgets far beyond the "
                "default, judged by the benchmark's judges (scripts/domain_upper_bound.py's docstring)",
        "sampler": {"scheduler": str(settings.scheduler), "steps": settings.num_inference_steps,
                    "spacing": settings.timestep_spacing, "guidance": settings.guidance_scale,
                    "sampling_autocast": str(ldm.autocast), "per_class": args.per_class},
        "judges": judged,
    })  # fmt: skip

    def save() -> None:
        out["provenance"] = provenance.record(
            ROOT, args.threads, [args.out], model=resolve(cfg.ldm.model)
        )
        out["table"] = table(out)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")

    save()

    # --- long runs
    checkpoints = sorted({int(c) for c in args.checkpoints.split(",") if c.strip()} or
                         {default_steps, *range(500, args.steps, 500)})  # fmt: skip
    for vectors in (
        [] if args.skip_learning else [v.strip() for v in args.vectors.split(",") if v.strip()]
    ):
        for lr in [float(x) for x in args.lrs.split(",") if x.strip()]:
            key = f"{vectors}-lr{lr:g}-{space}" + (f"-t{args.t_min}" if args.t_min > 1 else "")
            epochs = math.ceil(args.steps / steps_per_epoch)
            total = epochs * steps_per_epoch
            wanted = [c for c in checkpoints if c < total] + [total]
            full = concept_batch_loss(ldm, layout, space, z0, labels)
            starts, loss = ([s0, v0], full) if vectors == "sv" else ([s0], s_only(full, v0))
            snaps = Snapshots(loss, wanted, timestep, args.t_min)
            print(f"[{args.domain} {key}] {total} steps ({epochs} epochs)", flush=True)
            load_before = os.getloadavg()[0]
            began = time.perf_counter()
            learned, curve = optimise_embeddings(
                ldm, starts, snaps, z0.shape, timestep, scale, epochs=epochs, batch_size=fedbip_settings(cfg).concept_batch_size,
                lr=lr, generator=torch.Generator().manual_seed(args.seed), on_epoch=progress,
            )  # fmt: skip
            seconds = time.perf_counter() - began
            snaps.taken[total] = (learned, seconds)
            run: dict[str, Any] = {
                "vectors": VECTORS[vectors], "lr": lr, "space": space, "t_min": args.t_min, "t_max": timestep,
                "steps": total, "epochs": epochs, "batch_size": fedbip_settings(cfg).concept_batch_size,
                "seconds": round(seconds, 1), "steps_per_second": round(total / seconds, 2),
                "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2),
                "loss_curve": [round(x, 5) for x in curve],
                "loss_first_10_epochs": round(sum(curve[:10]) / len(curve[:10]), 5),
                "loss_last_10_epochs": round(sum(curve[-10:]) / len(curve[-10:]), 5),
                "snapshots": {},
            }  # fmt: skip
            for step in wanted:
                emb, at = snaps.taken[step]
                s, v = (emb[0], emb[1]) if vectors == "sv" else (emb[0], v0)
                cond = concept_cond(s, v)
                images, syn_seconds = synthesize(cond)
                write_tensors(cache / f"{key}-{step}.safetensors",
                              {"images": quantize(images), "s": s.contiguous(), "v": v.contiguous()})  # fmt: skip
                losses = t_losses(ldm, cond, z0, labels, draws)
                snap = {
                    "steps": step, "seconds": round(at, 1), **judge(judges, images, syn_labels, args.domain),
                    "t_losses": losses, "loss_ratio_vs_prompt": ratios(losses, base_losses),
                    "epoch_loss": round(curve[max(step // steps_per_epoch - 1, 0)], 5),
                    "drift_s": round(relative_drift(s, s0), 3),
                    "drift_v": round(sum(relative_drift(a, b) for a, b in zip(v, v0, strict=True)) / classes, 3),
                    "synthesis_seconds": round(syn_seconds, 2),
                }  # fmt: skip
                run["snapshots"][str(step)] = snap
                shown = {k: snap[k] for k in ("seconds", "class", "domain", "judged_domains")}
                print(
                    f"  step {step}: {json.dumps(shown)} ratio {snap['loss_ratio_vs_prompt']}",
                    flush=True,
                )
            entry["runs"][key] = run
            save()

    path = write_grid(args, cfg, ldm, client, out)
    print(
        f"wrote {args.out} and {path}; best long-budget snapshot: {best_snapshot(entry)}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Why do FedBiP's images from z(T) leave a rare domain that its concepts reach from fresh noise?

Issue 47: on the rebuilt miniature the default run's quickdraw images are judged quickdraw 37-42%
of the time, while the same budget's concepts draw quickdraw 61.5% of the time from fresh noise.
This probe takes the default federation's client of ``--domain`` (as the simulation's node loads
it), runs the client step as a replayable run does (:func:`fedbip_flwr.methods.fedbip.personalize`
with the client's replayable generator, ``--seed``), then repeats the server's synthesis with one
thing changed at a time, same labels and concept rows, and judges every set with the methods
benchmark's judges (:mod:`fedbip_tools.judges`):

- ``uploaded``: the z(T) rows as uploaded, pass 0's eta: what a run makes;
- ``fresh-noise``: the same concepts and eta from fresh noise (the concept-only ablation);
- ``no-eta``: the uploaded z(T) with S as learned;
- ``no-mix``: z(T) of each image alone (gamma = 1: no same-class partner), same T and count;
- ``guidance-G``: the uploaded z(T) at guidance G (``--guidances``);
- ``T=t``: z(T) made at an earlier timestep t (``--timesteps``: the sampler's latest grid
  timestep <= t, as run config synthesis.start-timestep picks it), denoised from there;
- ``prompts``: the plain prompts ("a quickdraw of a circle") from fresh noise: the floor.

    OMP_NUM_THREADS=2 python scripts/zt_domain_probe.py --domain quickdraw \\
        --out benchmarks/zt_domain_probe.json

Judges are trained at ``--judges`` on first use (the benchmark's recipe; minutes to tens of
minutes on a CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fedbip_flwr.concepts import plain_prompt
from fedbip_flwr.config import FedBiPConfig, NodeConfig
from fedbip_flwr.instance import encode_images, noise_instances
from fedbip_flwr.ldm import load_for_run
from fedbip_flwr.methods.fedbip import fedbip_settings, pass_eta, personalize
from fedbip_flwr.seeds import client_generator
from fedbip_flwr.server import WorkUnit
from fedbip_flwr.storage import write_json
from fedbip_flwr.synthesis import (
    SynthesisSettings,
    encode_texts,
    iter_denoised,
    pass_conditioning,
)
from fedbip_tools import provenance
from fedbip_tools.benchmark import client_sets
from fedbip_tools.cli import project_run_config
from fedbip_tools.judges import load_judges

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JUDGES = ROOT / "outputs" / "benchmark" / "judges.safetensors"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domain", default="quickdraw")
    parser.add_argument("--seed", type=int, default=0, help="the run config's seed")
    parser.add_argument("--guidances", type=float, nargs="*", default=[7.5])
    parser.add_argument("--timesteps", type=int, nargs="*", default=[799, 599])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--judges", type=Path, default=DEFAULT_JUDGES)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "zt_domain_probe.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    cfg = FedBiPConfig.from_flat(
        {**project_run_config(), "seed": args.seed, "federation.replayable-client-noise": True}
    )
    made = provenance.record(ROOT, args.threads, [args.out], model=ROOT / cfg.ldm.model)
    ldm = load_for_run(cfg.ldm.model, args.device, cfg.ldm.half_precision, cfg.data.image_size)
    own = fedbip_settings(cfg)
    settings = SynthesisSettings.from_config(cfg)
    if own.class_clusters != 1:
        raise SystemExit(
            "the probe conditions each image on its class's V: fedbip.class-clusters = 1"
        )
    client = next(c for c in client_sets(cfg.data_description).values() if c.domain == args.domain)
    generator = client_generator(cfg, NodeConfig(), client.client_id)
    payload, report = personalize(
        ldm,
        client.images,
        client.labels,
        list(client.classes),
        client.domain,
        client.client_id,
        cfg,
        generator,
    )
    concepts, labels, rows = payload.concepts, payload.labels, payload.concept_rows
    timestep = payload.meta.timestep
    pass0 = WorkUnit(client.client_id, 0, len(payload.labels))
    eta = pass_eta(concepts, own, cfg.seed, pass0)  # the eta of the run's first pass
    learned = pass_conditioning(ldm, concepts, settings, eta)
    z0 = encode_images(ldm.vae, client.images, cfg.ldm.vae_batch_size)
    noise = torch.Generator().manual_seed(args.seed + 1)  # each variant's own fresh draws

    def made_from(
        start: torch.Tensor,
        cond: torch.Tensor,
        t: int,
        guidance: float | None = None,
        start_labels: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Images denoised from ``start`` (uploaded rows' labels unless ``start_labels``)."""
        knobs = (
            settings if guidance is None else dataclasses.replace(settings, guidance_scale=guidance)
        )
        chosen = labels if start_labels is None else start_labels
        chunks = iter(start.split(knobs.batch_size))
        conditions = rows if start_labels is None else start_labels  # class-clusters = 1
        images = iter_denoised(ldm, cond, chosen, knobs, t, lambda _: next(chunks), conditions)
        return torch.cat(list(images)), chosen

    def rebuilt(t: int, gamma_mean: float, gamma_std: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Images from z(T) made again from the client's latents at ``t`` with this mixing."""
        inst = noise_instances(
            ldm.scheduler,
            z0,
            client.labels,
            t,
            gamma_mean=gamma_mean,
            gamma_std=gamma_std,
            draws=own.latents_per_image,
            generator=noise,
        )
        return made_from(inst.zT, learned, t, start_labels=inst.zT_labels)

    fresh = torch.randn(payload.latents.shape, generator=noise)
    prompts = encode_texts(
        ldm,
        [
            plain_prompt(cfg.data.prompt_template, concepts.domain_phrase, name)
            for name in client.classes
        ],
    )
    variants: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
        "uploaded": lambda: made_from(payload.latents.float(), learned, timestep),
        "fresh-noise": lambda: made_from(fresh, learned, timestep),
        "no-eta": lambda: made_from(
            payload.latents.float(),
            pass_conditioning(ldm, concepts, settings, torch.zeros_like(eta)),
            timestep,
        ),
        "no-mix": lambda: rebuilt(timestep, 1.0, 0.0),
        **{
            f"guidance-{g:g}": (
                lambda g=g: made_from(payload.latents.float(), learned, timestep, g)
            )
            for g in args.guidances
        },
        **{
            f"T={t}": (lambda t=t: rebuilt(t, own.gamma_mean, own.gamma_std))
            for t in (settings.sampler(ldm).first_timestep(r) for r in args.timesteps)
        },
        "prompts": lambda: made_from(fresh, prompts, timestep),
    }
    made_sets, seconds = {}, {}
    for name, make in variants.items():
        began = time.perf_counter()
        made_sets[name] = make()
        seconds[name] = round(time.perf_counter() - began, 1)
        print(f"{name}: {len(made_sets[name][0])} images in {seconds[name]} s", flush=True)
    started = time.perf_counter()
    judges = load_judges(args.judges)  # after the sets: a failing variant costs no judge training
    judges_seconds = time.perf_counter() - started
    results = {}
    for name, (images, image_labels) in made_sets.items():
        results[name] = {
            **judges.fidelity(images, image_labels, client.domain),
            "images": len(images),
            "seconds": seconds[name],
        }
        print(
            f"{name:>14}: class {100 * results[name]['class']:.1f}%  "
            f"domain {100 * results[name]['domain']:.1f}%",
            flush=True,
        )
    write_json(
        args.out,
        {
            "what": "one client's synthetic set with one synthesis knob changed at a time, judged "
            "(issue 47: why z(T) leaves the domain)",
            "command": f"python scripts/zt_domain_probe.py --domain {args.domain} --seed "
            f"{args.seed} --guidances {' '.join(map(str, args.guidances))} --timesteps "
            f"{' '.join(map(str, args.timesteps))} --threads {args.threads}",
            "client": client.client_id,
            "timestep": timestep,
            "concept_losses_first_last": [report.concept_losses[0], report.concept_losses[-1]],
            "judges": str(args.judges),
            "judges_seconds": round(judges_seconds, 1),
            "provenance": made,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()

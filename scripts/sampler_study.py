"""How few denoising steps, with which scheduler, keep synthesis faithful and the classifier accurate?

For every (scheduler, steps) of a grid and every method (FedBiP, Prompts-only) the study makes
the server's training set for the default federation (``[tool.flwr.app.config]`` of
pyproject.toml: sketch, quickdraw and painting of the shapes world, one client each) with the
library's own code, and measures

- class and domain fidelity of the synthetic images per client domain, by the methods
  benchmark's judges (:mod:`fedbip_tools.judges`), exactly as the benchmark calls them;
- seconds of synthesis (the method's ``train_set``, shards included), T (the sampler's first
  timestep) and alpha_bar_T, and UNet evaluations per image;
- with ``--accuracy``: the server's classifier (:func:`fedbip_flwr.server.train_global`, the
  run config's recipe pinned to ``--classifier-steps`` SGD steps and ``--classifier-seed``)
  scored on every domain's test set (:func:`fedbip_flwr.server.evaluate_models`).

Concepts are learned once per client and seed. Each client runs
:func:`fedbip_flwr.methods.fedbip.personalize` once with the default config (PNDM, 25 steps); then, for
every setting, only the instance level is redone: :func:`fedbip_flwr.instance.personalize_instances`
noises the same images to that sampler's first timestep T from a generator seeded as the
client's own (``client_seed(seed, client_id)``, what ``client_generator`` draws under
``federation.replayable-client-noise``, as in the benchmark), so partners, gammas and noise are the
client's own draws and only T changes (checked at start: re-noised at the default setting,
z(T) is personalize's to within 1e-3); the setting's payload is the base payload with those
latents and its meta's ``timestep``, ``scheduler`` and ``num_inference_steps``. The server's
``accept`` validates it against that setting's run config before synthesis. Learning S and V
does not step a sampler: it trains on t ~ U{1..T}, so the one learning differs from a client's
own under another setting only in that range's end (T = 961 at the default, 801 to 951 for the
grid's other settings: the shared concepts saw a slightly wider range), which is what makes a
grid of 20 settings cost 3 concept trainings instead of 60.

FedBiP's training set is the server's :func:`fedbip_flwr.methods.fedbip.synthesize_all` (the images
``fedbip_tools.sampling.synthesize_client`` makes with seed ``client_seed(seed, client_id)``); Prompts-only's
is its method's ``train_set`` ("a {domain} of a {class}" from fresh noise, as many images per
client as FedBiP makes: images x latents-per-image x multiplier). Both are read back as the
uint8 shards the server trains on.

Results merge into ``--out`` keyed by method/scheduler/steps/seed, so invocations accumulate
(other seeds; ``--accuracy`` for finalists via ``--schedulers`` / ``--steps``); every invocation
prints a markdown table of everything in the file, averaged over seeds.

    python scripts/sampler_study.py --seed 0                     # fidelity, the whole grid
    python scripts/sampler_study.py --seed 1 --schedulers dpm-solver++,unipc --steps 8,10 --accuracy

The judges are trained on first use (about 20 minutes on 2 cores) and cached at ``--judges``
(default: the benchmark's, outputs/benchmark/judges.safetensors). Without the project installed
(``pip install -e .``), run with ``PYTHONPATH=.`` from the checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fedbip_flwr import dataset, methods
from fedbip_flwr.classifier import ShardImages, fit_to_classifier
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.dataset import ClientSet
from fedbip_flwr.instance import personalize_instances
from fedbip_flwr.ldm import LDM, load_for_run, select_device
from fedbip_flwr.logs import setup_logging
from fedbip_flwr.methods import ClientJob, ServerJob, Upload
from fedbip_flwr.methods.fedbip import LATENT_DTYPES, fedbip_settings, personalize
from fedbip_flwr.payload import Payload, encode_payload
from fedbip_flwr.sampler import SchedulerName
from fedbip_flwr.seeds import client_seed
from fedbip_flwr.server import (
    RunFolder,
    evaluate_models,
    train_global,
)
from fedbip_flwr.storage import write_json
from fedbip_flwr.synthesis import SynthesisSettings
from fedbip_tools.benchmark import client_sets
from fedbip_tools.cli import project_run_config
from fedbip_tools.judges import Judges, load_judges

log = logging.getLogger("sampler_study")
ROOT = Path(__file__).resolve().parents[1]
METHODS = ("fedbip", "prompts-only")
# What a setting changes; the rest of the run config is the default federation's.
SETTING_KEYS = (
    "synthesis.scheduler",
    "synthesis.num-inference-steps",
    "synthesis.timestep-spacing",
    "seed",
)
SPACINGS = ("leading", "trailing")
Tests = dict[str, tuple[torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------------- configuration
def run_config(
    seed: int, scheduler: str | None = None, steps: int | None = None, spacing: str | None = None
) -> FedBiPConfig:
    """The default federation's run config (pyproject.toml), with this seed and sampler."""
    setting = {
        "synthesis.scheduler": scheduler,
        "synthesis.num-inference-steps": steps,
        "synthesis.timestep-spacing": spacing,
    }
    flat = {
        **project_run_config(),
        "seed": seed,
        **{k: v for k, v in setting.items() if v is not None},
    }
    return FedBiPConfig.from_flat(flat)


def shared_config(cfg: FedBiPConfig) -> dict[str, Any]:
    """What a result depends on besides its key: the run config less the setting's own keys."""
    return {k: v for k, v in cfg.to_flat().items() if k not in SETTING_KEYS}


def config_digest(cfg: FedBiPConfig) -> str:
    return hashlib.sha256(json.dumps(shared_config(cfg), sort_keys=True).encode()).hexdigest()[:12]


def client_noise(cfg: FedBiPConfig, client_id: str) -> torch.Generator:
    """A client's randomness as ``client_generator`` seeds it under
    federation.replayable-client-noise."""
    return torch.Generator().manual_seed(client_seed(cfg.seed, client_id))


# ----------------------------------------------------------------------------- client side
def learn_payloads(
    ldm: LDM, cfg: FedBiPConfig, clients: Mapping[str, ClientSet]
) -> dict[str, Payload]:
    """Every client's FedBiP payload under the default config: its concepts, learned once."""
    payloads = {}
    for client_id, data in clients.items():
        payloads[client_id], report = personalize(
            ldm,
            data.images,
            data.labels,
            list(data.classes),
            data.domain,
            client_id,
            cfg,
            client_noise(cfg, client_id),
        )
        log.info("[%s] concepts learned in %.0f s", client_id, report.seconds["concept"])
        check_replay(renoised(ldm, payloads[client_id], data, cfg), payloads[client_id])
    return payloads


def renoised(ldm: LDM, base: Payload, data: ClientSet, cfg: FedBiPConfig) -> Payload:
    """``base`` with its z(T) made again at ``cfg``'s sampler's T from the client's own draws."""
    sampler, own = SynthesisSettings.from_config(cfg).sampler(ldm), fedbip_settings(cfg)
    timestep = sampler.first_timestep(cfg.synthesis.start_timestep)
    instances = personalize_instances(
        ldm.vae,
        ldm.scheduler,
        data.images,
        data.labels,
        timestep,
        gamma_mean=own.gamma_mean,
        gamma_std=own.gamma_std,
        generator=client_noise(cfg, data.client_id),
        vae_batch_size=cfg.ldm.vae_batch_size,
        draws=own.latents_per_image,
    )
    meta = base.meta.model_copy(
        update={
            "timestep": timestep,
            "scheduler": sampler.name,
            "num_inference_steps": cfg.synthesis.num_inference_steps,
        }
    )
    return dataclasses.replace(
        base,
        latents=instances.zT.to(LATENT_DTYPES[own.latent_dtype]).contiguous(),
        labels=instances.zT_labels.to(torch.int64),
        meta=meta,
    )


def check_replay(payload: Payload, base: Payload) -> None:
    """Re-noised at the default setting, z(T) must be the client's own: else the generator is
    not seeded (or drawn from) as the client's is, and every other setting is off too."""
    gap = float((payload.latents.float() - base.latents.float()).abs().max())
    if payload.meta != base.meta or gap > 1e-3:
        raise RuntimeError(
            f"{base.meta.client_id}: re-noising does not replay personalize's z(T) (max |diff| {gap})"
        )


def fedbip_uploads(
    ldm: LDM, bases: Mapping[str, Payload], clients: Mapping[str, ClientSet], job: ServerJob
) -> dict[str, Upload]:
    """The setting's FedBiP uploads, accepted by the server of that setting."""
    method = methods.create_one_shot("fedbip")
    uploads = {}
    for client_id, base in bases.items():
        payload = renoised(ldm, base, clients[client_id], job.cfg)
        uploads[client_id] = method.accept(encode_payload(payload), job)
    return uploads


def prompts_only_uploads(
    ldm: LDM, clients: Mapping[str, ClientSet], job: ServerJob
) -> dict[str, Upload]:
    """Prompts-only's uploads (class counts), made and accepted by its method."""
    method = methods.create_one_shot("prompts-only")
    uploads = {}
    for client_id, data in clients.items():
        client = ClientJob(job.cfg, data, client_noise(job.cfg, client_id), lambda: ldm, job.device)
        blob, _ = method.upload(client)
        uploads[client_id] = method.accept(blob, job)
    return uploads


# ----------------------------------------------------------------------------- server side
def setting_facts(ldm: LDM, cfg: FedBiPConfig) -> dict[str, Any]:
    """T, alpha_bar_T, the diffusers class and UNet evaluations per image of the setting."""
    sampler = SynthesisSettings.from_config(cfg).sampler(ldm)
    timestep = sampler.first_timestep(cfg.synthesis.start_timestep)
    return {
        "timestep": timestep,
        "alpha_bar": float(ldm.scheduler.alphas_cumprod[timestep]),
        "scheduler_class": sampler.name,
        "unet_evaluations": len(sampler.start(timestep)[1]),
    }


def training_set(
    name: str, uploads: Mapping[str, Upload], job: ServerJob, folder: RunFolder
) -> tuple[dict[str, list[Path]], float]:
    """The method's training set as the server writes it (shards per client), and its seconds."""
    started = time.perf_counter()
    shards = methods.create_one_shot(name).train_set(uploads, job, folder.shard_path)
    return shards, time.perf_counter() - started


def judge(
    shards: Mapping[str, Sequence[Path]], uploads: Mapping[str, Upload], judges: Judges
) -> dict[str, Any]:
    """Class and domain fidelity per client domain, read from the shards as the benchmark does."""
    per_domain, images = {}, 0
    for client_id, paths in sorted(shards.items()):
        data = ShardImages(paths, judges.size)
        domain = uploads[client_id].domain
        per_domain[domain] = judges.fidelity(*data[torch.arange(len(data))], domain)
        images += len(data)
    return {
        "per_domain": per_domain,
        "class": statistics.fmean(f["class"] for f in per_domain.values()),
        "domain": statistics.fmean(f["domain"] for f in per_domain.values()),
        "images": images,
    }


def test_sets(cfg: FedBiPConfig) -> Tests:
    """Every domain's test set, held at the classifier's input size as the server holds it."""
    sets = dataset.load_test_sets(cfg.data_description, cfg.data.domain_list)
    return {
        d: (fit_to_classifier(s.images, cfg.classifier.image_size), s.labels)
        for d, s in sets.items()
    }


def accuracy(
    cfg: FedBiPConfig,
    shards: Mapping[str, Sequence[Path]],
    folder: RunFolder,
    tests: Tests,
    steps: int,
    seed: int,
    device: torch.device,
) -> dict[str, Any]:
    """The server's classifier on the synthetic set (``steps`` SGD steps, ``seed``), scored."""
    recipe = FedBiPConfig.from_flat({**cfg.to_flat(), "seed": seed, "classifier.steps": steps})
    model, facts = train_global(
        recipe, shards, dataset.class_names(cfg.data_description), folder, device
    )
    scores = evaluate_models({"global": model}, tests, cfg.classifier.image_size, device)
    return {
        **scores,
        "classifier_steps": steps,
        "classifier_seed": seed,
        "classifier_seconds": facts["classifier_seconds"],
    }


# ----------------------------------------------------------------------------- one setting
@dataclasses.dataclass(frozen=True)
class Study:
    ldm: LDM
    device: torch.device  # the run config's: the LDM's and the classifier's
    judges: Judges
    clients: dict[str, ClientSet]
    bases: dict[str, Payload]  # FedBiP's default-config payloads (empty without fedbip)
    tests: Tests | None  # None: no accuracy
    classifier_steps: int
    classifier_seed: int


def measure(study: Study, name: str, cfg: FedBiPConfig) -> dict[str, Any]:
    """One method under one setting: its training set made, judged, and optionally trained on."""
    job = ServerJob(cfg, dataset.class_names(cfg.data_description), lambda: study.ldm, study.device)
    started = time.perf_counter()
    if name == "fedbip":
        uploads = fedbip_uploads(study.ldm, study.bases, study.clients, job)
    else:
        uploads = prompts_only_uploads(study.ldm, study.clients, job)
    upload_seconds = time.perf_counter() - started
    with tempfile.TemporaryDirectory(prefix="sampler-study-") as tmp:
        folder = RunFolder(Path(tmp))
        shards, seconds = training_set(name, uploads, job, folder)
        result = {
            "method": name,
            "scheduler": str(cfg.synthesis.scheduler),
            "steps": cfg.synthesis.num_inference_steps,
            "spacing": cfg.synthesis.timestep_spacing,
            "seed": cfg.seed,
            **setting_facts(study.ldm, cfg),
            "synthesis_seconds": seconds,
            "upload_seconds": upload_seconds,
            "fidelity": judge(shards, uploads, study.judges),
            "config_digest": config_digest(cfg),
            "device": str(job.device),
            "sampling_precision": str(study.ldm.autocast or study.ldm.dtype),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }
        if study.tests is not None:
            result["accuracy"] = accuracy(
                cfg,
                shards,
                folder,
                study.tests,
                study.classifier_steps,
                study.classifier_seed,
                study.device,
            )
    return result


# ----------------------------------------------------------------------------- results
def result_key(result: Mapping[str, Any]) -> str:
    return (
        f"{result['method']}/{result['scheduler']}/{result['steps']}/{result['spacing']}"
        f"/seed-{result['seed']}"
    )


def load_results(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"configs": {}, "results": {}}


def merge(stored: dict[str, Any], result: dict[str, Any], cfg: FedBiPConfig) -> None:
    """Add one result; an earlier one under the same key keeps what this one did not measure
    (its accuracy, when this invocation ran without ``--accuracy``)."""
    key = result_key(result)
    previous = stored["results"].get(key, {})
    if previous.get("config_digest") not in (None, result["config_digest"]):
        log.warning("%s: replacing a result made under another run config", key)
        previous = {}
    stored["results"][key] = {**previous, **result}
    stored["configs"][result["config_digest"]] = shared_config(cfg)


def pct(values: list[float]) -> str:
    if not values:
        return "–"
    spread = f" ± {100 * statistics.stdev(values):.1f}" if len(values) > 1 else ""
    return f"{100 * statistics.fmean(values):.1f}{spread}"


def table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per (method, scheduler, steps): means (± std) over the seeds measured."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in results.values():
        groups.setdefault((r["method"], r["spacing"], r["scheduler"], r["steps"]), []).append(r)
    schedulers = [s.value for s in SchedulerName]
    lines = [
        "| method | spacing | scheduler | steps | T | alpha_bar_T | UNet evals | class fidelity % | "
        "domain fidelity % | accuracy % | synthesis s | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (method, spacing, scheduler, steps), rows in sorted(
        groups.items(),
        key=lambda g: (METHODS.index(g[0][0]), g[0][1], schedulers.index(g[0][2]), g[0][3]),
    ):
        first = rows[0]
        accuracies = [r["accuracy"]["mean"] for r in rows if "accuracy" in r]
        lines.append(
            f"| {method} | {spacing} | {scheduler} | {steps} | {first['timestep']} | {first['alpha_bar']:.4f} "
            f"| {first['unet_evaluations']} | {pct([r['fidelity']['class'] for r in rows])} "
            f"| {pct([r['fidelity']['domain'] for r in rows])} | {pct(accuracies)} "
            f"| {statistics.fmean(r['synthesis_seconds'] for r in rows):.1f} "
            f"| {','.join(str(s) for s in sorted(r['seed'] for r in rows))} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line
def names(text: str, known: Sequence[str], what: str) -> list[str]:
    chosen = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [c for c in chosen if c not in known]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{what}: {text!r}; choose from {', '.join(known)}")
    return chosen


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seed", type=int, default=0, help="run-config seed: clients' data, noise, eta"
    )
    parser.add_argument(
        "--schedulers",
        default=",".join(s.value for s in SchedulerName),
        type=lambda t: names(t, [s.value for s in SchedulerName], "schedulers"),
        help="comma-separated run-config schedulers",
    )
    parser.add_argument(
        "--steps",
        default="5,8,10,15,25",
        type=lambda t: [int(n) for n in t.split(",") if n.strip()],
        help="comma-separated synthesis.num-inference-steps",
    )
    parser.add_argument(
        "--spacings",
        default="trailing",
        type=lambda t: names(t, SPACINGS, "spacings"),
        help="comma-separated synthesis.timestep-spacing values",
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        type=lambda t: names(t, METHODS, "methods"),
        help="comma-separated methods",
    )
    parser.add_argument(
        "--accuracy", action="store_true", help="also train and score the classifier (slow)"
    )
    parser.add_argument(
        "--classifier-steps", type=int, default=300, help="SGD steps (the benchmark's)"
    )
    parser.add_argument("--classifier-seed", type=int, default=0)
    parser.add_argument(
        "--judges",
        type=Path,
        default=ROOT / "outputs" / "benchmark" / "judges.safetensors",
        help="the benchmark's fidelity judges (trained and saved here if missing)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "sampler_study.json",
        help="results JSON, merged into by every invocation",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    setup_logging(
        logging.WARNING
    )  # the library's per-epoch and per-shard lines: its bars show them
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    base = run_config(args.seed)
    device = select_device(base.ldm.device)
    ldm = load_for_run(
        base.ldm.model,
        device,
        base.ldm.half_precision,
        base.data.image_size,
        channels_last=base.ldm.channels_last,
        compile_unet=base.ldm.compile_unet,
    )
    clients = client_sets(base.data_description)
    study = Study(
        ldm=ldm,
        device=device,
        judges=load_judges(args.judges),
        clients=clients,
        bases=learn_payloads(ldm, base, clients) if "fedbip" in args.methods else {},
        tests=test_sets(base) if args.accuracy else None,
        classifier_steps=args.classifier_steps,
        classifier_seed=args.classifier_seed,
    )
    stored = load_results(args.out)
    grid = [
        (s, n, p, m)
        for p in args.spacings
        for s in args.schedulers
        for n in args.steps
        for m in args.methods
    ]
    for scheduler, steps, spacing, name in tqdm(grid, desc="settings", unit="setting"):
        cfg = run_config(args.seed, scheduler, steps, spacing)
        result = measure(study, name, cfg)
        log.info(
            "%s: class %.3f, domain %.3f, %.1f s",
            result_key(result),
            result["fidelity"]["class"],
            result["fidelity"]["domain"],
            result["synthesis_seconds"],
        )
        merge(stored, result, cfg)
        write_json(args.out, stored)
    print(table(stored["results"]))
    print(
        f"\n{len(grid)} setting(s) in {time.perf_counter() - started:.0f} s; results in {args.out}"
    )


if __name__ == "__main__":
    main()

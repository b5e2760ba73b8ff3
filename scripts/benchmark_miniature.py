"""Quality benchmark on the miniature world: does FedBiP learn, and what does T cost in privacy?

For every seed, everything is redone: clients' personalization, server synthesis, classifiers.
Methods (paper Table 1 shape): Central (oracle, real images of all clients), Local (one model
per client, averaged), FedAvg (multi-round, on Flower), Prompts-only (pretrained LDM, the prompt
template with the domain and class words, fresh noise), concept-only (learned S, V; fresh noise),
instance-only (z(T); template words, no concept learning), FedBiP-S/M/L (m = 2/5/10). Ablations:
concepts in hidden-state space, fp16 latents. Privacy: membership-inference gaps (non-member minus
member mean loss and mean entropy, paper Sec. 5.5) for FedAvg and FedBiP, the start timestep T
swept as a dial, with the distance from each synthetic image to its nearest real client image.
Every synthetic set is also labelled by two judges trained on real images (class, domain), which
says whether a method's images lack the class or the client's style.

Every classifier gets the same budget rule: the configured epochs, raised so that it makes at
least ``--min-steps`` SGD steps (small real sets would otherwise barely train). Central and FedAvg
are also run with as many SGD steps as FedBiP-L's classifier makes (FedAvg: summed over clients),
so that the real-data baselines are not beaten by compute alone. FedBiP-S and -M
are the first 2 and 5 of FedBiP-L's 10 passes (same distribution as separate runs, less compute).

Results per seed are cached in benchmarks/runs/ (with the settings that produced them) so an
interrupted benchmark resumes, and seeds can run as separate processes (start the others once
the first has saved runs/judges.safetensors, or each trains the same judges); every invocation
summarizes all cached seeds made with its settings into benchmarks/miniature.json and
BENCHMARKS.md. The images the pictures need are kept beside seed 0's results.

    python scripts/benchmark_miniature.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fedavg_baseline import FedAvgSettings, train_fedavg

from fedbip_flwr import shapes
from fedbip_flwr.classifier import (
    TrainSettings,
    build_classifier,
    evaluate,
    train_classifier,
)
from fedbip_flwr.client import personalize
from fedbip_flwr.concepts import plain_prompt
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import LDM, load_ldm
from fedbip_flwr.payload import Payload, encode_payload
from fedbip_flwr.server import client_seed, synthesis_settings
from fedbip_flwr.storage import atomic_write, read_tensors, write_tensors
from fedbip_flwr.synthesis import sample_from_prompts, synthesize_client
from fedbip_flwr.viz import dequantize, image_grid, quantize

ROOT = Path(__file__).resolve().parents[1]
CENTRAL_EQUAL, FEDAVG_EQUAL = "Central, FedBiP-L's steps", "FedAvg, FedBiP-L's steps"
TABLE_METHODS = (
    "Central",
    CENTRAL_EQUAL,
    "Local",
    "FedAvg",
    FEDAVG_EQUAL,
    "Prompts-only",
    "concept-only",
    "instance-only",
    "FedBiP-S",
    "FedBiP-M",
    "FedBiP-L",
)
ABLATIONS = ("FedBiP-S", "FedBiP-S hidden-space", "FedBiP-S fp16 latents")
MULTIPLIERS = {"FedBiP-S": 2, "FedBiP-M": 5, "FedBiP-L": 10}
# Trained on real images only: their results do not depend on the generative settings below,
# so they are cached apart and survive a change of prompt, concepts or sampler.
REAL_DATA = frozenset({"Central", CENTRAL_EQUAL, "Local", "FedAvg", FEDAVG_EQUAL})
GENERATIVE_KEYS = frozenset(
    {
        "model", "device", "half_precision", "gamma_mean", "gamma_std", "start_timestep",
        "latent_dtype", "prompt_template", "n_s", "n_v", "concept_space", "concept_lr",
        "concept_epochs", "concept_batch_size", "max_payload_mb", "multiplier",
        "num_inference_steps", "guidance_scale", "eta_std", "synthesis_batch_size",
    }
)  # fmt: skip
JUDGE_SEED = 1000  # judges see real images of their own: no benchmark seed's test or client set
Sets = dict[str, shapes.ImageSet]


@dataclasses.dataclass(frozen=True)
class Bench:
    cfg: FedBiPConfig  # the run config every FedBiP variant starts from
    seeds: tuple[int, ...]
    min_steps: int
    fedavg_rounds: int
    fedavg_local_epochs: int
    timesteps: tuple[int, ...]  # 0 = the paper's T (first timestep of the schedule)
    mia_per_domain: int

    def settings(self, real_data: bool = False) -> dict:
        """What a cached result must have been made with to be reused (everything but the seeds).

        ``real_data``: only what the real-data baselines read (no generative settings).
        """
        fields = dataclasses.asdict(self)
        fields.pop("seeds")
        fields["cfg"] = self.cfg.model_dump(mode="json")
        fields["timesteps"] = list(self.timesteps)
        if real_data:
            fields.pop("timesteps")
            fields["cfg"] = {k: v for k, v in fields["cfg"].items() if k not in GENERATIVE_KEYS}
        return fields


class SettingsMismatch(RuntimeError):
    pass


def load_cache(path: Path, settings: dict) -> dict:
    """Results cached for one seed, or {} if none; refuses results made with other settings."""
    if not path.exists():
        return {}
    cached = json.loads(path.read_text())
    if cached.get("settings") != settings:
        raise SettingsMismatch(
            f"{path} was made with other settings; pass another --out or delete it to start over"
        )
    return cached["results"]


def seed_stores(bench: Bench, cache: Path) -> dict[bool, tuple[Path, dict]]:
    """A seed's two cache files, for real-data baselines (True) and for the methods that
    synthesize, each with the settings its results depend on."""
    real = cache.with_name(cache.stem + "-real.json")
    return {False: (cache, bench.settings()), True: (real, bench.settings(real_data=True))}


# ---------------------------------------------------------------------------------- data
def client_sets(cfg: FedBiPConfig, seed: int) -> dict[str, shapes.ImageSet]:
    """One client per domain, as in the default federation, keyed by client id."""
    out = {}
    for pid in range(len(cfg.domain_list)):
        domain, index = shapes.partition(pid, cfg.domain_list)
        out[f"{domain}-{index}"] = shapes.client_train_set(
            domain, cfg.shots_per_class, index, seed=seed, size=cfg.image_size
        )
    return out


def test_sets(cfg: FedBiPConfig, seed: int) -> Sets:
    return {
        d: shapes.test_set(d, cfg.test_per_class, seed=seed, size=cfg.image_size)
        for d in cfg.domain_list
    }


# ---------------------------------------------------------------------------- classifier
def train_settings(bench: Bench, n: int) -> TrainSettings:
    cfg = bench.cfg
    epochs = max(cfg.classifier_epochs, math.ceil(bench.min_steps * cfg.classifier_batch_size / n))
    return TrainSettings(
        epochs,
        cfg.classifier_lr,
        cfg.classifier_momentum,
        cfg.classifier_batch_size,
        cfg.classifier_image_size,
    )


def sgd_steps(settings: TrainSettings, n: int) -> int:
    """Optimizer steps of ``train_classifier`` on ``n`` images (it skips a last batch of one)."""
    full, rest = divmod(n, settings.batch_size)
    return settings.epochs * (full + (rest >= 2))


def fit(
    bench: Bench, images: torch.Tensor, labels: torch.Tensor, seed: int, steps: int = 0
) -> torch.nn.Module:
    """A classifier under the budget rule, or with about ``steps`` SGD steps if given."""
    settings = train_settings(bench, len(labels))
    if steps:
        per_epoch = math.ceil(len(labels) / settings.batch_size)
        settings = dataclasses.replace(settings, epochs=math.ceil(steps / per_epoch))
    model = build_classifier(len(shapes.CLASSES), bench.cfg.classifier_init)
    return train_classifier(model, images, labels, settings, seed=seed)


def accuracy(model: torch.nn.Module, tests: Sets, size: int) -> dict[str, float]:
    return {d: evaluate(model, s.images, s.labels, size).accuracy for d, s in tests.items()}


def mia_gaps(
    model: torch.nn.Module, members: Sets, tests: Sets, per_domain: int, size: int
) -> dict:
    """Non-member minus member mean loss / entropy: ~0 means the model does not tell them apart."""
    gaps = {"loss": [], "entropy": []}
    for real in members.values():
        test = tests[real.domain]
        inside, outside = balanced(real.labels, per_domain), balanced(test.labels, per_domain)
        inside = evaluate(model, real.images[inside], real.labels[inside], size)
        outside = evaluate(model, test.images[outside], test.labels[outside], size)
        gaps["loss"].append(outside.mean_loss - inside.mean_loss)
        gaps["entropy"].append(outside.mean_entropy - inside.mean_entropy)
    return {k: statistics.fmean(v) for k, v in gaps.items()}


def balanced(labels: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of up to ``n`` examples, the same number from every class (sets are class-sorted)."""
    classes = labels.unique()
    per_class = max(1, n // len(classes))
    return torch.cat([torch.nonzero(labels == c).flatten()[:per_class] for c in classes])


def nearest_real_distance(synthetic: torch.Tensor, real: torch.Tensor) -> float:
    """Mean over synthetic images of the RMS pixel distance (images in [-1, 1]) to the closest real one.

    Synthetic images are compared at the real images' resolution.
    """
    if synthetic.shape[-2:] != real.shape[-2:]:
        synthetic = F.interpolate(synthetic.float(), size=real.shape[-2:], mode="bilinear", antialias=True)
    a, b = synthetic.flatten(1).float(), real.flatten(1).float()
    return float((torch.cdist(a, b).min(dim=1).values / math.sqrt(a.shape[1])).mean())


# ------------------------------------------------------------------------------- fidelity
@dataclasses.dataclass(frozen=True)
class Judges:
    """Two classifiers of real images of all five domains: which class, which domain.

    They label a method's synthetic images. Class fidelity: the share judged as the class it was
    made for. Domain fidelity: the share judged as the client's domain. Together they say what a
    method's images lack where accuracy alone cannot (paper Figure 1 asks the same question).
    """

    classes: torch.nn.Module
    domains: torch.nn.Module
    size: int

    def fidelity(self, images: torch.Tensor, labels: torch.Tensor, domain: str) -> dict:
        domain_labels = torch.full_like(labels, shapes.DOMAINS.index(domain))
        return {
            "class": evaluate(self.classes, images, labels, self.size).accuracy,
            "domain": evaluate(self.domains, images, domain_labels, self.size).accuracy,
        }

    def on_real(self, per_class: int = 20) -> dict[str, float]:
        """Their accuracy on held-out real images of every domain (is the judge any good?)."""
        sets = [shapes.test_set(d, per_class, JUDGE_SEED + 1, self.size) for d in shapes.DOMAINS]
        scores = [self.fidelity(s.images, s.labels, s.domain) for s in sets]
        return {k: statistics.fmean(score[k] for score in scores) for k in ("class", "domain")}


def load_judges(path: Path, size: int, per_class: int = 40, epochs: int = 30) -> Judges:
    """The judges saved at ``path``, or trained on real images of every domain and saved there."""
    models = {
        "classes": build_classifier(len(shapes.CLASSES), "random"),
        "domains": build_classifier(len(shapes.DOMAINS), "random"),
    }
    if path.exists():
        weights = read_tensors(path)
        for kind, model in models.items():
            model.load_state_dict(
                {k.removeprefix(f"{kind}."): v for k, v in weights.items() if k.startswith(f"{kind}.")}
            )
    else:
        sets = [shapes.test_set(d, per_class, JUDGE_SEED, size) for d in shapes.DOMAINS]
        images = torch.cat([s.images for s in sets])
        targets = {
            "classes": torch.cat([s.labels for s in sets]),
            "domains": torch.cat([torch.full_like(s.labels, i) for i, s in enumerate(sets)]),
        }
        settings = TrainSettings(epochs, 0.01, 0.9, 64, size)
        for kind, model in models.items():
            print(f"training the {kind} judge ({len(images)} real images)", flush=True)
            train_classifier(model, images, targets[kind], settings, seed=JUDGE_SEED)
        write_tensors(
            path, {f"{k}.{n}": t for k, m in models.items() for n, t in m.state_dict().items()}
        )
    return Judges(models["classes"].eval(), models["domains"].eval(), size)


# ------------------------------------------------------------------------------ synthesis
def personalize_all(
    ldm: LDM, clients: dict[str, shapes.ImageSet], cfg: FedBiPConfig, seed: int
) -> dict[str, Payload]:
    payloads = {}
    for client_id, data in clients.items():
        payloads[client_id], _ = personalize(
            ldm,
            data.images,
            data.labels,
            list(data.classes),
            data.domain,
            client_id,
            cfg,
            generator=torch.Generator().manual_seed(client_seed(seed, client_id)),
        )
    return payloads


def synthesize(
    ldm: LDM, payloads: dict[str, Payload], cfg: FedBiPConfig, seed: int
) -> dict[str, tuple]:
    """(images, labels) per client: cfg.multiplier passes over each uploaded z(T)."""
    settings = synthesis_settings(cfg)
    out = {}
    for client_id, payload in payloads.items():
        made = synthesize_client(ldm, payload, settings, seed=client_seed(seed, client_id))
        out[client_id] = (made.images, made.labels)
    return out


def with_latents(payload: Payload, latents: torch.Tensor) -> Payload:
    return dataclasses.replace(payload, latents=latents)


def prompts_only(
    ldm: LDM, clients: dict[str, shapes.ImageSet], cfg: FedBiPConfig, seed: int
) -> dict[str, tuple]:
    """The prompt template with the plain domain and class words ("a sketch of a star"), fresh
    noise for every image, as many images as FedBiP-S."""
    settings = synthesis_settings(cfg)
    out = {}
    for client_id, data in clients.items():
        labels = data.labels.repeat(cfg.multiplier)
        prompts = [
            plain_prompt(cfg.prompt_template, data.domain, data.classes[y]) for y in labels.tolist()
        ]
        generator = torch.Generator().manual_seed(client_seed(seed, client_id))
        out[client_id] = (sample_from_prompts(ldm, prompts, settings, generator), labels)
    return out


def pooled(sets: dict[str, tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x for x, _ in sets.values()]), torch.cat([y for _, y in sets.values()])


def first_passes(
    sets: dict[str, tuple], clients: dict[str, shapes.ImageSet], passes: int
) -> dict[str, tuple]:
    """The first ``passes`` passes of a multi-pass synthesis (images are pass-major per client)."""
    return {
        cid: (x[: passes * len(clients[cid])], y[: passes * len(clients[cid])])
        for cid, (x, y) in sets.items()
    }


# ---------------------------------------------------------------------------------- a seed
class SeedRun:
    """All methods for one seed; results are cached to disk after each method.

    Two cache files per seed (:func:`seed_stores`), so that the real-data baselines survive a
    change of the generative settings.
    """

    def __init__(
        self,
        bench: Bench,
        ldm: LDM,
        seed: int,
        cache: Path,
        only: frozenset[str] = frozenset(),
        judges: Judges | None = None,
    ) -> None:
        self.bench, self.ldm, self.seed, self.cache, self.judges = bench, ldm, seed, cache, judges
        self.only = only  # run just these methods (empty: all)
        self.results: dict = {}
        self.refresh()
        self.clients = client_sets(bench.cfg, seed)
        self.tests = test_sets(bench.cfg, seed)
        self.size = bench.cfg.classifier_image_size
        saved = samples_path(cache)
        # uint8 images the pictures need, kept across resumed runs
        self.samples: dict[str, torch.Tensor] = load_file(saved) if saved.exists() else {}

    def store(self, name: str) -> tuple[Path, dict]:
        return seed_stores(self.bench, self.cache)[name in REAL_DATA]

    def refresh(self) -> None:
        """Add what another process of the same seed has cached meanwhile."""
        for path, settings in seed_stores(self.bench, self.cache).values():
            self.results = {**self.results, **load_cache(path, settings)}

    def wanted(self, name: str) -> bool:
        """Not yet cached (by this or another process of the same seed) and selected."""
        self.refresh()
        return name not in self.results and (not self.only or name in self.only)

    def record(self, name: str, make: Callable[[], dict]) -> None:
        if not self.wanted(name):
            print(f"[seed {self.seed}] {name}: cached or not selected", flush=True)
            return
        started = time.perf_counter()
        result = make()
        result["seconds"] = time.perf_counter() - started
        # merge with what another process may have cached meanwhile, then replace atomically
        path, settings = self.store(name)
        mine = {k: v for k, v in self.results.items() if self.store(k)[0] == path}
        merged = {**load_cache(path, settings), **mine, name: result}
        record = {"settings": settings, "results": merged}
        atomic_write(path, (json.dumps(record, indent=1) + "\n").encode())
        self.results[name] = result
        print(
            f"[seed {self.seed}] {name}: {json.dumps({k: v for k, v in result.items()})}",
            flush=True,
        )

    def on_synthetic(self, sets: dict[str, tuple], with_privacy: bool = False) -> dict:
        x, y = pooled(sets)
        model = fit(self.bench, x, y, self.seed)
        result = {"per_domain": accuracy(model, self.tests, self.size), "num_images": len(y)}
        if self.judges is not None:
            scores = {self.clients[c].domain: self.judges.fidelity(*sets[c], self.clients[c].domain) for c in sets}
            result["fidelity"] = {k: {d: v[k] for d, v in scores.items()} for k in ("class", "domain")}
        if with_privacy:
            result["mia_gap"] = mia_gaps(
                model, self.clients, self.tests, self.bench.mia_per_domain, self.size
            )
            result["nearest_real"] = statistics.fmean(
                nearest_real_distance(sets[c][0], self.clients[c].images) for c in sets
            )
        return result

    def run(self) -> dict:
        b, cfg, seed = self.bench, self.bench.cfg, self.seed
        real_x = torch.cat([s.images for s in self.clients.values()])
        real_y = torch.cat([s.labels for s in self.clients.values()])
        self.record(
            "Central",
            lambda: {"per_domain": accuracy(fit(b, real_x, real_y, seed), self.tests, self.size)},
        )
        self.record("Local", self.local)
        self.record("FedAvg", lambda: self.fedavg(b.fedavg_rounds))
        self.record(
            "Prompts-only",
            lambda: self.on_synthetic(
                self.keep("Prompts-only", prompts_only(self.ldm, self.clients, cfg, seed)), True
            ),
        )

        one_pass = cfg.model_copy(update={"multiplier": 1})  # fresh_noise() holds all m passes
        self.record(
            "concept-only",
            lambda: self.on_synthetic(synthesize(self.ldm, self.fresh_noise(), one_pass, seed)),
        )
        no_concepts = cfg.model_copy(update={"concept_epochs": 0})
        self.record(
            "instance-only",
            lambda: self.on_synthetic(
                synthesize(
                    self.ldm, personalize_all(self.ldm, self.clients, no_concepts, seed), cfg, seed
                )
            ),
        )
        largest = cfg.model_copy(update={"multiplier": MULTIPLIERS["FedBiP-L"]})
        if any(self.wanted(name) for name in MULTIPLIERS):
            full = self.keep("FedBiP", synthesize(self.ldm, self.payloads, largest, seed))
            timestep = next(iter(self.payloads.values())).meta.timestep
            for name, m in MULTIPLIERS.items():
                self.record(
                    name,
                    lambda m=m: {
                        **self.on_synthetic(first_passes(full, self.clients, m), True),
                        "T": timestep,
                    },
                )
        hidden = cfg.model_copy(update={"concept_space": "hidden"})
        self.record(
            "FedBiP-S hidden-space",
            lambda: self.on_synthetic(
                synthesize(
                    self.ldm, personalize_all(self.ldm, self.clients, hidden, seed), cfg, seed
                )
            ),
        )
        self.record(
            "FedBiP-S fp16 latents",
            lambda: self.on_synthetic(
                synthesize(
                    self.ldm,
                    {cid: with_latents(p, p.latents.half()) for cid, p in self.payloads.items()},
                    cfg,
                    seed,
                )
            ),
        )
        for requested in b.timesteps:
            at_t = cfg.model_copy(update={"start_timestep": requested})
            self.record(f"FedBiP-S T<={requested}", lambda at_t=at_t: self.at_timestep(at_t))
        self.record(
            CENTRAL_EQUAL,
            lambda: {
                "per_domain": accuracy(
                    fit(b, real_x, real_y, seed, self.fedbip_l_steps()), self.tests, self.size
                ),
                "steps": self.fedbip_l_steps(),
            },
        )
        self.record(FEDAVG_EQUAL, lambda: self.fedavg(self.fedavg_equal_rounds()))
        return self.results

    @functools.cached_property
    def payloads(self) -> dict[str, Payload]:
        """The clients' FedBiP payloads with the base config (made once, only if a method needs them)."""
        return personalize_all(self.ldm, self.clients, self.bench.cfg, self.seed)

    def fresh_noise(self) -> dict[str, Payload]:
        """The payloads' concepts with fresh Gaussian noise in place of z(T) (concept-only).

        One draw for every synthetic image, m per uploaded label, so that concept-only starts
        from as many distinct latents as Prompts-only (m passes over one draw differ only by eta).
        """
        m = self.bench.cfg.multiplier
        out = {}
        for i, (cid, p) in enumerate(self.payloads.items()):
            shape = (m * len(p.labels), *p.latents.shape[1:])
            noise = torch.randn(shape, generator=torch.Generator().manual_seed(self.seed + i))
            out[cid] = dataclasses.replace(p, latents=noise, labels=p.labels.repeat(m))
        return out

    def fedbip_l_steps(self) -> int:
        n = MULTIPLIERS["FedBiP-L"] * sum(len(s.labels) for s in self.clients.values())
        return sgd_steps(train_settings(self.bench, n), n)

    def fedavg_equal_rounds(self) -> int:
        """Rounds whose local SGD steps, summed over clients, reach FedBiP-L's step count."""
        local = dataclasses.replace(
            train_settings(self.bench, 1), epochs=self.bench.fedavg_local_epochs
        )
        per_round = sum(sgd_steps(local, len(s.labels)) for s in self.clients.values())
        return math.ceil(self.fedbip_l_steps() / per_round)

    def keep(self, name: str, sets: dict[str, tuple]) -> dict[str, tuple]:
        """Save up to two passes per client of these images for the pictures (uint8, untracked)."""
        for cid, (images, _) in sets.items():
            self.samples[f"{name}/{cid}"] = quantize(images[: 2 * len(self.clients[cid])])
        save_file(self.samples, samples_path(self.cache))
        return sets

    def at_timestep(self, cfg: FedBiPConfig) -> dict:
        payloads = personalize_all(self.ldm, self.clients, cfg, self.seed)
        result = self.on_synthetic(synthesize(self.ldm, payloads, cfg, self.seed), True)
        result["T"] = next(iter(payloads.values())).meta.timestep
        return result

    def local(self) -> dict:
        per_client = [
            accuracy(fit(self.bench, s.images, s.labels, self.seed), self.tests, self.size)
            for s in self.clients.values()
        ]
        return {"per_domain": {d: statistics.fmean(a[d] for a in per_client) for d in self.tests}}

    def fedavg(self, rounds: int) -> dict:
        cfg = self.bench.cfg
        local = train_settings(self.bench, len(next(iter(self.clients.values()))))
        settings = FedAvgSettings(
            tuple(cfg.domain_list),
            cfg.shots_per_class,
            rounds,
            self.bench.fedavg_local_epochs,
            dataclasses.replace(local, epochs=self.bench.fedavg_local_epochs),
            self.seed,
        )
        model = train_fedavg(settings)
        return {
            "per_domain": accuracy(model, self.tests, self.size),
            "rounds": rounds,
            "mia_gap": mia_gaps(
                model, self.clients, self.tests, self.bench.mia_per_domain, self.size
            ),
        }


# ------------------------------------------------------------------------------- reporting
def summarize(runs: dict[int, dict]) -> dict:
    """{"methods": {name: {"per_domain": {d: mean}, "per_domain_std", "mean", "std", "seeds"}}}."""
    methods: dict = {}
    names = {n for r in runs.values() for n in r}
    for name in sorted(names):
        seeds = sorted(s for s, r in runs.items() if name in r)
        rows = [runs[s][name] for s in seeds]
        domains = list(rows[0]["per_domain"])
        means = [statistics.fmean(r["per_domain"].values()) for r in rows]
        entry = {
            "per_domain": {d: statistics.fmean(r["per_domain"][d] for r in rows) for d in domains},
            "per_domain_std": {d: _std([r["per_domain"][d] for r in rows]) for d in domains},
            "mean": statistics.fmean(means),
            "std": _std(means),
            "seeds": seeds,
        }
        for key in ("mia_gap", "nearest_real", "T", "num_images", "steps", "rounds", "seconds", "fidelity"):
            if key in rows[0]:
                entry[key] = _average([r[key] for r in rows])
        if "mia_gap" in rows[0]:
            entry["mia_gap_std"] = {k: _std([r["mia_gap"][k] for r in rows]) for k in rows[0]["mia_gap"]}
        methods[name] = entry
    return {"methods": methods}


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _average(values: list):
    """Mean over seeds of numbers, or of (nested) dicts of numbers key by key."""
    if isinstance(values[0], dict):
        return {k: _average([v[k] for v in values]) for k in values[0]}
    return statistics.fmean(values)


def pct(entry: dict, domain: str | None = None) -> str:
    if domain is None:
        return f"{100 * entry['mean']:.1f} ± {100 * entry['std']:.1f}"
    return f"{100 * entry['per_domain'][domain]:.1f} ± {100 * entry['per_domain_std'][domain]:.1f}"


def markdown(summary: dict, bench: Bench, command: str, device: str) -> str:
    methods, upload = summary["methods"], summary["upload_bytes"]
    domains = list(next(iter(methods.values()))["per_domain"])
    head = (
        "| method | "
        + " | ".join(domains)
        + " | mean | seeds |\n|---|"
        + "---|" * (len(domains) + 2)
        + "\n"
    )

    def rows(names) -> str:
        return "".join(
            f"| {n} | "
            + " | ".join(pct(methods[n], d) for d in domains)
            + f" | {pct(methods[n])} | {len(methods[n]['seeds'])} |\n"
            for n in names
            if n in methods
        )

    privacy = (
        "| method | T | accuracy (mean) | MIA loss gap | MIA entropy gap | nearest real (RMS) |\n"
        "|---|---|---|---|---|---|\n"
    )
    for name in privacy_rows(methods):
        entry = methods[name]
        t = f"{entry['T']:.0f}" if "T" in entry else "–"
        near = f"{entry['nearest_real']:.3f}" if "nearest_real" in entry else "–"
        privacy += (
            f"| {name} | {t} | {pct(entry)} | {gap(entry, 'loss')} | {gap(entry, 'entropy')} | {near} |\n"
        )
    cfg = bench.cfg
    return (
        "## Miniature world: accuracy (%) on each client domain, mean ± std over seeds\n\n"
        f"Command: `{command}` on {device}.\n"
        f"Model `{cfg.model}`, domains {', '.join(domains)} (one client each, {cfg.shots_per_class} shots per class), "
        f"{cfg.num_inference_steps} PNDM steps, guidance {cfg.guidance_scale}, concept epochs {cfg.concept_epochs}, "
        f"classifier ResNet-18 ({cfg.classifier_init} init) >= {cfg.classifier_epochs} epochs and >= {bench.min_steps} steps, "
        f"test {cfg.test_per_class} images per class per domain. Chance is {100 / len(shapes.CLASSES):.1f}%. "
        "Local: each client's classifier on its own shots, tested on every domain, averaged over clients. "
        f"Prompts-only: the prompt template `{cfg.prompt_template}` with the plain domain and class words, fresh noise. "
        "concept-only: the clients' learned S and V, fresh noise for every image. "
        "instance-only: the clients' z(T), the template's plain words (no concept learning). "
        f"FedAvg: {bench.fedavg_rounds} rounds of {bench.fedavg_local_epochs} local epochs on Flower's simulation runtime. "
        + equal_steps(methods)
        + "\n\n"
        + head
        + rows(TABLE_METHODS)
        + "\n### Ablations (concept space, latent precision)\n\n"
        + head
        + rows(ABLATIONS)
        + fidelity_table(summary)
        + "\n### Privacy: membership-inference gaps and the start timestep T\n\n"
        "Gaps are non-member minus member mean loss / entropy of the final classifier "
        f"({bench.mia_per_domain} class-balanced images per domain each), mean ± std over seeds; "
        "0 = members are indistinguishable. Prompts-only never saw a member, so its gap is the "
        "measurement's noise floor. "
        "Nearest real: mean RMS pixel distance (images in [-1, 1]) from each synthetic image to its closest real image of the same client.\n\n"
        + privacy
        + "\nPictures (first seed): `benchmarks/pictures/grid-<domain>.png` (rows: real, prompts-only, "
        "FedBiP) and `benchmarks/pictures/embedding.png` (PCA of the Central classifier's features).\n"
        + "\nUpload per client: "
        + ", ".join(f"{k} {v / 1e3:.1f} kB" for k, v in upload.items())
        + "\n"
    )


def fidelity_table(summary: dict) -> str:
    """Class / domain fidelity of each synthesizing method's images, per client domain."""
    methods = summary["methods"]
    names = [n for n in methods if "fidelity" in methods[n]]
    if not names:
        return ""
    order = [*TABLE_METHODS, *ABLATIONS]
    names.sort(key=lambda n: (order.index(n) if n in order else len(order), -methods[n].get("T", 0)))
    domains = list(methods[names[0]]["fidelity"]["class"])
    judged = summary["judges_on_real"]
    text = (
        "\n### What the synthetic images show: class and domain fidelity (%)\n\n"
        "Two ResNet-18 judges are trained on real images of all five domains (a split no seed "
        "uses): one names the class, one the domain. On held-out real images they are right "
        f"{100 * judged['class']:.1f}% (class) and {100 * judged['domain']:.1f}% (domain) of the time. "
        "Each cell is class fidelity / domain fidelity of a method's synthetic images for that "
        "client, mean over seeds: the share judged as the class they were made for / as the "
        "client's domain.\n\n"
        "| method | " + " | ".join(domains) + " |\n|---|" + "---|" * len(domains) + "\n"
    )
    for name in names:
        fid = methods[name]["fidelity"]
        cells = (f"{100 * fid['class'][d]:.0f} / {100 * fid['domain'][d]:.0f}" for d in domains)
        text += f"| {name} | " + " | ".join(cells) + " |\n"
    return text


def equal_steps(methods: dict) -> str:
    """How the equal-compute baselines were sized (empty if they were not run)."""
    if CENTRAL_EQUAL not in methods or FEDAVG_EQUAL not in methods:
        return ""
    return (
        f"\"{CENTRAL_EQUAL}\" and \"{FEDAVG_EQUAL}\": as many SGD steps as FedBiP-L's classifier "
        f"({methods[CENTRAL_EQUAL]['steps']:.0f}); FedAvg's are summed over clients "
        f"({methods[FEDAVG_EQUAL]['rounds']:.0f} rounds)."
    )


def gap(entry: dict, kind: str) -> str:
    return f"{entry['mia_gap'][kind]:+.3f} ± {entry['mia_gap_std'][kind]:.3f}"


def privacy_rows(methods: dict) -> list[str]:
    """Methods with MIA gaps: baselines, FedBiP-S/M/L, then the T sweep from late to early T."""
    fixed = [n for n in ("FedAvg", FEDAVG_EQUAL, "Prompts-only", *MULTIPLIERS) if n in methods]
    sweep = [n for n in methods if n.startswith("FedBiP-S T<=")]
    return fixed + sorted(sweep, key=lambda n: -methods[n]["T"])


def write_section(path: Path, text: str, marker: str = "miniature") -> None:
    """Replace this benchmark's section of BENCHMARKS.md, leaving the others alone."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    body = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{text}{end}\n"
    if start in body:
        body = body[: body.index(start)] + block + body[body.index(end) + len(end) + 1 :]
    else:
        body = body.rstrip() + "\n\n" + block
    path.write_text(body)


# ----------------------------------------------------------------------------------- pictures
def samples_path(cache: Path) -> Path:
    return cache.with_name(cache.stem + "-samples.safetensors")


def pictures(run: SeedRun, out: Path) -> None:
    """Per domain: real vs prompts-only vs FedBiP; and a 2-D embedding of real vs synthetic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    saved = run.samples
    sample = {
        name: {cid: dequantize(saved[f"{name}/{cid}"]) for cid in run.clients}
        for name in ("Prompts-only", "FedBiP")
        if all(f"{name}/{cid}" in saved for cid in run.clients)
    }
    if len(sample) < 2:
        path = samples_path(run.cache)
        print(f"no pictures: {path} lacks the seed's synthetic images; rerun the seed to make them")
        return
    out.mkdir(parents=True, exist_ok=True)
    x, y = (
        torch.cat([s.images for s in run.clients.values()]),
        torch.cat([s.labels for s in run.clients.values()]),
    )
    judge = fit(run.bench, x, y, run.seed)
    features = torch.nn.Sequential(*list(judge.children())[:-1]).eval()
    fig, axes = plt.subplots(1, len(run.clients), figsize=(5 * len(run.clients), 5))
    for ax, (cid, real) in zip(axes, run.clients.items(), strict=True):
        rows = [
            real.images[::8],
            sample["Prompts-only"][cid][::8],
            sample["FedBiP"][cid][::8],
        ]
        image_grid(rows, out / f"grid-{real.domain}.png", row_labels=["real", "prompts", "FedBiP"])
        groups = {
            "real": real.images,
            "prompts-only": sample["Prompts-only"][cid],
            "FedBiP": sample["FedBiP"][cid],
        }
        with torch.no_grad():
            feats = {k: features(v).flatten(1) for k, v in groups.items()}
        allf = torch.cat(list(feats.values()))
        mean = allf.mean(0)
        _, _, v = torch.pca_lowrank(allf - mean, q=2)
        for (k, f), colour in zip(feats.items(), ("black", "tab:orange", "tab:blue"), strict=True):
            p = (f - mean) @ v
            ax.scatter(p[:, 0], p[:, 1], s=6, alpha=0.6, label=k, c=colour)
        ax.set_title(f"{real.domain}: classifier features, PCA")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "embedding.png", dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------- main
def parse() -> tuple[Bench, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/miniature-ldm")
    p.add_argument("--domains", default="sketch,quickdraw,painting")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--guidance", type=float, default=4.0)
    p.add_argument("--concept-epochs", type=int, default=10)
    p.add_argument(
        "--prompt-template", default="", help='e.g. "a {S} of a {V}"; "" = the dataset\'s'
    )
    p.add_argument("--classifier-epochs", type=int, default=15)
    p.add_argument("--min-steps", type=int, default=150)
    p.add_argument("--fedavg-rounds", type=int, default=10)
    p.add_argument("--fedavg-local-epochs", type=int, default=2)
    p.add_argument(
        "--timesteps",
        type=int,
        nargs="+",
        default=[801, 601],
        help="earlier T values to sweep, besides the paper's first timestep (FedBiP-S)",
    )
    p.add_argument("--test-per-class", type=int, default=50)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    p.add_argument("--report", type=Path, default=ROOT / "BENCHMARKS.md")
    p.add_argument("--device", default="CPU (2 cores)", help="named in BENCHMARKS.md")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="METHOD",
        help="run just these methods of each seed (a second process can share a seed); no report",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="compute nothing new: summarize the cached seeds, draw the pictures, write the report",
    )
    args = p.parse_args()
    cfg = FedBiPConfig(
        model=args.model,
        domains=args.domains,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        concept_epochs=args.concept_epochs,
        prompt_template=args.prompt_template,
        classifier_epochs=args.classifier_epochs,
        classifier_init="random",
        test_per_class=args.test_per_class,
        multiplier=MULTIPLIERS["FedBiP-S"],
    )
    bench = Bench(
        cfg,
        tuple(args.seeds),
        args.min_steps,
        args.fedavg_rounds,
        args.fedavg_local_epochs,
        tuple(args.timesteps),
        mia_per_domain=96,
    )
    return bench, args


def cached_runs(out: Path, bench: Bench) -> dict[int, dict]:
    """Every seed cached under ``out``/runs with these settings (other settings are skipped)."""
    names = (re.fullmatch(r"seed-(\d+)(-real)?", p.stem) for p in (out / "runs").glob("*.json"))
    runs = {}
    for seed in sorted({int(m[1]) for m in names if m}):
        results: dict = {}
        for path, settings in seed_stores(bench, out / "runs" / f"seed-{seed}.json").values():
            try:
                results |= load_cache(path, settings)
            except SettingsMismatch as e:
                print(f"skipped: {e}")
        if results:
            runs[seed] = results
    return runs


def reproduce(args: argparse.Namespace, seeds: list[int]) -> str:
    """The command that redoes the summarized seeds with these settings."""
    flags = {
        "--model": args.model,
        "--domains": args.domains,
        "--seeds": " ".join(map(str, seeds)),
        "--steps": args.steps,
        "--guidance": args.guidance,
        "--concept-epochs": args.concept_epochs,
        "--classifier-epochs": args.classifier_epochs,
        "--min-steps": args.min_steps,
        "--fedavg-rounds": args.fedavg_rounds,
        "--fedavg-local-epochs": args.fedavg_local_epochs,
        "--timesteps": " ".join(map(str, args.timesteps)),
        "--test-per-class": args.test_per_class,
    }
    if args.prompt_template:
        flags["--prompt-template"] = f"'{args.prompt_template}'"
    return "python scripts/benchmark_miniature.py " + " ".join(f"{k} {v}" for k, v in flags.items())


def main() -> None:
    bench, args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    ldm = load_ldm(bench.cfg.model)
    judges = load_judges(args.out / "runs" / "judges.safetensors", bench.cfg.classifier_image_size)
    for seed in () if args.report_only else bench.seeds:
        cache = args.out / "runs" / f"seed-{seed}.json"
        SeedRun(bench, ldm, seed, cache, frozenset(args.only), judges).run()
    if args.only:
        return
    runs = cached_runs(args.out, bench)
    if not runs:
        raise SystemExit(f"nothing to report: no seed in {args.out / 'runs'} has these settings")
    first = min(runs)
    if args.report_only or first in bench.seeds:  # a process running other seeds only skips them
        cache = args.out / "runs" / f"seed-{first}.json"
        pictures(SeedRun(bench, ldm, first, cache), args.out / "pictures")
    summary = summarize(runs)
    summary["upload_bytes"] = upload_sizes(ldm, bench.cfg)
    summary["judges_on_real"] = judges.on_real()
    (args.out / "miniature.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = markdown(summary, bench, reproduce(args, sorted(runs)), args.device)
    write_section(args.report, text)
    print(json.dumps(summary, indent=1))


def upload_sizes(ldm: LDM, cfg: FedBiPConfig) -> dict[str, int]:
    """Bytes of each client's encoded payload (concept values do not change the size)."""
    clients = client_sets(cfg, 0)
    payloads = personalize_all(ldm, clients, cfg.model_copy(update={"concept_epochs": 0}), 0)
    return {cid: len(encode_payload(p)) for cid, p in payloads.items()}


if __name__ == "__main__":
    main()

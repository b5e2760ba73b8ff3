"""The miniature world's contract: does it separate the methods the way DomainNet does?

A benchmark can rank one-shot methods only on a world where a domain gap exists that text
cannot cross and real data can. Five clauses say so, each measured at the methods benchmark's
budget (:class:`fedbip_tools.benchmark.Settings`) over several seeds, from both classifier
starts (the public shapes backbone, the benchmark's, and random weights):

- W1 headroom: Central minus Prompts-only >= 25 points on each rare domain;
- W2 the gap hurts: a classifier trained on the common domains' real images alone (the
  domain-generalization literature's source-only row) scores <= 60% on each rare domain;
- W3 text cannot draw the rare domains: Prompts-only's images are judged in them <= 15%;
- W4 they can be drawn: concepts learned on a rare client's images (far beyond a client's
  budget) draw it from fresh noise, judged in its domain >= 80% at class fidelity >= 90%;
- W5 the task is learnable: Central >= 95% on every domain.

W1, W3 and W5 read the benchmark's own rows (Central and Prompts-only, from each start), made
or taken from its cache by :func:`fedbip_tools.benchmark.run`; W2 and W4 are measured here.
``fedbip world-check`` writes them to ``benchmarks/world.json`` with each seed's figures.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fedbip_flwr import dataset, shapes
from fedbip_flwr.classifier import build_classifier, evaluate, train_classifier
from fedbip_flwr.concepts import encode_prompts, learn_concepts, prompt_layout
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.instance import encode_images
from fedbip_flwr.ldm import load_for_run
from fedbip_flwr.methods.fedbip import fedbip_settings
from fedbip_flwr.paths import project_dir
from fedbip_flwr.server import train_settings
from fedbip_flwr.storage import write_json
from fedbip_flwr.synthesis import SynthesisSettings, iter_from_noise

from . import benchmark, provenance
from .judges import Judges

log = logging.getLogger(__name__)

MARKER = "world"  # the generated section of docs/benchmarks/world.md
STARTS = {"pretrained": "", "random": ", random start"}  # classifier start -> row name suffix
SOURCE_ONLY_PER_CLASS = 48  # real images per class of each common domain
SOURCE_ONLY_CLIENT = 5  # a client index of the common domains that no benchmark seed holds
W4_EPOCHS = 50  # concept epochs for the upper bound (a client's budget is 10)
W4_PER_CLASS = 16  # fresh-noise images per class judged


@dataclass(frozen=True)
class Clause:
    """One clause of the contract: its measured figure per rare domain (mean over seeds, and
    each seed's) against its bound."""

    name: str
    claim: str
    start: str  # the classifier start it was measured from ("" where none is involved)
    per_domain: dict[str, float]
    per_seed: dict[str, dict[str, float]]
    bound: float
    at_most: bool  # True: the figure must not exceed the bound

    @property
    def holds(self) -> bool:
        figures = self.per_domain.values()
        return bool(figures) and all(
            f <= self.bound if self.at_most else f >= self.bound for f in figures
        )


def _clause(
    name: str,
    claim: str,
    start: str,
    per_seed: Mapping[int, Mapping[str, float]],
    bound: float,
    at_most: bool,
) -> Clause:
    domains = sorted(set.intersection(*(set(v) for v in per_seed.values()))) if per_seed else []
    return Clause(
        name=name,
        claim=claim,
        start=start,
        per_domain={d: statistics.fmean(v[d] for v in per_seed.values()) for d in domains},
        per_seed={str(s): dict(v) for s, v in sorted(per_seed.items())},
        bound=bound,
        at_most=at_most,
    )


def common_domain_images(seed: int, per_class: int, size: int) -> shapes.ImageSet:
    """Real images of every common domain (a client no benchmark seed holds), one set."""
    parts = [
        shapes.client_train_set(d, per_class, SOURCE_ONLY_CLIENT, seed, size)
        for d in shapes.COMMON_DOMAINS
    ]
    return shapes.ImageSet(
        torch.cat([p.images for p in parts]),
        torch.cat([p.labels for p in parts]),
        parts[0].classes,
        "common",
    )


def source_only(
    cfg: FedBiPConfig, domains: Sequence[str], per_class: int = SOURCE_ONLY_PER_CLASS
) -> dict[str, float]:
    """Accuracy on each of ``domains``' test sets of the run's classifier recipe (its start,
    steps, schedule) trained on the common domains' real images alone."""
    recipe = cfg.classifier
    train = common_domain_images(cfg.seed, per_class, cfg.data.image_size)
    model = build_classifier(len(train.classes), recipe.init, cfg.ldm.model)
    train_classifier(model, train.images, train.labels, train_settings(recipe), seed=cfg.seed)
    tests = dataset.load_test_sets(cfg.data_description, list(domains))
    return {
        d: evaluate(model, t.images, t.labels, recipe.image_size).accuracy for d, t in tests.items()
    }


def drawn_by_learned_concepts(
    cfg: FedBiPConfig, domain: str, judges: Judges, epochs: int = W4_EPOCHS
) -> dict[str, float]:
    """W4's upper bound: S and V learned on the benchmark's client of ``domain`` for
    ``epochs`` (a client's step, its learning rate and batch), then images from fresh noise
    under them with the run's sampler, judged: class and domain fidelity."""
    own = fedbip_settings(cfg)
    data = cfg.data
    ldm = load_for_run(cfg.ldm.model, "cpu", cfg.ldm.half_precision, data.image_size)
    client = next(
        c for c in benchmark.client_sets(cfg.data_description).values() if c.domain == domain
    )  # as the simulation's node loads it
    layout = prompt_layout(
        ldm.tokenizer, data.prompt_template, data.n_s, data.n_v, domain, list(client.classes)
    )
    settings = SynthesisSettings.from_config(cfg)
    z0 = encode_images(ldm.vae, client.images, cfg.ldm.vae_batch_size)
    learned = learn_concepts(
        ldm,
        layout,
        own.concept_space,
        z0,
        client.labels,
        settings.sampler(ldm).first_timestep(cfg.synthesis.start_timestep),
        epochs=epochs,
        batch_size=own.concept_batch_size,
        lr=own.concept_lr,
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    rows = torch.arange(len(client.classes))
    with torch.no_grad():
        cond = encode_prompts(ldm, layout, own.concept_space, learned.domain, learned.classes, rows)
    labels = rows.repeat_interleave(W4_PER_CLASS)
    noise = torch.Generator().manual_seed(cfg.seed + 1)
    images = torch.cat(list(iter_from_noise(ldm, cond, labels, settings, noise)))
    return judges.fidelity(images, labels, domain)


def rows_per_seed(
    runs: Mapping[int, Mapping[str, Any]], name: str, key: str
) -> dict[int, dict[str, float]]:
    """A benchmark row's per-domain figure ``key`` ("per_domain" accuracy, or "fidelity":
    domain fidelity) on every seed that has the row."""
    out = {}
    for seed, rows in runs.items():
        if name in rows:
            found = rows[name][key]
            out[seed] = found if key == "per_domain" else {d: f["domain"] for d, f in found.items()}
    return out


def clauses(
    runs: Mapping[int, Mapping[str, Any]],
    source: Mapping[str, Mapping[int, Mapping[str, float]]],
    drawn: Mapping[int, Mapping[str, Mapping[str, float]]],
    rare: Sequence[str],
) -> list[Clause]:
    """The five clauses from the benchmark's rows (``runs``: seed -> row -> figures), the
    source-only accuracies (start -> seed -> rare domain) and W4's judged images (seed ->
    rare domain -> class / domain fidelity)."""
    out = []
    for start, suffix in STARTS.items():
        central = rows_per_seed(runs, f"Central{suffix}", "per_domain")
        prompts = rows_per_seed(runs, f"Prompts-only{suffix}", "per_domain")
        headroom = {
            s: {d: central[s][d] - prompts[s][d] for d in rare} for s in central if s in prompts
        }
        out += [
            _clause("W1", "Central minus Prompts-only", start, headroom, 0.25, False),
            _clause("W2", "source-only accuracy", start, source.get(start, {}), 0.60, True),
            _clause("W5", "Central's accuracy, every domain", start, central, 0.95, False),
        ]
    judged = rows_per_seed(runs, "Prompts-only", "fidelity")
    out.append(
        _clause(
            "W3",
            "Prompts-only's images judged in the rare domain",
            "",
            {s: {d: v[d] for d in rare} for s, v in judged.items()},
            0.15,
            True,
        )
    )
    for key, bound, claim in (
        ("domain", 0.80, "learned concepts' fresh-noise images judged in the domain"),
        ("class", 0.90, "... and judged as their class"),
    ):
        figures = {s: {d: v[d][key] for d in v} for s, v in drawn.items()}
        out.append(_clause("W4", claim, "", figures, bound, False))
    return sorted(out, key=lambda c: c.name)


def check(
    bench: benchmark.Bench, seeds: Sequence[int], out: Path, command: str, judges: Judges
) -> tuple[list[Clause], dict[str, Any]]:
    """Run (or take from the benchmark's cache) the rows the contract reads, measure W2 and W4
    on every seed and both starts, and write the record ``out``; the clauses and the record."""
    started = time.perf_counter()
    names = [f"{row}{suffix}" for row in ("Central", "Prompts-only") for suffix in STARTS.values()]
    for seed in seeds:
        benchmark.run_seed(bench, seed, names, judges)
    runs = {s: r for s, r in benchmark.cached_seeds(bench).items() if s in seeds}
    rare = [d for d in bench.settings.domains if d in shapes.RARE_DOMAINS]
    source: dict[str, dict[int, dict[str, float]]] = {}
    drawn: dict[int, dict[str, dict[str, float]]] = {}
    for seed in seeds:
        base = benchmark.base_values(bench, seed)
        for start in STARTS:
            cfg = FedBiPConfig.from_flat({**base, "classifier.init": start})
            source.setdefault(start, {})[seed] = source_only(cfg, rare)
            log.info("seed %d, %s start: source-only %s", seed, start, source[start][seed])
        cfg = FedBiPConfig.from_flat(base)
        drawn[seed] = {d: drawn_by_learned_concepts(cfg, d, judges) for d in rare}
        log.info("seed %d: learned concepts drew %s", seed, drawn[seed])
    found = clauses(runs, source, drawn, rare)
    root = project_dir() or Path.cwd()
    record = {
        "command": command,
        "settings": asdict(bench.settings),
        "settings_digest": bench.settings.digest(),
        "seeds": list(seeds),
        "holds": all(c.holds for c in found),
        "clauses": [{**asdict(c), "holds": c.holds} for c in found],
        "seconds": round(time.perf_counter() - started, 1),
        "provenance": provenance.record(root, bench.threads, [out]),
    }
    write_json(out, record)
    return found, record


def markdown(record: Mapping[str, Any]) -> str:
    """The contract's table from its record (``benchmarks/world.json``): one row per clause and
    start, each rare domain's figure (mean over the seeds, then the seeds' range) and the
    verdict."""
    clauses_ = record["clauses"]
    domains = sorted({d for c in clauses_ for d in c["per_domain"]})
    rows = []
    for c in clauses_:
        cells = []
        for d in domains:
            if d not in c["per_domain"]:
                cells.append("–")
                continue
            seeds = [v[d] for v in c["per_seed"].values() if d in v]
            cells.append(
                f"{100 * c['per_domain'][d]:.1f} ({100 * min(seeds):.1f}-{100 * max(seeds):.1f})"
            )
        sign = "<=" if c["at_most"] else ">="
        rows.append(
            f"| {c['name']} | {c['claim']} | {c['start'] or '–'} | {' | '.join(cells)} "
            f"| {sign} {100 * c['bound']:.0f} | {'holds' if c['holds'] else '**fails**'} |"
        )
    machine = record["provenance"]["machine"]["kind"]
    head = " | ".join(domains)
    return (
        f"Seeds {', '.join(map(str, record['seeds']))}; machine kind {machine}; commit "
        f"`{record['provenance']['commit'][:7]}`; command `{record['command']}`. Figures in %: "
        "mean over the seeds (the seeds' range).\n\n"
        f"| clause | what | classifier start | {head} | bound | verdict |\n"
        f"|---|---|---|{'---|' * len(domains)}---|---|\n" + "\n".join(rows) + "\n"
    )


def lines(found: Sequence[Clause]) -> list[str]:
    """One console line per clause and start: its figures per domain against its bound."""
    out = []
    for c in found:
        figures = ", ".join(f"{d} {100 * v:.1f}%" for d, v in c.per_domain.items())
        start = f" ({c.start} start)" if c.start else ""
        sign = "<=" if c.at_most else ">="
        verdict = "holds" if c.holds else "FAILS"
        out.append(f"{c.name}{start}: {c.claim}: {figures} ({sign} {100 * c.bound:.0f}%) {verdict}")
    return out

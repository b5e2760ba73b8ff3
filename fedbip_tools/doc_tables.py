"""Every docs table made from a record (or from the code), written into its marked section.

A table generated from a record sits between ``<!-- name:start -->`` and ``<!-- name:end -->``
(:func:`fedbip_tools.benchmark.write_section`), so a remade record leaves no stale copy behind:

- ``results`` in README.md: the headline rows of ``benchmarks/methods.json`` made with one model
  on one machine kind (the group holding most of them), per row its seeds, mean accuracy with
  its 95% interval, FedBiP-S minus the row paired over seeds with its interval, upload size,
  the server's membership AUC at both latent sizes, the guarantee;
- ``methods`` in docs/benchmarks/methods.md: the methods benchmark's own section
  (:func:`fedbip_tools.benchmark.markdown`) from the same record;
- ``speed`` in docs/benchmarks/speed.md: ``fedbip speed``'s section from ``benchmarks/perf.json``;
- ``run-config-tables`` in docs/run-configs.md: every run-config key with its default and
  meaning, from the config's models and ``pyproject.toml`` (:mod:`fedbip_tools.config_doc`).
- ``world`` in docs/benchmarks/world.md: the world's contract (``fedbip world-check``) from
  ``benchmarks/world.json``;
- ``default-run`` in docs/benchmarks/default-run.md: the README's first command's runs
  (``scripts/default_runs.py``) from ``benchmarks/default_run.json``, and ``first-run`` in
  README.md: their summary beside the command.

Names, model, machine kind and sampler come from the records; rows recorded under an old name
read under today's (:data:`fedbip_tools.benchmark.LEGACY_NAMES`).

    python -m fedbip_tools.doc_tables          # rewrite every section
    python -m fedbip_tools.doc_tables --check  # exit 1 where a section differs from its record
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from scipy import stats

from fedbip_flwr.config import FedBiPConfig

from . import benchmark, config_doc, speed, world
from .upload_attacks import upload_test

ROOT = Path(__file__).resolve().parents[1]
METHODS_RECORD = ROOT / "benchmarks" / "methods.json"
SPEED_RECORD = ROOT / "benchmarks" / "perf.json"
README = ROOT / "README.md"
METHODS_PAGE = ROOT / "docs" / "benchmarks" / "methods.md"
SPEED_PAGE = ROOT / "docs" / "benchmarks" / "speed.md"
PYPROJECT = ROOT / "pyproject.toml"
RUN_CONFIGS_PAGE = ROOT / "docs" / "run-configs.md"
WORLD_RECORD = ROOT / "benchmarks" / "world.json"
WORLD_PAGE = ROOT / "docs" / "benchmarks" / "world.md"
DEFAULT_RUN_RECORD = ROOT / "benchmarks" / "default_run.json"
DEFAULT_RUN_PAGE = ROOT / "docs" / "benchmarks" / "default-run.md"
DEFAULT_RUN = "default-run"
# One change to the default each, weighed by the same fresh-FLWR_HOME runs on one machine.
DEFAULT_RUN_LEVERS = ROOT / "benchmarks" / "default_run_levers"
LEVERS = "default-run-levers"
FIRST_RUN = "first-run"
PHASES = ("round", "synthesis", "classifier")
# Every phase the server times (metrics.json), in run order, with what it is.
ALL_PHASES = (
    ("load_model", "loading the LDM on the server, once"),
    ("round", "the one round: the clients' concept steps and uploads, and their LDM loads"),
    ("synthesis", "the synthetic set, UniPC 5 steps"),
    ("classifier", "the ResNet-18's SGD steps and precise BN"),
    ("evaluation", "the test images, the institutions' replies"),
)
RESULTS = "results"
LEVEL = 0.95
REFERENCE = "FedBiP-S"  # the README's paired column: FedBiP as the default federation uploads


# -------------------------------------------------------------------------------- records
def legacy_names(record: Mapping[str, Any]) -> bool:
    """Whether a summary names its rows as records did before one name per variant: it says
    so (``names``), or, where it does not (``benchmark.report`` writes no ``names``), it holds
    a row under a name only the old records used (an old name that is also today's, such as
    "FedBiP-S", cannot tell them apart)."""
    if "names" in record:
        return record["names"] != benchmark.NAMES_VERSION
    today = {v.name for v in benchmark.VARIANTS}
    return any(n in benchmark.LEGACY_NAMES and n not in today for n in record["methods"])


def methods_record(path: Path = METHODS_RECORD) -> dict[str, Any]:
    """``benchmarks/methods.json`` with its rows and differences under today's names
    (:func:`legacy_names`; renamed by :func:`fedbip_tools.benchmark.named`)."""
    record = json.loads(path.read_text())
    legacy = legacy_names(record)
    version = None if legacy else benchmark.NAMES_VERSION
    rows = benchmark.named({"results": record["methods"], "names": version})
    record["methods"] = rows["results"]
    if legacy:
        for d in record["differences"]:
            d["a"], d["b"] = (benchmark.LEGACY_NAMES.get(d[k], d[k]) for k in ("a", "b"))
    return record


def known(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record's rows that are variants of today's benchmark (others stay in the record)."""
    names = {v.name for v in benchmark.VARIANTS}
    return {n: e for n, e in record["methods"].items() if n in names}


def group(entry: Mapping[str, Any]) -> tuple[str, str] | None:
    """(model, machine kind) of a row whose seeds share both; None for a mixed row."""
    models, kinds = entry["made_with"]["models"], list(entry["made_with"]["kinds"])
    return (models[0], kinds[0]) if len(models) == 1 and len(kinds) == 1 else None


def headline(record: Mapping[str, Any]) -> tuple[tuple[str, str], list[str]]:
    """The README's rows: the headline rows at the benchmark's own classifier start, of the
    (model, kind) that most of them share (ties: the first row's)."""
    rows = record["methods"]
    names = [
        n
        for n in benchmark.HEADLINE
        if n in rows and "classifier.init" not in benchmark.variant(n).values
    ]
    groups = [g for n in names if (g := group(rows[n]))]
    if not groups:
        raise ValueError(f"{METHODS_RECORD.name}: no headline row of one model and kind")
    chosen = max(groups, key=groups.count)  # max keeps the first of equal counts
    return chosen, [n for n in names if group(rows[n]) == chosen]


# -------------------------------------------------------------------------- README's table
def interval(entry: Mapping[str, Any]) -> tuple[float, float] | None:
    """The 95% t-interval of the mean accuracy over the row's seeds (the same interval as
    :func:`fedbip_tools.benchmark.t_interval`, from the record's mean and sample std)."""
    n = len(entry["seeds"])
    if n < 2:
        return None
    half = float(stats.t.ppf((1 + LEVEL) / 2, n - 1)) * entry["std"] / math.sqrt(n)
    return entry["mean"] - half, entry["mean"] + half


def accuracy_cell(entry: Mapping[str, Any]) -> str:
    found = interval(entry)
    bounds = f" [{100 * found[0]:.1f}, {100 * found[1]:.1f}]" if found else ""
    return f"{100 * entry['mean']:.1f}{bounds}"


def server_auc(entry: Mapping[str, Any], large: bool) -> Mapping[str, Any] | None:
    """The figures the methods page's server table gives the row: at 4x64x64 its upload kind's
    records; at 4x16x16 its run folders unless the records hold more seeds."""
    if large:
        return entry.get(benchmark.SERVER_ATTACK_LARGE)
    found, stand_in = (
        entry.get(benchmark.SERVER_ATTACK),
        entry.get(benchmark.SERVER_ATTACK_STAND_IN),
    )
    if found and len(found["seeds"]) >= len(stand_in["seeds"] if stand_in else []):
        return found
    return stand_in


def auc_cell(found: Mapping[str, Any] | None) -> str:
    """The range of the per-domain mean AUCs, or one value where they round alike."""
    if not found:
        return "–"
    aucs = [a["auc"] for a in found["per_domain"].values()]
    low, high = f"{min(aucs):.2f}", f"{max(aucs):.2f}"
    return low if low == high else f"{low}-{high}"


def seeds_text(seeds: Sequence[int]) -> str:
    """Seeds as a range where they run on ("0-9"), else listed."""
    ordered = sorted(seeds)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ", ".join(map(str, ordered))


def paired_cell(record: Mapping[str, Any], name: str) -> str:
    """REFERENCE minus the row in points over the seeds both hold, with its 95% interval
    (the record's paired difference, either way round), and how many seeds where fewer than
    the row's; a dash where the record has none."""
    found = [d for d in record["differences"] if {d["a"], d["b"]} == {REFERENCE, name}]
    if name == REFERENCE or not found:
        return "–"
    d = found[0]
    mean = d["mean"] if d["a"] == REFERENCE else -d["mean"]
    low, high = mean - d["half_width"], mean + d["half_width"]
    n = len(d["per_seed"])
    fewer = f" ({n} seeds)" if n < len(record["methods"][name]["seeds"]) else ""
    return f"{100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]{fewer}"


def guarantee_cell(name: str) -> str:
    """The variant's DP guarantee, "none" for an upload the server can test without one."""
    v = benchmark.variant(name)
    own = FedBiPConfig.from_flat(v.values).settings_of(v.method)
    if guarantee := getattr(own, "guarantee", None):
        return str(guarantee)
    return "none" if upload_test(v.method) else "nothing of an image uploaded"


def kind_text(kind: str) -> str:
    return (
        "a machine kind the record leaves unrecorded"
        if kind == "unrecorded"
        else f"the {kind} machine kind"
    )


def results_table(record: Mapping[str, Any]) -> str:
    (model, kind), names = headline(record)
    rows, s = record["methods"], record["sampling"]
    settings = benchmark.Settings.recorded(record["settings"])
    others = [n for n in rows if n not in names]
    lines = [
        "`fedbip benchmark --seeds SEEDS --variants ROW` for each row with its seeds "
        "(record [`benchmarks/methods.json`](benchmarks/methods.json)): "
        f"model `{model}` on {kind_text(kind)}; "
        f"sampler `{s['scheduler']}`, {s['steps']} steps from T = {s['timestep']}; ResNet-18 "
        f"from a {settings.run_config['classifier.init']} start, {settings.classifier_steps} SGD "
        "steps. Accuracy: mean over seeds and domains [its 95% t-interval over the seeds, which can "
        f"pass 100]; {REFERENCE} − row: the paired difference in points over the seeds both rows "
        "hold [its 95% t-interval]; AUC: the range over the domains of the server's strongest "
        "test on the uploads (0.5: chance; –: no latent upload at that size, or no test).",
        "",
        f"| row | seeds | accuracy (%) | {REFERENCE} − row | upload per client (kB) "
        "| server AUC, 4x16x16 | server AUC, 4x64x64 | guarantee |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        e = rows[n]
        cells = [
            n,
            seeds_text(e["seeds"]),
            accuracy_cell(e),
            paired_cell(record, n),
            benchmark.kilobytes(e),
            auc_cell(server_auc(e, large=False)),
            auc_cell(server_auc(e, large=True)),
            guarantee_cell(n),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    variants = known(record)
    shown = [n for n in others if n in variants]
    lines += [
        "",
        f"The record's {len(shown)} other rows of today's variants (other models or kinds, "
        "or beside the headline) are on [the methods page](docs/benchmarks/methods.md); "
        f"{len(others) - len(shown)} rows under older variants stay in the record only.",
    ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------- the other pages
def methods_section(record: Mapping[str, Any]) -> str:
    """The methods benchmark's section, as ``fedbip benchmark`` writes it, over the record's
    rows that are today's variants."""
    settings = benchmark.Settings.recorded(record["settings"])
    bench = benchmark.Bench(
        settings, ROOT / "benchmark-work", ROOT / "benchmarks", threads=record["threads"]
    )
    summary = known(record)
    found = [
        benchmark.Difference(**d)
        for d in record["differences"]
        if d["a"] in summary and d["b"] in summary
    ]
    sampled = benchmark.Sampling(**record["sampling"])
    return benchmark.markdown(summary, bench, record["judges_on_real"], found, sampled)


def speed_command(record: Mapping[str, Any]) -> str:
    """``fedbip speed`` with the options the record's settings set apart from the defaults."""
    defaults = vars(speed.parse([]))
    skip = {"out", "no_write", "markdown", "child", "threads"}
    words = ["fedbip", "speed"]
    for key, value in record["settings"].items():
        if key not in skip and defaults.get(key) != value:
            words += [f"--{key.replace('_', '-')}", str(value)]
    return " ".join(words)


def speed_section(record: Mapping[str, Any]) -> str:
    return speed.markdown(record, speed_command(record))


# ------------------------------------------------------------------------ the default run
def default_run_section(record: Mapping[str, Any]) -> str:
    """The README's first command's runs: accuracy per domain, wall time and phase seconds per
    run, then their summary, with the record's provenance."""
    made, runs = record["provenance"], record["runs"]
    domains = sorted(runs[0]["per_domain"])
    head = ["run", *domains, "mean", "wall s", *PHASES, "load before"]
    lines = [
        f"`{record['command']}` (record [`benchmarks/default_run.json`]"
        f"(../../benchmarks/default_run.json)): model `{made['model']}`, commit "
        f"`{made['commit'][:7]}`, {kind_text(made['machine']['kind'])}, {made['date'][:10]}. "
        "Each run is the README's first command from a fresh `FLWR_HOME`, its wall time taken "
        "from outside, its phases (seconds) from the run's `metrics.json`.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---:|" * len(head),
    ]
    for i, run in enumerate(runs, 1):
        cells = [
            str(i),
            *(f"{100 * run['per_domain'][d]:.1f}" for d in domains),
            f"{100 * run['mean']:.1f}",
            f"{run['wall_seconds']:.0f}",
            *(f"{run['seconds'][p]:.0f}" for p in PHASES),
            f"{run['load_before']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    total = record["summary"]
    lines += [
        "",
        f"Mean {100 * total['mean']:.1f}% (sample std {100 * total['std']:.1f} points), "
        f"lowest {100 * total['min']:.1f}%; wall {total['wall_min']:.0f} / "
        f"{total['wall_median']:.0f} / {total['wall_max']:.0f} s (min / median / max), the "
        f"classifier's median {total['classifier_median']:.0f} s.",
        "",
        *phase_medians(runs),
    ]
    return "\n".join(lines)


def outside_phases(runs: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each run's wall time less the server's phases: Flower, Ray and the apps starting."""
    return [r["wall_seconds"] - sum(r["seconds"].values()) for r in runs]


def phase_medians(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Where the runs' time goes: each phase's median over the runs, and the rest of the wall
    time (Flower, Ray and the apps starting) as one more line."""
    rows = [
        ("outside the phases", outside_phases(runs), "Flower, Ray and the apps starting, the rest")
    ]
    rows += [(name, [r["seconds"][name] for r in runs], what) for name, what in ALL_PHASES]
    rows.append(("**wall**", [r["wall_seconds"] for r in runs], "the command, timed from outside"))
    lines = ["| phase | median s | what it is |", "|---|---:|---|"]
    lines += [f"| {name} | {statistics.median(v):.1f} | {what} |" for name, v, what in rows]
    return [*lines, ""]


SEED = re.compile(r"\bseed=(\d+)")
REPLAY = re.compile(rf"{SEED.pattern}|\bfederation\.replayable-client-noise=true")


def seeds_of(record: Mapping[str, Any]) -> list[int]:
    """The seeds a record's runs replayed (``default_runs.py --seeds``), in run order; none for
    runs that drew their clients' noise from the OS."""
    found = [SEED.search(r["run_config"]) for r in record["runs"]]
    return [int(m.group(1)) for m in found if m]


def change_of(record: Mapping[str, Any]) -> str:
    """What a record changed against the README's command of its day: its run config without
    the seed replay, and its additions to that command's ``--federation-config``."""
    config = " ".join(REPLAY.sub("", record["runs"][0]["run_config"]).split())
    readme = record["readme_command"].partition("--federation-config ")[2]
    federation = record.get("federation_config", "").removeprefix(readme).strip()
    return " ".join(part for part in (config, federation) if part)


def levers_section(records: Mapping[str, Any]) -> str:
    """The default's runs beside each lever's (one change each, made on the same machine):
    accuracy, the phase medians and the wall time, with each record's change and commit; then,
    for records that replayed the same seeds, each change minus the unchanged command, paired."""
    head = ["record", "change", "commit", "kind", "runs", "mean (lowest)", *PHASES, "outside"]
    head.append("wall")
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|---|" + "---:|" * (len(head) - 4)]
    for name, record in records.items():
        runs, made, seeds = record["runs"], record["provenance"], seeds_of(record)
        change = change_of(record)
        cells = [
            f"`{name}`",
            f"`{change}`" if change else "the default",
            f"`{made['commit'][:7]}`",
            machine_cell(made["machine"]),
            f"{len(runs)} (seeds {', '.join(map(str, seeds))})" if seeds else str(len(runs)),
            f"{100 * statistics.fmean(r['mean'] for r in runs):.1f} "
            f"({100 * min(r['mean'] for r in runs):.1f})",
            *(f"{statistics.median(r['seconds'][p] for r in runs):.1f}" for p in PHASES),
            f"{statistics.median(outside_phases(runs)):.1f}",
            f"{statistics.median(r['wall_seconds'] for r in runs):.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", "Medians in seconds.", "", *paired_levers(records)])


def machine_cell(machine: Mapping[str, Any]) -> str:
    """A record's machine kind, and the kernel caps that made it so where it ran under any."""
    caps = ", ".join(f"`{k}={v}`" for k, v in sorted(machine.get("switches", {}).items()))
    return f"{machine['kind']} ({caps} on {machine['cpu']})" if caps else machine["kind"]


def paired_levers(records: Mapping[str, Any]) -> list[str]:
    """Each seeded change minus the unchanged command on the same seeds and machine kind: the
    mean accuracy and the wall time, 95% t-intervals over the seeds."""
    seeded = {name: r for name, r in records.items() if seeds_of(r)}
    bases = [(n, r) for n, r in seeded.items() if not change_of(r)]
    lines = []
    for name, record in seeded.items():
        for base_name, base in bases:
            if name == base_name or not same_runs(record, base):
                continue
            accuracy = [100 * (a["mean"] - b["mean"]) for a, b in zip(record["runs"], base["runs"])]
            wall = [
                a["wall_seconds"] - b["wall_seconds"] for a, b in zip(record["runs"], base["runs"])
            ]
            (da, ha), (dw, hw) = benchmark.t_interval(accuracy), benchmark.t_interval(wall)
            lines.append(
                f"- Paired on seeds {', '.join(map(str, seeds_of(record)))}, `{name}` minus "
                f"`{base_name}`: accuracy {da:+.1f} [{da - ha:+.1f}, {da + ha:+.1f}] points, "
                f"wall {dw:+.1f} [{dw - hw:+.1f}, {dw + hw:+.1f}] s (95% t)."
            )
    return [*lines, ""] if lines else []


def same_runs(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two records replayed the same seeds in the same order on one machine kind."""
    kind = [r["provenance"]["machine"]["kind"] for r in (a, b)]
    return seeds_of(a) == seeds_of(b) and len(seeds_of(a)) > 1 and kind[0] == kind[1]


def first_run_line(record: Mapping[str, Any]) -> str:
    """The README's line beside its first command: what five runs of it scored and took."""
    total, kind = record["summary"], record["provenance"]["machine"]["kind"]
    return (
        f"Five runs of the first command scored {100 * total['mean']:.1f}% mean accuracy "
        f"(lowest {100 * total['min']:.1f}%) in {total['wall_median']:.0f} s (median wall time) "
        f"on {kind_text(kind)} ([docs/benchmarks/default-run.md]"
        "(docs/benchmarks/default-run.md), record `benchmarks/default_run.json`).\n"
    )


# ---------------------------------------------------------------------------------- writing
SECTIONS: Sequence[tuple[Path, str, Path, Callable[[dict[str, Any]], str]]] = (
    (README, RESULTS, METHODS_RECORD, results_table),
    (METHODS_PAGE, benchmark.MARKER, METHODS_RECORD, methods_section),
    (SPEED_PAGE, speed.MARKER, SPEED_RECORD, speed_section),
    (RUN_CONFIGS_PAGE, config_doc.MARKER, PYPROJECT, config_doc.reference),
    (WORLD_PAGE, world.MARKER, WORLD_RECORD, world.markdown),
    (DEFAULT_RUN_PAGE, DEFAULT_RUN, DEFAULT_RUN_RECORD, default_run_section),
    (README, FIRST_RUN, DEFAULT_RUN_RECORD, first_run_line),
    (DEFAULT_RUN_PAGE, LEVERS, DEFAULT_RUN_LEVERS, levers_section),
)


def read(source: Path) -> dict[str, Any]:
    """A section's source: the methods record under today's names, pyproject.toml's run
    config, or a JSON record."""
    if source == METHODS_RECORD:
        return methods_record(source)
    if source == PYPROJECT:
        return config_doc.project_config(source)
    if source == DEFAULT_RUN_LEVERS:  # the default's record, then each lever's
        paths = [DEFAULT_RUN_RECORD, *sorted(source.glob("*.json"))]
        return {str(p.relative_to(ROOT / "benchmarks")): json.loads(p.read_text()) for p in paths}
    return json.loads(source.read_text())


def section(path: Path, marker: str) -> str | None:
    """The text between a file's markers, or None where it has none."""
    body = path.read_text()
    start, end = f"<!-- {marker}:start -->\n", f"<!-- {marker}:end -->"
    if start not in body:
        return None
    return body[body.index(start) + len(start) : body.index(end)]


def generated() -> list[tuple[Path, str, str]]:
    """(file, marker, text) of every generated section, made from today's records."""
    sources: dict[Path, dict[str, Any]] = {}
    out = []
    for path, marker, source, make in SECTIONS:
        if source not in sources:
            sources[source] = read(source)
        out.append((path, marker, make(sources[source])))
    return out


def stale() -> list[str]:
    """The sections whose text differs from what their records make."""
    return [
        f"{path.relative_to(ROOT)}: {marker}"
        for path, marker, text in generated()
        if section(path, marker) != text
    ]


def write() -> None:
    for path, marker, text in generated():
        benchmark.write_section(path, text, marker)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedbip_tools.doc_tables", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.check:
        found = stale()
        for line in found:
            print(f"stale: {line}", file=sys.stderr)
        return 1 if found else 0
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

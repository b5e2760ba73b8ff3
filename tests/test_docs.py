"""The docs' promises: the README starts with two commands (CI runs the second), every config
key the docs tell users to set exists, and the run config's reference is what the code says."""

from __future__ import annotations

import re

from tests.helpers import ROOT


def readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "the README starts with no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_starts_with_two_commands_and_ci_runs_the_second():
    run, test = readme_commands()
    assert "flwr run ." in run
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == test, f".ci/run ends with {ci[-1]!r}, the README's test command is {test!r}"


# Flower's own --federation-config keys that the docs use; "key" is the docs' placeholder.
FEDERATION_KEYS = {
    "num-supernodes",
    "client-resources-num-cpus",
    "client-resources-num-gpus",
    "init-args-num-cpus",
}
PLACEHOLDERS = {"key"}


def documented_keys(text: str) -> set[str]:
    """Config keys a text sets: kebab-case `name=` anywhere (command lines, node configs in
    comments) and `name = value` in inline code (TOML lines in prose)."""
    kebab = re.finditer(r"(?<![\w$.-])([a-z][a-z0-9]*(?:[.-][a-z0-9]+)+)=", text)
    toml = re.finditer(r"`([a-z][a-z0-9_.-]*) ?= ?[^`]+`", text)
    return {m.group(1) for m in (*kebab, *toml)}


def test_every_config_key_the_docs_set_is_one_the_config_accepts():
    """A key the docs tell users to set must exist: a renamed one fails their run at once
    (node configs reject unknown keys; `data-dir` for `data-root` once stood in deploy/)."""
    from fedbip_flwr.config import FedBiPConfig, NodeConfig

    known = set(FedBiPConfig().to_flat()) | NodeConfig.keys()
    known |= FEDERATION_KEYS | PLACEHOLDERS
    texts = [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "deploy").glob("*.sh"),
        ROOT / "docker" / "compose.yaml",
    ]
    unknown = {
        f"{path.relative_to(ROOT)}: {key}"
        for path in texts
        for key in documented_keys(path.read_text()) - known
    }
    assert not unknown, f"docs set keys the config does not know: {sorted(unknown)}"


def test_the_run_config_reference_names_every_key_the_config_accepts():
    """docs/run-configs.md's key tables, generated from the models (their staleness fails
    test_every_generated_table_is_what_its_record_makes), hold a row for every run-config key:
    a table or key left out of the generator would leave it undocumented."""
    from fedbip_flwr.config import FedBiPConfig
    from fedbip_tools import config_doc, doc_tables

    text = doc_tables.section(doc_tables.RUN_CONFIGS_PAGE, config_doc.MARKER)
    assert text, "docs/run-configs.md has no generated key tables"
    table, rows = "", set()
    for line in text.splitlines():
        if heading := re.match(r"### `(.+)`", line):
            table = heading.group(1)
        elif key := re.match(r"\| `([a-z0-9-]+)` \|", line):
            rows.add(f"{table}.{key.group(1)}" if table else key.group(1))
    assert rows == set(FedBiPConfig().to_flat()), rows ^ set(FedBiPConfig().to_flat())


# ------------------------------------------------------------------ docs against the records
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
LIMITS = {"README.md": 150, "BENCHMARKS.md": 150}
PAGE_LIMIT = 400  # every page under docs/: docs/*.md and docs/benchmarks/*.md


def test_every_generated_table_is_what_its_record_makes():
    """A remade record leaves no stale table: `python -m fedbip_tools.doc_tables` rewrites them."""
    from fedbip_tools import doc_tables

    stale = doc_tables.stale()
    assert not stale, f"run `python -m fedbip_tools.doc_tables`: {stale}"


def test_a_record_in_todays_names_regenerates_as_it_reads(tmp_path):
    """The record the next benchmark writes (today's names, no `names` key, today's settings)
    makes both generated sections, its rows read under their own names."""
    import dataclasses
    import json

    from fedbip_tools import benchmark, doc_tables

    record = doc_tables.methods_record()
    record.pop("names", None)
    record["settings"] = json.loads(json.dumps(dataclasses.asdict(benchmark.Settings())))
    record["methods"] = doc_tables.known(record)
    path = tmp_path / "methods.json"
    path.write_text(json.dumps(record))
    again = doc_tables.methods_record(path)
    assert set(again["methods"]) == set(record["methods"])
    assert "| FedBiP-S |" in doc_tables.results_table(again)
    assert doc_tables.methods_section(again)


def readme_results() -> dict[str, list[str]]:
    """The README's results table: row name -> its cells."""
    from fedbip_tools import doc_tables

    text = doc_tables.section(ROOT / "README.md", doc_tables.RESULTS)
    assert text, "README.md has no results section"
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def t_half_width(std: float, n: int) -> float:
    """Half the 95% t-interval of a mean of n values of sample std ``std``."""
    import math

    from scipy import stats

    return float(stats.t.ppf(0.975, n - 1)) * std / math.sqrt(n)


def assert_paired(cell: str, record: dict, name: str) -> None:
    """The README's FedBiP-S − row cell against the record's per-seed differences."""
    import statistics

    found = [d for d in record["differences"] if {d["a"], d["b"]} == {"FedBiP-S", name}]
    if name == "FedBiP-S" or not found:
        assert cell == "–", name
        return
    sign = 1 if found[0]["a"] == "FedBiP-S" else -1
    per_seed = [sign * v for v in found[0]["per_seed"].values()]
    mean, n = statistics.fmean(per_seed), len(per_seed)
    half = t_half_width(statistics.stdev(per_seed), n)
    figures = [float(x) for x in re.findall(r"[-+]?[\d.]+(?= |\]|,)", cell.split(" (")[0])]
    expected = [round(100 * x, 1) for x in (mean, mean - half, mean + half)]
    assert figures == expected, (name, cell, expected)
    fewer = re.search(r"\((\d+) seeds\)", cell)
    assert (int(fewer.group(1)) if fewer else len(record["methods"][name]["seeds"])) == n, name


def test_every_figure_in_the_readmes_table_equals_its_record():
    """Read against benchmarks/methods.json itself, not through the generator."""
    import json

    from fedbip_tools import benchmark as b
    from fedbip_tools.doc_tables import legacy_names

    record = json.loads((ROOT / "benchmarks" / "methods.json").read_text())
    legacy = legacy_names(record)
    rows = {b.LEGACY_NAMES.get(k, k) if legacy else k: v for k, v in record["methods"].items()}

    def auc_range(found) -> set[float]:
        aucs = [a["auc"] for a in found["per_domain"].values()]
        return {round(min(aucs), 2), round(max(aucs), 2)}

    table = readme_results()
    assert 1 <= len(table) <= 12, f"the README's table has {len(table)} rows"
    kinds = set()
    for name, (seeds, accuracy, paired, kb, small, large, _guarantee) in table.items():
        e = rows[name]
        kinds |= set(e["made_with"]["kinds"])
        low, _, high = seeds.partition("-")
        listed = range(int(low), int(high) + 1) if high else map(int, seeds.split(", "))
        assert list(listed) == sorted(e["seeds"]), name
        assert_paired(paired, record, name)
        mean, *bounds = re.findall(r"-?[\d.]+", accuracy)
        assert float(mean) == round(100 * e["mean"], 1), name
        n = len(e["seeds"])
        expected = []
        if n > 1:  # one seed has no interval
            half = t_half_width(e["std"], n)
            expected = [round(100 * (e["mean"] - half), 1), round(100 * (e["mean"] + half), 1)]
        assert [float(b) for b in bounds] == expected, name
        sizes = list((e.get("upload_bytes") or {}).values())
        if kb == "–":
            assert not sizes, name
        else:
            assert float(kb.replace(",", "")) == round(sum(sizes) / len(sizes) / 1e3, 1), name
        # 4x16x16: the run folders' test unless the upload kind's records hold more seeds
        found, stand_in = e.get(b.SERVER_ATTACK), e.get(b.SERVER_ATTACK_STAND_IN)
        seeds = len(stand_in["seeds"]) if stand_in else 0
        small_found = found if found and len(found["seeds"]) >= seeds else stand_in
        for cell, source in ((small, small_found), (large, e.get(b.SERVER_ATTACK_LARGE))):
            if cell == "–":
                assert source is None, name
            else:
                assert {float(x) for x in cell.split("-")} == auc_range(source), name
    assert len(kinds) == 1, f"the README's table mixes machine kinds: {kinds}"


def headings(path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings (code blocks skipped)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    out = set()
    for title in re.findall(r"^#+ +(.+?) *$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower().replace("`", "")).replace(" ", "-")
        out.add(slug)
    return out


def test_every_relative_link_in_the_docs_resolves():
    """A file for every relative link in README.md, BENCHMARKS.md and docs/, and a heading
    for every anchor into a Markdown file."""
    broken = []
    for page in DOCS:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            found = (page.parent / path).resolve() if path else page
            if not found.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and found.suffix == ".md" and anchor not in headings(found):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, f"links that lead nowhere: {broken}"


def test_the_readme_and_the_benchmark_index_stay_short_and_every_topic_page_too():
    """README.md and BENCHMARKS.md at most 150 lines, every page under docs/ at most 400: a
    longer one is split by topic."""
    too_long = {
        str(path.relative_to(ROOT)): lines
        for path in DOCS
        if (lines := len(path.read_text().splitlines()))
        > LIMITS.get(path.name if path.parent == ROOT else "", PAGE_LIMIT)
    }
    assert any(path.parent.name == "docs" for path in DOCS), "no page under docs/ is checked"
    assert not too_long, f"over their limit (README and BENCHMARKS.md 150, pages 400): {too_long}"


def test_a_lever_is_compared_paired_only_against_the_unchanged_command_on_its_seeds():
    """The levers table's paired line: a change minus the unchanged command over the seeds both
    replayed, accuracy in points and wall seconds, 95% t; a record on other seeds gets none."""
    from fedbip_tools import doc_tables

    def record(change: str, seeds: list[int], means: list[float], walls: list[float]) -> dict:
        runs = [
            {"run_config": f"seed={s} federation.replayable-client-noise=true {change}".strip()}
            | {"mean": m, "wall_seconds": w}
            for s, m, w in zip(seeds, means, walls)
        ]
        machine = {"kind": "AVX2", "cpu": "x"}
        return {
            "readme_command": 'flwr run . --federation-config "num-supernodes=3"',
            "runs": runs,
            "provenance": {"machine": machine},
        }

    base = record("", [0, 1, 2], [0.90, 0.92, 0.94], [80.0, 82.0, 84.0])
    lever = record("classifier.epochs=4", [0, 1, 2], [0.91, 0.93, 0.95], [70.0, 71.0, 72.0])
    other = record("classifier.epochs=2", [3, 4, 5], [0.5, 0.5, 0.5], [1.0, 1.0, 1.0])
    assert doc_tables.change_of(lever) == "classifier.epochs=4"
    assert doc_tables.seeds_of(lever) == [0, 1, 2]
    lines = doc_tables.paired_levers({"base": base, "lever": lever, "other": other})
    # differences +1, +1, +1 points (no spread) and -10, -11, -12 s (half-width 4.303 * 1 / 3**0.5)
    assert lines == [
        "- Paired on seeds 0, 1, 2, `lever` minus `base`: accuracy +1.0 [+1.0, +1.0] points, "
        "wall -11.0 [-13.5, -8.5] s (95% t).",
        "",
    ]

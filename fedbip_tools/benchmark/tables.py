"""The methods page's Markdown tables and their cells, each made from the summary (accuracy,
paired differences, fidelity, privacy, the server's tests, the conditioning tests), and the lines
``fedbip benchmark`` prints."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from fedbip_flwr.paths import project_dir

from .. import provenance
from ..upload_attacks import upload_test
from .attack_records import (
    CONDITIONING_LARGE_MODEL,
    CONDITIONING_TESTS,
    LARGE_SIZE,
    RECORD_ONLY_TESTS,
    SERVER_ATTACK_LARGE,
    SERVER_ATTACK_STAND_IN,
    conditioning_attacks,
)
from .measurements import JUDGES, SERVER_ATTACK
from .settings import Bench, Sampling
from .summary import Difference
from .variants import NO_DATA_CONTROL, variant

NOT_DISTINGUISHABLE = "not distinguishable at this budget"


def pct(mean: float, std: float | None = None) -> str:
    return f"{100 * mean:.1f}" + (f" ± {100 * std:.1f}" if std is not None else "")


def kilobytes(entry: Mapping[str, Any]) -> str:
    sizes = list((entry.get("upload_bytes") or {}).values())
    return f"{statistics.fmean(sizes) / 1e3:,.1f}" if sizes else "–"


def seconds(values: Mapping[str, Any] | None) -> str:
    numbers = [v for v in (values or {}).values() if v is not None]
    return f"{statistics.fmean(numbers):.0f}" if numbers else "–"


def accuracy_heading(s: Sampling) -> str:
    return (
        f"### Accuracy (%): sampler `{s.scheduler}` ({s.spacing} spacing), {s.steps} steps, "
        f"T = {s.timestep}\n"
    )


def accuracy_table(summary: Mapping[str, Any], names: Sequence[str]) -> str:
    """Accuracy, bytes and seconds per row, with what its seeds were made with."""
    domains = list(next(iter(summary.values()))["per_domain"])
    lines = [
        "| method | "
        + " | ".join(domains)
        + " | mean | domain fidelity (%), "
        + " / ".join(domains)
        + " | upload per client (kB) | client s | server s | load | seeds | made with |",
        "|---|" + "---|" * (len(domains) + 8),
    ]
    for name in (n for n in names if n in summary):
        e = summary[name]
        cells = [pct(e["per_domain"][d], e["per_domain_std"][d]) for d in domains]
        judged = domain_fidelity_cell(e.get("fidelity"), domains)
        server = sum(v for v in (e.get("server_seconds") or {}).values() if v is not None)
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | **{pct(e['mean'], e['std'])}** | {judged} | {kilobytes(e)} "
            f"| {seconds(e.get('client_seconds'))} | {server:.0f} | {e.get('load_average', float('nan')):.1f} "
            f"| {len(e['seeds'])} | {provenance.cell(e['made_with'])} |"
        )
    return "\n".join(lines) + "\n"


def domain_fidelity_cell(
    fidelity: Mapping[str, Mapping[str, float]] | None, domains: Sequence[str]
) -> str:
    """The share of each domain's synthetic images the judges place in it, beside accuracy:
    a row can score well with images that are not in its clients' domains."""
    if not fidelity or any(d not in fidelity for d in domains):
        return "–"
    return " / ".join(f"{100 * fidelity[d]['domain']:.0f}" for d in domains)


def signed(points: float) -> str:
    return f"{points:+.1f}"


def differences_table(found: Sequence[Difference]) -> str:
    """One line per comparison: per-seed differences, their mean and 95% interval (points)."""
    lines = ["| A − B | seeds | per seed | mean | 95% interval | |", "|---|---|---|---|---|---|"]
    for d in found:
        per_seed = ", ".join(f"{s}: {signed(100 * v)}" for s, v in d.per_seed.items())
        interval = "–"
        if d.half_width is not None:
            low, high = 100 * (d.mean - d.half_width), 100 * (d.mean + d.half_width)
            interval = f"[{signed(low)}, {signed(high)}]"
        higher = d.a if d.mean > 0 else d.b
        verdict = f"{higher} higher" if d.distinguishable else NOT_DISTINGUISHABLE
        cells = [f"{d.a} − {d.b}", str(len(d.per_seed)), per_seed, signed(100 * d.mean), interval]
        lines.append("| " + " | ".join([*cells, verdict]) + " |")
    return "\n".join(lines) + "\n"


def console_lines(summary: Mapping[str, Any]) -> list[str]:
    """The summary as the command prints it: accuracy and, per row, what made its seeds."""
    return [
        f"{name:32s} {100 * e['mean']:5.1f} ± {100 * e['std']:4.1f}  ({len(e['seeds'])} seeds)  "
        f"{provenance.full_text(e['made_with'])}"
        for name, e in summary.items()
    ]


def judges_cell(judged: Mapping[str, Mapping[str, float] | None]) -> str:
    """The judges' accuracy on real images (class / domain, %) per seed of a row, seeds that
    share judges together; a dash for seeds judged before rows recorded it."""
    groups: dict[str, list[str]] = {}
    for seed, on_real in judged.items():
        text = f"{100 * on_real['class']:.1f} / {100 * on_real['domain']:.1f}" if on_real else "–"
        groups.setdefault(text, []).append(seed)
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(
        f"{text} (seed{'s' * (len(seeds) > 1)} {', '.join(seeds)})"
        for text, seeds in groups.items()
    )


def fidelity_table(summary: Mapping[str, Any]) -> str:
    names = [n for n, e in summary.items() if e.get("fidelity")]
    if not names:
        return ""
    domains = list(summary[names[0]]["fidelity"])
    lines = [
        "| method | " + " | ".join(domains) + " | images | judges on real images (%) |",
        "|---|" + "---|" * (len(domains) + 2),
    ]
    for name in names:
        e = summary[name]
        fid = e["fidelity"]
        cells = (f"{100 * fid[d]['class']:.0f} / {100 * fid[d]['domain']:.0f}" for d in domains)
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {e['num_images']:.0f} | "
            f"{judges_cell(e.get(JUDGES, {}))} |"
        )
    return "\n".join(lines) + "\n"


def privacy_table(summary: Mapping[str, Any]) -> str:
    lines = [
        "| method | MIA loss gap | MIA entropy gap | MIA AUC, pooled | TPR at 1% FPR | nearest real (RMS) | "
        "DCR AUC, pixels | DCR AUC, features | members nearer than every non-member (pixels) | "
        "DOMIAS AUC, features | "
        "reconstruction PSNR (dB), own / same-class | SSIM, own / same-class | "
        "mean of an image's reconstructions, PSNR (dB) own / same-class |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in summary.items():
        if not e.get("mia_gap"):
            continue
        gap = e["mia_gap"]
        std = e["mia_gap_std"]
        near = e.get("nearest_real")
        near = f"{statistics.fmean(near.values()):.3f}" if near else "–"
        cells = dcr_cells(e, summary.get(NO_DATA_CONTROL))
        lines.append(
            f"| {name} | {gap['loss']:+.3f} ± {std['loss']:.3f} | "
            f"{gap['entropy']:+.3f} ± {std['entropy']:.3f} | {' | '.join(attack_cells(e))} | {near} | "
            f"{' | '.join(cells)} | {' | '.join(reconstruction_cells(e.get('reconstruction')))} |"
        )
    return "\n".join(lines) + "\n"


def server_attack_cells(found: Mapping[str, Any] | None, domains: Sequence[str]) -> list[str]:
    """AUC (± its std over seeds, where more than one) / TPR at 1% FPR per domain; a dash where
    not measured."""
    if not found:
        return ["–"] * len(domains)
    spread = len(found["seeds"]) > 1
    return [
        f"{a['auc']:.3f}"
        + (f" ± {a['auc_std']:.3f}" if spread else "")
        + f" / {a['tpr_at_low_fpr']:.2f}"
        if (a := found["per_domain"].get(d))
        else "–"
        for d in domains
    ]


def server_attack_table(summary: Mapping[str, Any], domains: Sequence[str]) -> str:
    """One line per row whose upload the server can test: at the run's latents from its run
    folders (else from its upload kind's records), and at SD's latent size from its upload
    kind's records; then the rows without."""
    lines = [
        "| method | the server's test | "
        + " | ".join(f"{d}, 4x16x16" for d in domains)
        + " | 4x16x16: seeds (of the row's) | "
        + " | ".join(f"{d}, 4x64x64" for d in domains)
        + " | 4x64x64: records' seeds |",
        "|---" * (2 * len(domains) + 4) + "|",
    ]
    untestable = []
    for name, e in summary.items():
        method = variant(name).method
        test = upload_test(method)
        statistic = test.statistic if test else RECORD_ONLY_TESTS.get(method)
        if statistic is None:
            untestable.append(name)
            continue
        found, large = e.get(SERVER_ATTACK), e.get(SERVER_ATTACK_LARGE)
        stand_in = e.get(SERVER_ATTACK_STAND_IN)
        if found and len(found["seeds"]) >= len(stand_in["seeds"] if stand_in else []):
            seeds = f"run folders {', '.join(map(str, found['seeds']))} ({len(e['seeds'])})"
        elif found := stand_in:
            seeds = f"records {', '.join(map(str, found['seeds']))}"
        else:
            seeds = f"none ({len(e['seeds'])})"
        large_seeds = ", ".join(map(str, large["seeds"])) if large else "–"
        cells = [
            *server_attack_cells(found, domains),
            seeds,
            *server_attack_cells(large, domains),
            large_seeds,
        ]
        lines.append(f"| {name} | {statistic} | {' | '.join(cells)} |")
    lines.append("")
    if untestable:
        lines.append(f"No test (class counts only): {', '.join(untestable)}.")
    return "\n".join(lines) + "\n"


def dcr_cells(entry: Mapping[str, Any], control: Mapping[str, Any] | None) -> list[str]:
    """DCR membership AUC in pixels and features, the members' share nearer than every
    non-member, and DOMIAS's AUC, means over clients; each AUC with its difference from the no-data control's on
    the same seeds, since the member and non-member images alone set where an AUC sits."""

    def mean(e: Mapping[str, Any] | None, key: str) -> float | None:
        dcr = (e or {}).get("dcr")
        return (
            statistics.fmean(d[key] for d in dcr.values())
            if dcr and all(key in d for d in dcr.values())
            else None
        )

    cells = []
    for key in ("pixel_auc", "feature_auc", "pixel_share", "domias_auc"):
        value = mean(entry, key)
        base = (
            mean(control, key)
            if control and control["seeds"] == entry["seeds"] and key != "pixel_share"
            else None
        )
        cells.append(
            "–"
            if value is None
            else f"{value:.3f}" + (f" ({value - base:+.3f})" if base is not None else "")
        )
    return cells


def attack_cells(entry: Mapping[str, Any]) -> list[str]:
    """The pooled loss attack's AUC (mean ± std over seeds) and TPR at its low FPR; dashes
    unless every seed of the row measured it."""
    mia = entry.get("mia")
    if mia is None or "mia_auc_std" not in entry:
        return ["–", "–"]
    return [f"{mia['auc']:.3f} ± {entry['mia_auc_std']:.3f}", f"{mia['tpr_at_low_fpr']:.3f}"]


def reconstruction_cells(per_domain: Mapping[str, Mapping[str, float]] | None) -> list[str]:
    """PSNR and SSIM of the server's reconstructions against the images and against the
    same-class baseline, means over clients, one image and then the mean of all of an image's
    (with how many); dashes where the server holds no per-image latent or a row predates the
    averaged column."""
    if not per_domain:
        return ["–", "–", "–"]
    mean = {
        k: statistics.fmean(d[k] for d in per_domain.values())
        for k in next(iter(per_domain.values()))
    }
    cells = [
        f"{mean['psnr']:.2f} / {mean['baseline_psnr']:.2f}",
        f"{mean['ssim']:.3f} / {mean['baseline_ssim']:.3f}",
    ]
    if "images_averaged" not in mean:
        return [*cells, "–"]
    return [
        *cells,
        f"{mean['averaged_psnr']:.2f} / {mean['averaged_baseline_psnr']:.2f} "
        f"(mean of {mean['images_averaged']:.0f})",
    ]


def conditioning_table(bench: Bench, domains: Sequence[str]) -> str:
    """One line per conditioning kind, budget and latent size the records hold, with the
    models (digests) and machine kinds its seeds ran on."""
    large_model = provenance.model_digest(project_dir() / CONDITIONING_LARGE_MODEL)
    found = conditioning_attacks(bench, large_model)
    lines = [
        "| upload | budget | latents | " + " | ".join(domains) + " | models | machine kinds |",
        "|---" * (len(domains) + 5) + "|",
    ]
    tests = list(CONDITIONING_TESTS)
    for (test, shots, epochs, px, epsilon), cells in sorted(
        found.items(), key=lambda item: (tests.index(item[0].test), item[0].epochs, item[0].px)
    ):
        latents = "4x16x16" if px < LARGE_SIZE else f"4x64x64, UNet continued at {LARGE_SIZE} px"
        texts = [cells[d].text() if d in cells else "–" for d in domains]
        kinds = ", ".join(sorted(set().union(*(c.kinds for c in cells.values()))))
        models = ", ".join(sorted(set().union(*(c.models for c in cells.values()))))
        dp = f", DP-SGD, upload epsilon {epsilon:g}" if epsilon is not None else ""
        budget = f"{shots} shots, {epochs} epochs{dp}"
        lines.append(
            f"| {CONDITIONING_TESTS[test]} | {budget} | {latents} | {' | '.join(texts)} | {models} | {kinds} |"
        )
    return "\n".join(lines) + "\n"

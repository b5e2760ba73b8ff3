"""``report.md``: what a person reads after a run, on GitHub or in a terminal, PNGs beside it.

Built from ``metrics.json`` and the PNGs in the run folder only, so ``fedbip report RUN_DIR``
rebuilds it at any time, for a failed run too, and a run from before a key existed still gets a
report (every optional key is shown when present and left out when absent). Curves are drawn
with matplotlib's Agg canvas through :class:`~matplotlib.figure.Figure`, never ``pyplot``, so
plotting touches no global backend state of the process that calls it (the ServerApp).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path
from typing import Any
from urllib.parse import quote

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .storage import atomic_write

REPORT_FILE = "report.md"
CLASSIFIER_PNG = "classifier-curves.png"
# The server's phases in the order they run (metrics.json stores keys sorted); others follow.
PHASE_ORDER = ("load-model", "round", "synthesis", "classifier", "evaluation")


def write_report(run_dir: Path) -> Path:
    """Write ``run_dir/report.md`` (and its curve PNGs) from ``run_dir/metrics.json``.

    Raises ``OSError`` when metrics.json cannot be read and ``ValueError`` when it is not a
    JSON object: a report without the run's numbers would mislead.
    """
    run_dir = Path(run_dir)
    metrics = _read_metrics(run_dir / "metrics.json")
    lines = [f"# FedBiP run `{run_dir.resolve().name}`", "", *_status(metrics)]
    for section in (
        _accuracy_per_domain(metrics),
        _accuracy_per_institution(metrics),
        _clients(metrics),
        _phases(metrics),
        _grids(run_dir, metrics),
        _concept_curves(run_dir, metrics),
        _classifier_curves(run_dir, metrics),
    ):
        if section:
            lines += ["", *section]
    return atomic_write(run_dir / REPORT_FILE, ("\n".join(lines) + "\n").encode())


def _read_metrics(path: Path) -> dict[str, Any]:
    metrics = json.loads(path.read_text())
    if not isinstance(metrics, dict):
        raise ValueError(f"{path} holds a JSON {type(metrics).__name__}, not an object")
    return metrics


# --- sections: each returns its Markdown lines, or [] when metrics.json has nothing for it ---


def _status(metrics: dict[str, Any]) -> list[str]:
    status = str(metrics.get("status", "unknown"))
    line = f"**Status: {status}.**"
    if metrics.get("reason"):
        line += f" {_text(metrics['reason'])}"
    accuracy = metrics.get("accuracy") or {}
    if "mean" in accuracy:
        per_domain = accuracy.get("per_domain", {})
        line += f" Mean accuracy {_percent(accuracy['mean'])} over {len(per_domain)} domain(s)"
        if "num_synthetic_images" in accuracy:
            line += f", classifier trained on {accuracy['num_synthetic_images']} synthetic images"
        line += "."
    return [line, "", "Raw numbers and the full run configuration: [metrics.json](metrics.json)."]


def _accuracy_per_domain(metrics: dict[str, Any]) -> list[str]:
    accuracy = metrics.get("accuracy") or {}
    per_domain = accuracy.get("per_domain") or {}
    if not per_domain:
        return []
    rows = [[domain, _percent(value)] for domain, value in sorted(per_domain.items())]
    rows.append(["**mean**", f"**{_percent(accuracy.get('mean'))}**"])
    intro = "The classifier, trained on synthetic images only, on each domain's real test images."
    return ["## Accuracy per domain", "", intro, "", *_table(["domain", "accuracy"], rows, "lr")]


def _accuracy_per_institution(metrics: dict[str, Any]) -> list[str]:
    evaluation = metrics.get("evaluation") or {}
    per_client = evaluation.get("per_client") or {}
    if not per_client:
        return []
    rows = [
        [
            client,
            _percent(result.get("accuracy")),
            str(result.get("num_examples", "")),
            str(result.get("status", "")),
            _text(result.get("reason", "")),
        ]
        for client, result in sorted(per_client.items())
    ]
    header = ["client", "accuracy", "test images", "status", "reason"]
    intro = "Scored by each institution on its own held-out images"
    if evaluation.get("where"):
        intro += f' (run config `evaluation = "{evaluation["where"]}"`)'
    lines = ["## Accuracy per institution", "", intro + ".", "", *_table(header, rows, "lrrll")]
    if "weighted_mean" in evaluation:
        mean = _percent(evaluation["weighted_mean"])
        lines += ["", f"Mean weighted by test images: **{mean}**."]
    return lines


def _clients(metrics: dict[str, Any]) -> list[str]:
    clients = metrics.get("clients") or []
    if not clients:
        return []
    sent = [client.get("metrics") or {} for client in clients]
    skipped = [m.get("unreadable-files-skipped", 0) for m in sent]
    rows = [
        [
            _client_name(client),
            str(client.get("domain") or ""),
            str(client.get("status", "")),
            str(m.get("num-examples", "")),
            _size(client.get("payload_bytes")),
            _duration(m.get("seconds-total")),
            _text(client.get("reason", "")),
        ]
        for client, m in zip(clients, sent)
    ]
    header = ["client", "domain", "status", "images", "upload", "time on client", "reason"]
    align = "lllrrrl"
    if any(skipped):  # node config bad-images = "skip" left files out somewhere
        header.insert(4, "unreadable files left out")
        align = "lllrrrrl"
        for row, count in zip(rows, skipped):
            row.insert(4, str(count))
    return ["## Clients", "", *_table(header, rows, align)]


def _phases(metrics: dict[str, Any]) -> list[str]:
    seconds = metrics.get("seconds") or {}
    if not seconds:
        return []
    order = {phase: i for i, phase in enumerate(PHASE_ORDER)}
    phases = sorted(seconds, key=lambda phase: order.get(phase, len(order)))
    rows = [[phase, _duration(seconds[phase])] for phase in phases]
    rows.append(["**total**", f"**{_duration(sum(seconds.values()))}**"])
    return ["## Time per phase (server)", "", *_table(["phase", "time"], rows, "lr")]


def _grids(run_dir: Path, metrics: dict[str, Any]) -> list[str]:
    grids = sorted(run_dir.glob("grid-*.png"))
    if not grids:
        return []
    domains = _domains_by_client(metrics)
    lines = [
        "## Real and synthetic images",
        "",
        "Each grid: real test images of the client's domain (top row) above its synthetic images.",
    ]
    for path in grids:
        client = path.stem.removeprefix("grid-")
        title = f"{client} ({domains[client]})" if client in domains else client
        lines += ["", f"### {title}", "", _image(f"{client}: real above synthetic", path.name)]
    return lines


def _concept_curves(run_dir: Path, metrics: dict[str, Any]) -> list[str]:
    curves = {
        _client_name(client): losses
        for client in metrics.get("clients") or []
        if (losses := (client.get("metrics") or {}).get("concept-losses"))
    }
    if not curves:
        return []
    lines = [
        "## Concept learning",
        "",
        "Diffusion loss of the domain concept S and class concepts V per epoch, on each client.",
    ]
    for client, losses in sorted(curves.items()):
        name = f"concept-loss-{client}.png"
        _plot(run_dir / name, [(f"concept loss: {client}", "loss", losses)])
        lines += ["", _image(f"concept loss of {client}", name)]
    return lines


def _classifier_curves(run_dir: Path, metrics: dict[str, Any]) -> list[str]:
    classifier = metrics.get("classifier") or {}
    panels = [
        (title, label, values)
        for key, title, label in (
            ("epoch_loss", "classifier training loss", "loss"),
            ("epoch_accuracy", "classifier training accuracy", "accuracy"),
        )
        if (values := classifier.get(key))
    ]
    if not panels:
        return []
    _plot(run_dir / CLASSIFIER_PNG, panels)
    intro = "ResNet-18 on the synthetic training set, per epoch."
    return ["## Classifier training", "", intro, "", _image("classifier curves", CLASSIFIER_PNG)]


# --- pieces -----------------------------------------------------------------------------------


def _plot(path: Path, panels: Sequence[tuple[str, str, Sequence[float]]]) -> Path:
    """One PNG, one panel per ``(title, y label, values per epoch)``, side by side."""
    figure = Figure(figsize=(4.5 * len(panels), 3.2), layout="constrained")
    axes_row = figure.subplots(1, len(panels), squeeze=False)[0]
    for axes, (title, ylabel, values) in zip(axes_row, panels, strict=True):
        axes.plot(range(1, len(values) + 1), values, marker="o", markersize=3)
        axes.set(title=title, xlabel="epoch", ylabel=ylabel)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
    buffer = BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return atomic_write(path, buffer.getvalue())


def _table(header: list[str], rows: list[list[str]], align: str) -> list[str]:
    """A Markdown table padded into columns, so it reads in a terminal as it renders on GitHub.

    ``align`` holds one letter per column: ``l`` or ``r``.
    """
    widths = [max(3, *(len(row[i]) for row in [header, *rows])) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [
            cell.rjust(width) if side == "r" else cell.ljust(width)
            for cell, width, side in zip(cells, widths, align, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = [
        "-" * (width - 1) + ":" if side == "r" else "-" * width
        for width, side in zip(widths, align, strict=True)
    ]
    return [line(header), line(rule), *(line(row) for row in rows)]


def _image(alt: str, file_name: str) -> str:
    """An image link; the file name is percent-encoded (client ids may contain spaces)."""
    return f"![{alt}]({quote(file_name)})"


def _client_name(client: dict[str, Any]) -> str:
    """The client id, or its node id when its upload never named one (a failed client)."""
    return str(client.get("client_id") or f"node {client.get('node_id', '?')}")


def _domains_by_client(metrics: dict[str, Any]) -> dict[str, str]:
    return {
        str(c["client_id"]): str(c["domain"])
        for c in metrics.get("clients") or []
        if c.get("client_id") and c.get("domain")
    }


def _text(value: Any) -> str:
    """Free text (a reason) made safe for one table cell."""
    return " ".join(str(value).split()).replace("|", "\\|")


def _percent(value: Any) -> str:
    if not isinstance(value, (int, float)) or math.isnan(value):
        return "n/a"
    return f"{100 * value:.1f}%"


def _size(num_bytes: Any) -> str:
    if not num_bytes:
        return "-"
    if num_bytes < 1e6:
        return f"{num_bytes / 1e3:.1f} kB"
    return f"{num_bytes / 1e6:.2f} MB"


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"

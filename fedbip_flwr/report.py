"""``report.md``: what a person reads after a run, on GitHub or in a terminal, PNGs beside it.

Built from ``metrics.json`` (read and validated as :class:`~fedbip_flwr.results.RunResults`)
and the PNGs in the run folder only, so ``fedbip report RUN_DIR`` rebuilds it at any time, for
a failed run too (every part of the record is shown when present and left out when absent).
Curves are drawn with matplotlib's Agg canvas through :class:`~matplotlib.figure.Figure`, never
``pyplot``, so plotting touches no global backend state of the process that calls it (the
ServerApp).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path
from typing import Any
from urllib.parse import quote

from . import results
from .results import (
    SENT_CONCEPT_LOSSES,
    SENT_IMAGES,
    SENT_SECONDS,
    SENT_SKIPPED,
    ClientOutcome,
    RunResults,
    Scored,
)
from .storage import atomic_write
from .upload import PayloadError, printable

REPORT_FILE = "report.md"
CLASSIFIER_PNG = "classifier-curves.png"


def write_report(run_dir: Path) -> Path:
    """Write ``run_dir/report.md`` (and its curve PNGs) from ``run_dir/metrics.json``.

    Raises ``OSError`` when metrics.json cannot be read and ``ValueError`` naming it when it
    does not hold a run's results: a report without the run's numbers would mislead.
    """
    run_dir = Path(run_dir)
    record, fidelity = results.read(run_dir), results.read_fidelity(run_dir)
    lines = [f"# FedBiP run `{run_dir.resolve().name}`", "", *_status(record)]
    for section in (
        _accuracy_per_domain(record, fidelity),
        _accuracy_per_institution(record),
        _clients(record),
        _what_left(run_dir),
        _phases(record),
        _grids(run_dir, record),
        _concept_curves(run_dir, record),
        _classifier_curves(run_dir, record),
    ):
        if section:
            lines += ["", *section]
    return atomic_write(run_dir / REPORT_FILE, ("\n".join(lines) + "\n").encode())


# --- sections: each returns its Markdown lines, or [] when the record has nothing for it ---


def _status(record: RunResults) -> list[str]:
    line = f"**Status: {record.status}.**"
    if record.reason:
        line += f" {_text(record.reason)}"
    accuracy = record.accuracy
    if accuracy is not None and accuracy.mean is not None:
        domains = len(accuracy.per_domain or {})
        line += f" Mean accuracy {_percent(accuracy.mean)} over {domains} domain(s)"
        if accuracy.num_synthetic_images is not None:
            line += f", classifier trained on {accuracy.num_synthetic_images} synthetic images"
        line += "."
    raw = f"[{results.FILE_NAME}]({results.FILE_NAME})"
    return [line, "", f"Raw numbers and the full run configuration: {raw}."]


def _accuracy_per_domain(record: RunResults, fidelity: results.Fidelity | None) -> list[str]:
    accuracy = record.accuracy
    if accuracy is None or not accuracy.per_domain:
        return []
    judged = fidelity.per_domain if fidelity is not None else {}
    rows = [
        [_text(domain), _percent(value), *_fidelity_cells(judged, domain)]
        for domain, value in sorted(accuracy.per_domain.items())
    ]
    rows.append(["**mean**", f"**{_percent(accuracy.mean)}**", *_fidelity_cells(judged, None)])
    intro = "The classifier, trained on synthetic images only, on each domain's real test images."
    header, align = ["domain", "accuracy"], "lr"
    if judged:
        header, align = [*header, "class fidelity", "domain fidelity"], "lrrr"
        intro += (
            " Fidelity: the share of that domain's client's synthetic images that judges trained"
            " on real images of every domain name as their class, and as the client's domain"
            f" ([{results.FIDELITY_FILE}]({results.FIDELITY_FILE}); a low domain fidelity is a"
            " synthetic set outside the client's domain)."
        )
    return ["## Accuracy per domain", "", intro, "", *_table(header, rows, align)]


def _fidelity_cells(judged: dict[str, results.JudgedImages], domain: str | None) -> list[str]:
    """A row's fidelity cells: none for a run never judged, blank on the mean's row."""
    if not judged:
        return []
    images = judged.get(domain) if domain is not None else None
    if images is None:
        return ["", ""] if domain is None else ["not judged", ""]
    return [_percent(images.class_fidelity), _percent(images.domain_fidelity)]


def _accuracy_per_institution(record: RunResults) -> list[str]:
    evaluation = record.evaluation
    if evaluation is None or not evaluation.per_client:
        return []
    rows = [
        [client, _percent(score.accuracy), str(score.num_examples or "not sent"), score.status, ""]
        if isinstance(score, Scored)
        else [client, _percent(None), "", score.status, _text(score.reason)]
        for client, score in sorted(evaluation.per_client.items())
    ]
    header = ["client", "accuracy", "test images", "status", "reason"]
    intro = (
        "Scored by each institution on its own held-out images "
        f'(run config `federation.evaluation = "{evaluation.where}"`).'
    )
    lines = ["## Accuracy per institution", "", intro, "", *_table(header, rows, "lrrll")]
    mean = _percent(evaluation.weighted_mean)
    # each institution's test-image count is its own claim (fedbip_flwr.results.institutions_mean)
    return [*lines, "", f"Mean over the institutions, each weighing one: **{mean}**."]


def _clients(record: RunResults) -> list[str]:
    clients = record.clients or []
    if not clients:
        return []
    sent = [client.metrics or {} for client in clients]
    skipped = [m.get(SENT_SKIPPED, 0) for m in sent]
    rows = [
        [
            _client_name(client),
            _text(client.domain),
            client.status,
            str(m.get(SENT_IMAGES, "")),
            _size(client.payload_bytes),
            _duration(m.get(SENT_SECONDS)),
            _text(client.reason),
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


def _what_left(run_dir: Path) -> list[str]:
    """Per institution, every tensor its upload held, the upload's size and the formal
    guarantee it carries (its header's), read from the uploads the server kept."""
    from .methods import audit_upload  # the registry imports most of the package
    from .server import RunFolder

    rows = []
    for path in sorted(RunFolder(run_dir).payloads.glob("*.safetensors")):
        blob = path.read_bytes()
        try:
            upload = audit_upload(blob, len(blob))
        except PayloadError as err:
            rows.append([path.stem, "", f"unreadable: {_text(err.reason)}", _size(len(blob)), ""])
            continue
        tensors = ", ".join(f"`{name}` {list(t.shape)}" for name, t in upload.tensors.items())
        dp = getattr(upload.meta, "dp", None)
        sgd = getattr(dp, "concepts", None)  # fedbip-mixture's: S and V by DP-SGD
        guarantee = (
            f"({dp.epsilon:g}, {dp.delta:g})-DP per {_text(dp.unit)}, for {_text(', '.join(dp.covers))}"
            + (
                f"; {', '.join(sgd.covers)} by DP-SGD (q {sgd.sample_rate:g}, {sgd.steps} steps, "
                f"sigma {sgd.noise_multiplier:.3g}, clip {sgd.clip:g})"
                if sgd
                else ""
            )
            + ("; void: the run lets the server replay client noise" if dp.replayable_noise else "")
            if dp
            else "none"
        )
        rows.append([path.stem, upload.meta.method, tensors, _size(len(blob)), guarantee])
    if not rows:
        return []
    intro = "Everything that left each institution: the tensors of its one upload, as the server kept them."
    return [
        "## What left each institution",
        "",
        intro,
        "",
        *_table(["client", "method", "tensors", "size", "formal guarantee"], rows, "lllrl"),
    ]


def _phases(record: RunResults) -> list[str]:
    phases = record.seconds.phases() if record.seconds is not None else {}
    if not phases:
        return []
    rows = [[phase, _duration(seconds)] for phase, seconds in phases.items()]
    rows.append(["**total**", f"**{_duration(sum(phases.values()))}**"])
    return ["## Time per phase (server)", "", *_table(["phase", "time"], rows, "lr")]


def _grids(run_dir: Path, record: RunResults) -> list[str]:
    grids = sorted(run_dir.glob("grid-*.png"))
    if not grids:
        return []
    domains = {c.client_id: c.domain for c in record.clients or [] if c.client_id and c.domain}
    lines = [
        "## Real and synthetic images",
        "",
        "Each grid: real test images of the client's domain (top row) above its synthetic images.",
    ]
    for path in grids:
        client = path.stem.removeprefix("grid-")
        title = f"{client} ({_text(domains[client])})" if client in domains else client
        lines += ["", f"### {title}", "", _image(f"{client}: real above synthetic", path.name)]
    return lines


def _concept_curves(run_dir: Path, record: RunResults) -> list[str]:
    curves = {
        _client_name(client): losses
        for client in record.clients or []
        if isinstance(losses := (client.metrics or {}).get(SENT_CONCEPT_LOSSES), list) and losses
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


def _classifier_curves(run_dir: Path, record: RunResults) -> list[str]:
    if record.classifier is None or not record.classifier.epoch_loss:
        return []
    losses = record.classifier.epoch_loss
    _plot(run_dir / CLASSIFIER_PNG, [("classifier training loss", "loss", losses)])
    intro = "ResNet-18 on the synthetic training set, per epoch."
    return ["## Classifier training", "", intro, "", _image("classifier curves", CLASSIFIER_PNG)]


# --- pieces -----------------------------------------------------------------------------------


def _plot(path: Path, panels: Sequence[tuple[str, str, Sequence[float]]]) -> Path:
    """One PNG, one panel per ``(title, y label, values per epoch)``, side by side."""
    # imported here: every ClientApp imports this module's callers, only the server draws
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

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


def _client_name(client: ClientOutcome) -> str:
    """The client id, or its node id when its upload never named one (a failed client)."""
    return client.client_id or f"node {client.node_id}"


# Markdown's inline syntax: escaped in text that comes from uploads or replies, so a domain
# name cannot open a link, load an image, or end a table cell
MARKDOWN_SPECIALS = re.compile(r"([\\`*_\[\]<>!|~])")


def _text(value: Any) -> str:
    """Free text (a reason, a domain name from an upload) made safe for one table cell: no
    control characters (:func:`~fedbip_flwr.upload.printable`), Markdown read as plain text."""
    return MARKDOWN_SPECIALS.sub(r"\\\1", printable(" ".join(str(value).split())))


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

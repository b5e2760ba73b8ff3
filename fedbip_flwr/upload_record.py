"""What left an institution: a record of every upload, kept in the institution's own folder.

Each upload its ClientApp sends is described (:func:`describe`) and the record appended, one
JSON object per line, to ``<output-dir>/institutions/<client-id>/uploads.jsonl`` (node config
output-dir, else the run's), and logged: its sha256 digest, kinds, size, method, the DP
guarantee its header carries (or "none"), and what the project's records measured of the
server's membership test on that kind of upload at that latent size (:data:`MEMBERSHIP`).
``fedbip inspect FILE`` prints the same for a payload file (:func:`record_lines`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from .methods import audit_upload, upload_kinds
from .methods.fedld import EPSILON_TOLERANCE
from .paths import resolve
from .policy import UploadKind

RECORDS_FILE = "uploads.jsonl"
Shape = tuple[int, int, int]
SMALL, SD = (4, 16, 16), (4, 64, 64)  # the miniature's latent size, and Stable Diffusion's
THREE_SEEDS = ("_seed1.json", "_seed2.json")


@dataclass(frozen=True)
class Measured:
    """One figure of the project's records: the AUC (0.5 = chance) of the server's strongest
    membership test on one kind of upload at one latent size, under a DP guarantee of
    ``epsilon`` or none, as its range over the three domains of each domain's mean over the
    seeds' ``records`` (files in ``benchmarks/``). ``tests`` name where in a record it is:
    the result setting and the attacks (by name prefix) whose best is the domain's figure.
    ``what`` ends with the model the records ran, by digest (their ``provenance.model``;
    ``cc5d681c07eb`` for records older than that field)."""

    kind: UploadKind
    latent_shape: Shape
    epsilon: float | None
    auc: tuple[float, float]
    what: str
    records: tuple[str, ...]
    tests: tuple[tuple[str, str], ...]

    @property
    def key(self) -> tuple[UploadKind, Shape, float | None]:
        return self.kind, self.latent_shape, self.epsilon


def _seeds(first: str, stem: str = "server_attacks") -> tuple[str, ...]:
    return (first, *(stem + tail for tail in THREE_SEEDS))


_ZT, _MIXTURES = _seeds("server_attacks.json"), _seeds("server_attacks_mixtures.json")
_DP = tuple(f"server_attacks_dp_seed{s}.json" for s in range(3))
_DP_SD = tuple(f"server_attacks_sd_seed{s}.json" for s in range(3))
_CONDITIONING = (
    *(f"server_attacks_concepts_h200_seed{s}.json" for s in range(3)),
    *(f"server_attacks_conditions_seed{s}.json" for s in range(3)),
)
_DP_MIXTURE = "64px/fedbip-mixture-dp/epsilon=4"

# Keyed by (upload kind, latent size, DP epsilon or None); tests/test_upload_record.py
# recomputes every entry from its records, so an entry cannot drift from them unnoticed.
MEMBERSHIP: dict[tuple[UploadKind, Shape, float | None], Measured] = {
    m.key: m
    for m in (
        Measured(
            UploadKind.LATENTS,
            SMALL,
            None,
            (0.62, 0.66),
            "FedBiP's z(T), 2 per image, T = 999, three seeds, model cc5d681c07eb",
            _ZT,
            (("64px/T=999/K=2", "rows/"),),
        ),
        Measured(
            UploadKind.LATENTS,
            SD,
            None,
            (0.95, 0.99),
            "FedBiP's z(T), 2 per image, T = 999, three seeds, model cc5d681c07eb",
            _ZT,
            (("256px/T=999/K=2", "rows/"),),
        ),
        Measured(
            UploadKind.STATISTICS,
            SMALL,
            None,
            (0.62, 0.63),
            "class mixtures of z(T) (fedbip-mixture, FedLD), T = 999, three seeds, "
            "model cc5d681c07eb",
            _MIXTURES,
            (("64px/T=999/K=2", "fedbip-mixture/"), ("64px/T=999/K=2", "fedld/")),
        ),
        Measured(
            UploadKind.STATISTICS,
            SD,
            None,
            (0.84, 0.92),
            "class mixtures of z(T) (fedbip-mixture, FedLD), T = 999, three seeds, "
            "model cc5d681c07eb",
            _MIXTURES,
            (("256px/T=999/K=2", "fedbip-mixture/"), ("256px/T=999/K=2", "fedld/")),
        ),
        Measured(
            UploadKind.CONCEPTS,
            SMALL,
            None,
            (0.55, 0.72),
            "FedBiP's concepts and Espresso's conditions, default budget, three seeds, "
            "model fdf12bd6eb04",
            _CONDITIONING,
            (
                ("64px/concepts/shots=16/epochs=10", "concepts/"),
                ("64px/espresso-conditions/shots=16/epochs=10", "espresso-conditions/"),
            ),
        ),
        Measured(
            UploadKind.STATISTICS,
            SMALL,
            4.0,
            (0.50, 0.52),
            "fedbip-mixture's DP class statistics, three seeds, model fdf12bd6eb04",
            _DP,
            (
                (_DP_MIXTURE, "fedbip-mixture-dp/likelihood-ratio"),
                (_DP_MIXTURE, "fedbip-mixture-dp/mean-filter"),
            ),
        ),
        Measured(
            UploadKind.CONCEPTS,
            SMALL,
            4.0,
            (0.49, 0.51),
            "fedbip-mixture's DP-SGD concepts, three seeds, model fdf12bd6eb04",
            _DP,
            ((_DP_MIXTURE, "fedbip-mixture-dp/concepts/"),),
        ),
        Measured(
            UploadKind.STATISTICS,
            SD,
            4.0,
            (0.50, 0.53),
            "the DP class statistics of fedbip-mixture and FedLD, T = 961, three seeds, "
            "model fdf12bd6eb04",
            _DP_SD,
            (
                ("256px/T=961/fedbip-mixture-dp-stats/epsilon=4", "fedbip-mixture-dp-stats/"),
                ("256px/T=961/fedld-dp/epsilon=4", "fedld-dp/"),
            ),
        ),
    )
}


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Membership(_Part):
    """What the records say of the server's membership test on one kind of this upload."""

    kind: UploadKind
    auc: tuple[float, float] | None  # None: no record at this kind, latent size and guarantee
    epsilon: float | None = None  # the DP epsilon it was measured at; None: without DP
    what: str = ""
    records: tuple[str, ...] = ()


class DPClaim(_Part):
    """The DP guarantee an upload's header states, per private image."""

    epsilon: float
    delta: float
    void: bool  # the run let the server replay the client's noise, which undoes it


class UploadRecord(_Part):
    """One upload that left an institution (or, from ``fedbip inspect``, one payload file)."""

    time: str | None = None  # when the ClientApp sent it (UTC); None for a file
    run_id: int | None = None
    client_id: str
    method: str
    kinds: tuple[UploadKind, ...]
    bytes: int
    sha256: str
    dp: DPClaim | Literal["none"]
    latent_shape: tuple[int, ...] | None
    membership: tuple[Membership, ...]


def sent(blob: bytes, run_id: int) -> UploadRecord:
    """The record of an upload a ClientApp sends now, in run ``run_id``."""
    now = datetime.now(UTC).isoformat(timespec="seconds")
    return describe(blob).model_copy(update={"time": now, "run_id": run_id})


def describe(blob: bytes) -> UploadRecord:
    """The record of an upload's bytes, from its own header (checked as ``fedbip inspect``
    checks it: :func:`~fedbip_flwr.methods.audit_upload`)."""
    meta = audit_upload(blob, len(blob)).meta
    release = getattr(meta, "dp", None)  # a DP method's header; None elsewhere
    dp = (
        DPClaim(epsilon=release.epsilon, delta=release.delta, void=release.replayable_noise)
        if release is not None
        else "none"
    )
    shape = getattr(meta, "latent_shape", None)
    epsilon = dp.epsilon if isinstance(dp, DPClaim) and not dp.void else None
    kinds = tuple(sorted(upload_kinds(meta.method)))
    return UploadRecord(
        client_id=meta.client_id,
        method=meta.method,
        kinds=kinds,
        bytes=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
        dp=dp,
        latent_shape=tuple(shape) if shape else None,
        membership=tuple(_membership(kind, shape, epsilon) for kind in kinds),
    )


def _membership(kind: UploadKind, shape: list[int] | None, epsilon: float | None) -> Membership:
    found = _measured(kind, tuple(shape), epsilon) if shape else None
    if found is None:
        return Membership(kind=kind, auc=None)
    return Membership(
        kind=kind, auc=found.auc, epsilon=found.epsilon, what=found.what, records=found.records
    )


def _measured(kind: UploadKind, shape: Shape, epsilon: float | None) -> Measured | None:
    """The record of this kind at this latent size: without a guarantee, the one measured
    without; under (epsilon)-DP, the one measured at the smallest epsilon no smaller than it
    (the accountant gives an epsilon just below the one asked for), which the upload is at
    least as private as."""
    if epsilon is None:
        return MEMBERSHIP.get((kind, shape, None))
    weaker = [
        m
        for (k, s, e), m in MEMBERSHIP.items()
        if (k, s) == (kind, shape) and e is not None and e + EPSILON_TOLERANCE >= epsilon
    ]
    return min(weaker, key=lambda m: m.epsilon or 0.0, default=None)


def record_lines(record: UploadRecord) -> list[str]:
    """The record as a person reads it, in a log or from ``fedbip inspect``."""
    dp = record.dp
    guarantee = (
        "none"
        if dp == "none"
        else f"({dp.epsilon:g}, {dp.delta:g})-DP per private image"
        + (", void: the run let the server replay the client's noise" if dp.void else "")
    )
    size = "x".join(map(str, record.latent_shape)) if record.latent_shape else "no latents"
    lines = [
        f"upload: {record.method} from {record.client_id}, {record.bytes} bytes, "
        f"sha256 {record.sha256}",
        f"kinds: {', '.join(record.kinds)}",
        f"DP guarantee: {guarantee}",
        f"the server's membership test, as measured ({size}; AUC 0.5 = chance):",
    ]
    for m in record.membership:
        if m.auc is None:
            lines.append(f"  {m.kind}: no record at this latent size and guarantee")
        else:
            files = ", ".join(f"benchmarks/{name}" for name in m.records)
            at = f" at epsilon {m.epsilon:g}" if m.epsilon is not None else ""
            lines.append(f"  {m.kind}: AUC {m.auc[0]:.2f}-{m.auc[1]:.2f}{at} ({m.what}; {files})")
    return lines


def summary(record: UploadRecord) -> str:
    """The record in one line, for the log as the upload leaves: size, what it holds, its
    guarantee and the measured membership figures of its kinds (where the records have one)."""
    dp = record.dp
    guarantee = (
        "no DP guarantee"
        if dp == "none"
        else f"({dp.epsilon:g}, {dp.delta:g})-DP per image"
        + (" (void: replayable noise)" if dp.void else "")
    )
    size = "x".join(map(str, record.latent_shape)) if record.latent_shape else ""
    measured = [
        f"{m.kind} {m.auc[0]:.2f}-{m.auc[1]:.2f}" for m in record.membership if m.auc is not None
    ]
    tests = (
        f"; the server's membership test on such uploads at {size}, AUC {', '.join(measured)}"
        if measured
        else ""
    )
    return (
        f"{record.bytes / 1e6:.2f} MB once ({record.method}: {', '.join(record.kinds)}; "
        f"{guarantee}{tests})"
    )


def records_path(output_dir: str, client_id: str) -> Path:
    """Where an institution keeps the records of its uploads: its own output folder."""
    return resolve(output_dir) / "institutions" / client_id / RECORDS_FILE


def keep(record: UploadRecord, path: Path) -> Path:
    """Append ``record`` as one JSON line, flushed to disk before the upload leaves."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        out.write(record.model_dump_json() + "\n")
        out.flush()
        os.fsync(out.fileno())
    return path

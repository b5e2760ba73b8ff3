"""Where and with what a benchmark result was made: the commit, the machine kind
(:mod:`fedbip_tools.machine`), the library versions and the date.

float32 results differ between machine kinds, so seeds are averaged only within a kind unless
asked otherwise, and a result cached before results carried provenance is of the kind
``unrecorded``: never silently merged with a recorded one.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from .machine import this_machine

UNRECORDED = "unrecorded"
PACKAGES = ("torch", "diffusers", "flwr")
MIX_FLAG = "--mix-machine-kinds"


class MixedMachineKinds(ValueError):
    """A row would average seeds made on different machine kinds."""


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "--no-optional-locks", "-C", str(root), *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def commit(root: Path, outputs: Sequence[Path] = ()) -> str:
    """HEAD of the checkout at ``root``, with ``-dirty`` where a tracked file differs from it
    (``outputs``, which the benchmark writes itself, left out); ``unknown`` outside git."""
    inside = [Path(os.path.relpath(p.resolve(), root.resolve())) for p in outputs]
    excluded = [f":(exclude){p}" for p in inside if ".." not in p.parts]
    try:
        head = _git(root, "rev-parse", "HEAD")
        changed = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *excluded)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if changed else "")


def model_digest(folder: Path) -> str:
    """The latent diffusion model in ``folder`` (diffusers layout): 12 hex digits of the SHA-256
    of its ``model_index.json`` and every file of the components it lists (weights, configs,
    tokenizer), so two results share a digest exactly when they ran the same model."""
    index = folder / "model_index.json"
    parts = [name for name in json.loads(index.read_text()) if not name.startswith("_")]
    files = [index, *sorted(p for name in parts for p in (folder / name).rglob("*") if p.is_file())]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def record(
    root: Path, threads: int, outputs: Sequence[Path] = (), model: Path | None = None
) -> dict[str, Any]:
    """This machine's provenance for a result made now by ``threads`` torch threads per run
    (and, given ``model``, the :func:`model_digest` of the model folder it ran)."""
    machine = this_machine()
    return {
        **({"model": model_digest(model)} if model else {}),
        "commit": commit(root, outputs),
        "machine": {**machine.model_dump(), "threads": threads, "kind": machine.kind},
        **{name: metadata.version(name) for name in PACKAGES},
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def kind(row: Mapping[str, Any]) -> str:
    """The machine kind a cached row was made on; ``unrecorded`` before rows carried it."""
    made = row.get("provenance")
    return made["machine"]["kind"] if made else UNRECORDED


def made_with(rows: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """What a row's seeds (seed: cached row) were made with: the seeds of each machine kind,
    and the distinct CPUs, library versions, commits and dates of the recorded ones."""
    kinds: dict[str, list[int]] = {}
    for seed, row in sorted(rows.items()):
        kinds.setdefault(kind(row), []).append(seed)
    made = [r["provenance"] for r in rows.values() if r.get("provenance")]
    return {
        "kinds": kinds,
        "models": sorted({r.get("model", UNRECORDED) for r in rows.values()}),
        "cpus": sorted({m["machine"]["cpu"] for m in made}),
        "software": sorted({", ".join(f"{p} {m[p]}" for p in PACKAGES) for m in made}),
        "commits": sorted({m["commit"] for m in made}),
        "dates": sorted({m["date"][:10] for m in made}),
    }


def mixed(made: Mapping[str, Any]) -> bool:
    return len(made["kinds"]) > 1


def mixed_models(made: Mapping[str, Any]) -> bool:
    return len(made.get("models", ())) > 1


def refuse_mixed_models(by_row: Mapping[str, Mapping[str, Any]]) -> None:
    """Raise ``ValueError`` naming every row whose seeds ran different models: never averaged,
    whatever the flags (another model is another method, not another seed)."""
    models = [
        f"  {name}: {', '.join(m['models'])}" for name, m in by_row.items() if mixed_models(m)
    ]
    if models:
        raise ValueError(
            "these rows' seeds ran different models (model digests); remake them on one:\n"
            + "\n".join(models)
        )


def refuse_mixed(by_row: Mapping[str, Mapping[str, Any]]) -> None:
    """Raise :class:`MixedMachineKinds` naming every row whose seeds span machine kinds."""
    rows = {name: made for name, made in by_row.items() if mixed(made)}
    if rows:
        lines = (f"  {name}: {kinds_text(made)}" for name, made in rows.items())
        raise MixedMachineKinds(
            "these rows would average seeds of different machine kinds (float32 results differ "
            "between kinds):\n" + "\n".join(lines) + f"\npass {MIX_FLAG} to average them "
            "anyway (the table then marks them), or run their seeds on one kind"
        )


def kinds_text(made: Mapping[str, Any]) -> str:
    """``AVX2: 2 seeds (0, 1); unrecorded: 1 seed (2)``."""
    return "; ".join(
        f"{k}: {len(s)} seed{'s' * (len(s) != 1)} ({', '.join(map(str, s))})"
        for k, s in made["kinds"].items()
    )


def cell(made: Mapping[str, Any]) -> str:
    """The table's "made with": the kind (every kind, marked, where seeds were mixed), how
    many commits the seeds span and their dates."""
    kinds = f"mixed kinds, {kinds_text(made)}" if mixed(made) else next(iter(made["kinds"]))
    models = [m for m in made.get("models", ()) if m != UNRECORDED]
    kinds += "".join(f", model {m}" for m in models)
    if not made["commits"]:
        return kinds
    commits = len(made["commits"])
    dates = made["dates"][0] + (f" to {made['dates'][-1]}" if len(made["dates"]) > 1 else "")
    return f"{kinds}, {commits} commit{'s' * (commits != 1)}, {dates}"


def full_text(made: Mapping[str, Any]) -> str:
    """:func:`cell` with the CPUs, library versions and the commits themselves."""
    return "; ".join([cell(made), *made["cpus"], *made["software"], *made["commits"]])

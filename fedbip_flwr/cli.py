"""The ``fedbip`` command: small tools around a FedBiP run.

Subcommands register themselves in :func:`build_parser`; each sets ``func`` to a handler that
takes the parsed arguments and returns the exit status. ``fedbip inspect`` lets anyone audit
exactly what a client uploads (or what a server stored) before trusting it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedbip_flwr.payload import (
    DEFAULT_MAX_BYTES,
    Payload,
    PayloadError,
    load_payload,
    summarize,
)

_TABLE_COLUMNS = ("name", "shape", "dtype", "mean", "std")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; add a subcommand by adding one ``_add_*`` call here."""
    parser = argparse.ArgumentParser(prog="fedbip", description="Tools around a FedBiP run.")
    subcommands = parser.add_subparsers(dest="command", required=True)
    _add_inspect(subcommands)
    return parser


def _add_inspect(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inspect = subcommands.add_parser(
        "inspect",
        help="validate a client payload and show its metadata and tensors",
        description="Validate a FedBiP payload (.safetensors) and print what it contains. "
        "Exit status 0: valid; 1: invalid or unreadable.",
    )
    inspect.add_argument("payload", type=Path, help="payload file (.safetensors)")
    inspect.add_argument(
        "--max-mb",
        type=_positive_float,
        default=DEFAULT_MAX_BYTES / 2**20,
        help="refuse files larger than this many MiB (default: %(default)g, as the server)",
    )
    inspect.set_defaults(func=_run_inspect)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _run_inspect(args: argparse.Namespace) -> int:
    """Print metadata and a tensor table for a valid payload; one line on stderr otherwise."""
    try:
        payload = load_payload(args.payload, max_bytes=int(args.max_mb * 2**20))
    except PayloadError as err:
        print(f"invalid payload: {err.reason}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"fedbip inspect: cannot read '{args.payload}': {err.strerror or err}", file=sys.stderr)
        return 1
    print(f"file: {args.payload}")
    print(f"bytes: {args.payload.stat().st_size}")
    for line in _meta_lines(payload):
        print(line)
    print()
    print(_format_table(summarize(payload)))
    return 0


def _meta_lines(payload: Payload) -> list[str]:
    """``key: value`` per metadata field: strings bare, everything else as JSON."""
    return [
        f"{key}: {value if isinstance(value, str) else json.dumps(value)}"
        for key, value in payload.meta.model_dump().items()
    ]


def _format_table(rows: list[dict[str, Any]]) -> str:
    """Left-aligned plain-text columns; stays readable in logs and pipes."""
    cells = [list(_TABLE_COLUMNS)] + [[_cell(row[col]) for col in _TABLE_COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_TABLE_COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
        for line in cells
    )


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedbip`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())

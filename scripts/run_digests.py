"""Digests of what a finished run made: every payload, every shard, the classifier, and the
accuracies in metrics.json. Two runs with the same seed and `replayable-client-noise = true`
that print the same digests computed the same thing, byte for byte; a refactoring that claims
to change no behaviour is checked this way.

    python scripts/run_digests.py outputs/<run> [--out digests.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from fedbip_flwr import results
from fedbip_flwr.results import Accuracy


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_digests(run_dir: Path) -> dict:
    """sha256 of payloads/*, shards/**, classifier.safetensors; metrics' accuracies as written
    (server-side mean and per domain)."""
    files = {
        kind: {str(p.relative_to(run_dir)): sha256(p) for p in sorted((run_dir / kind).rglob("*"))
               if p.is_file() and not p.name.endswith(".tmp")}
        for kind in ("payloads", "shards")
    }  # fmt: skip
    accuracy = results.read(run_dir).accuracy or Accuracy()
    return {
        **files,
        "classifier": sha256(run_dir / "classifier.safetensors"),
        "accuracy": accuracy.model_dump(include={"mean", "per_domain"}),  # no timings
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, help="write the digests here as JSON too")
    args = parser.parse_args()
    text = json.dumps(run_digests(args.run_dir), indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

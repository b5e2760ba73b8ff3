"""Digests of what a finished run made: every payload, every shard, the classifier, and the
accuracies in metrics.json. Two runs with the same seed and `replayable-client-noise = true`
that print the same digests computed the same thing, byte for byte; a refactoring that claims
to change no behaviour is checked this way.

    python scripts/run_digests.py outputs/<run> [--out digests.json] [--without-meta KEY]

``--without-meta fedbip.class_clusters`` digests every payload as re-encoded without that
metadata key: how a run is compared with one recorded before the key existed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from fedbip_flwr import results
from fedbip_flwr.results import Accuracy
from fedbip_flwr.upload import encode_tensors, read_header, read_tensors


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def without_meta(blob: bytes, key: str) -> bytes:
    """The upload re-encoded (deterministically) with its metadata ``key`` left out."""
    names = tuple(read_header(blob)[0])
    tensors, metadata = read_tensors(blob, names, len(blob), json.loads(read_header(blob)[1]["fedbip.method"]))
    metadata.pop(key, None)
    return encode_tensors(tensors, metadata)


def run_digests(run_dir: Path, drop: str | None = None) -> dict:
    """sha256 of payloads/*, shards/**, classifier.safetensors; metrics' accuracies as written
    (server-side mean and per domain). ``drop``: payloads digested without that metadata key."""
    files = {
        kind: {str(p.relative_to(run_dir)): sha256(p) for p in sorted((run_dir / kind).rglob("*"))
               if p.is_file() and not p.name.endswith(".tmp")}
        for kind in ("payloads", "shards")
    }  # fmt: skip
    if drop:
        files["payloads"] = {
            name: hashlib.sha256(without_meta((run_dir / name).read_bytes(), drop)).hexdigest()
            for name in files["payloads"]
        }
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
    parser.add_argument("--without-meta", metavar="KEY", help="digest payloads without this metadata key")
    args = parser.parse_args()
    text = json.dumps(run_digests(args.run_dir, args.without_meta), indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""Digests of what a finished run made: every payload, every shard, the classifier, and the
accuracies in metrics.json. Two runs with the same seed and
`federation.replayable-client-noise = true` that print the same digests computed the same thing,
byte for byte; a refactoring that claims to change no behaviour is checked this way.

float32 kernels differ between machine kinds (AVX2, AVX-512, native bf16), so digests are
recorded with the kind they were taken on (``machine``) and compared only within a kind:
``--against`` refuses a record of another kind.

    python scripts/run_digests.py outputs/<run> [--out digests.json] [--without-meta KEY]
    python scripts/run_digests.py outputs/<run> --against before.json   # exit 1 on a difference

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
from fedbip_tools.machine import this_machine


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def without_meta(blob: bytes, key: str) -> bytes:
    """The upload re-encoded (deterministically) with its metadata ``key`` left out."""
    names = tuple(read_header(blob)[0])
    tensors, metadata = read_tensors(
        blob, names, len(blob), json.loads(read_header(blob)[1]["fedbip.method"])
    )
    metadata.pop(key, None)
    return encode_tensors(tensors, metadata)


def run_digests(run_dir: Path, drop: str | None = None) -> dict:
    """sha256 of payloads/*, shards/**, classifier.safetensors; metrics' accuracies as written
    (server-side mean and per domain). ``drop``: payloads digested without that metadata key."""
    files = {
        kind: {
            str(p.relative_to(run_dir)): sha256(p)
            for p in sorted((run_dir / kind).rglob("*"))
            if p.is_file() and not p.name.endswith(".tmp")
        }
        for kind in ("payloads", "shards")
    }
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
        "machine": this_machine().kind,
    }


def compare(now: dict, before: dict) -> list[str]:
    """The entries that differ; a record of another machine kind is refused, not compared."""
    if before.get("machine") != now["machine"]:
        raise SystemExit(
            f"the record was taken on a {before.get('machine', 'unnamed')} machine and this one is "
            f"{now['machine']}: float32 digests compare only within a kind"
        )
    keys = sorted(set(now) | set(before))
    return [key for key in keys if now.get(key) != before.get(key)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, help="write the digests here as JSON too")
    parser.add_argument(
        "--without-meta", metavar="KEY", help="digest payloads without this metadata key"
    )
    parser.add_argument(
        "--against", type=Path, help="a record of the same machine kind to compare with"
    )
    args = parser.parse_args()
    digests = run_digests(args.run_dir, args.without_meta)
    text = json.dumps(digests, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    if args.against:
        differ = compare(digests, json.loads(args.against.read_text()))
        print(
            f"differ from {args.against}: {', '.join(differ)}"
            if differ
            else f"same as {args.against}"
        )
        raise SystemExit(1 if differ else 0)


if __name__ == "__main__":
    main()

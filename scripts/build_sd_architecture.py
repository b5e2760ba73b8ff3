"""Build Stable Diffusion v1-4's architecture with random weights as a diffusers folder.

    python scripts/build_sd_architecture.py /tmp/sd-v1-4-random [--seed 0]

Reads the published configs committed in models/sd-v1-4-architecture/ (no weights), initialises
every part with seeded random weights, adds CLIP ViT-L/14's real BPE tokenizer rebuilt offline
(fedbip_tools/clip_bpe.py), checks the parameter counts against the published ones and saves the
folder with safetensors weights (about 4.3 GB in float32: never commit it). The folder loads with
`load_ldm` and `StableDiffusionPipeline.from_pretrained` like the real checkpoint; it has the real
model's shapes, FLOPs and memory, and synthesizes noise. A folder that already holds a complete
build is left as it is (--force rebuilds).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fedbip_tools.sd_architecture import PUBLISHED_PARAMETERS, build_random_sd, parameter_counts

DONE = "build_info.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild an existing folder")
    args = parser.parse_args(argv)
    if (args.folder / DONE).exists() and not args.force:
        print(f"{args.folder} already holds a build: {(args.folder / DONE).read_text()}")
        return 0
    started = time.perf_counter()
    ldm = build_random_sd(args.seed)
    counts = parameter_counts(ldm.unet, ldm.vae, ldm.text_encoder)
    for part, count in counts.items():
        published = PUBLISHED_PARAMETERS[part]
        print(f"{part:13s} {count:>13,d} parameters (published {published:,d})")
        if count != published:
            raise SystemExit(f"{part} has {count:,d} parameters, SD v1-4's has {published:,d}")
    built = time.perf_counter() - started
    ldm.save(args.folder)
    info = {
        "seed": args.seed,
        "parameters": counts,
        "fingerprint": ldm.fingerprint,
        "tokenizer_vocab": len(ldm.tokenizer),
        "seconds_build": round(built, 1),
        "seconds_save": round(time.perf_counter() - started - built, 1),
        "bytes": sum(p.stat().st_size for p in args.folder.rglob("*") if p.is_file()),
    }
    (args.folder / DONE).write_text(json.dumps(info, indent=2))
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""FLOPs of Stable Diffusion v1-4's per-image work in FedBiP, and a GPU time estimate from them.

    python scripts/sd_flops.py [--tflops 250] [--json out.json]

Counts with ``torch.utils.flop_counter.FlopCounterMode`` on the meta device (the committed
configs of models/sd-v1-4-architecture/, no weights allocated, a few seconds): one UNet forward
at a 64 x 64 latent, batch 1; one VAE encode and one VAE decode at 512 px; one text-encoder
forward (77 tokens); one concept step for one image (text encoder + UNet forward and the
backward to the prompt's token embeddings, weights frozen). The GPU estimate divides by an
*assumed* sustained throughput (--tflops, default 250 TFLOP/s: about a quarter of an H100 SXM's
989 TFLOP/s dense bf16/fp16 peak); it is an assumption, not a measurement.
"""

from __future__ import annotations

import argparse
import json

import torch
from accelerate import init_empty_weights
from torch.utils.flop_counter import FlopCounterMode

from fedbip_tools.sd_architecture import build_modules

META = torch.device("meta")


def count(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def measure() -> dict[str, int]:
    with init_empty_weights():
        unet, vae, text, _ = build_modules()
    for module in (unet, vae, text):
        module.requires_grad_(False).eval()
    z = torch.empty(1, 4, 64, 64, device=META)
    image = torch.empty(1, 3, 512, 512, device=META)
    ids = torch.zeros(1, 77, dtype=torch.long, device=META)
    cond = torch.empty(1, 77, 768, device=META)
    t = torch.tensor([500], device=META)

    def concept_step() -> None:
        # Only the token-embedding table takes gradients (as the concepts do): the backward
        # runs through every layer to the inputs, no weight gradient is computed.
        table = text.get_input_embeddings().weight
        table.requires_grad_(True)
        hidden = text(ids).last_hidden_state
        pred = unet(z, t, encoder_hidden_states=hidden).sample
        pred.float().pow(2).mean().backward()
        table.requires_grad_(False)

    with torch.no_grad():
        flops = {
            "unet_forward_64x64_b1": count(lambda: unet(z, t, encoder_hidden_states=cond)),
            "vae_encode_512": count(lambda: vae.encode(image)),
            "vae_decode_512": count(lambda: vae.decode(z)),
            "text_encoder_77": count(lambda: text(ids)),
        }
    flops["concept_step_per_image"] = count(concept_step)
    return flops


def estimate(
    flops: dict[str, int], tflops: float, steps: int = 50, epochs: int = 50, guidance: bool = True
) -> dict[str, float]:
    """Seconds per image at the paper's settings, at ``tflops`` sustained."""
    rate = tflops * 1e12
    client = flops["vae_encode_512"] + epochs * flops["concept_step_per_image"]
    # PNDM (skip_prk_steps, as SD v1-4 ships) evaluates the UNet steps + 1 times: its first
    # step twice (torch's flop counter on an H200 confirmed it: `git show c9d6dee:BENCHMARKS.md`,
    # "On a GPU: NVIDIA H200"; docs/benchmarks/gpu.md's TFLOP/s column counts the same way)
    evaluations = (2 if guidance else 1) * (steps + 1)
    server = evaluations * flops["unet_forward_64x64_b1"] + flops["vae_decode_512"]
    return {
        "client_tflop_per_image": client / 1e12,
        "server_tflop_per_synthetic_image": server / 1e12,
        "client_seconds_per_image": client / rate,
        "server_seconds_per_synthetic_image": server / rate,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tflops", type=float, default=250.0, help="ASSUMED sustained GPU throughput, TFLOP/s"
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    flops = measure()
    result = {
        "flops": flops,
        "assumed_tflops": args.tflops,
        "paper_settings": estimate(flops, args.tflops),
    }
    for name, value in flops.items():
        print(f"{name:26s} {value / 1e9:10.1f} GFLOP")
    print(json.dumps(result["paper_settings"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

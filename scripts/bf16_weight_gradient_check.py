"""The CPU's bfloat16 weight gradients of ResNet-18, at 16 and 32 px inputs, call after call.

Why ``classifier.cpu_bf16_trains_soundly`` refuses bf16 autocast at 16 px: layer4's first
convolution (256 -> 512, 3x3, stride 2) then reads a single pixel. One batch of 5 (the test's
classifier batch) goes forward and back ``--calls`` times under bf16 autocast and channels_last,
as the classifier trains. A sound kernel gives the same gradient every call; its distance from
float64 is then bf16's rounding carried through BatchNorm over 5 images, large at these inputs
in every layer, but of the gradient's own scale.

    python scripts/bf16_weight_gradient_check.py --out benchmarks/bf16_weight_gradient_KIND.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

from fedbip_flwr.storage import write_json
from fedbip_tools import provenance

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("layer3.0.conv1", "layer4.0.conv1", "layer4.0.downsample.0")


def gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The listed layers' weight gradients of one cross-entropy backward pass, as float64."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=x.dtype != torch.float64):
        F.cross_entropy(model(x), y).backward()
    modules = dict(model.named_modules())
    return {name: modules[name].weight.grad.double() for name in LAYERS}


def check(size: int, calls: int) -> dict[str, dict]:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).train()
    x, y = torch.rand(5, 3, size, size) * 2 - 1, torch.tensor([0, 1, 2, 0, 1])
    exact = gradients(model.double(), x.double(), y)
    model = model.float().to(memory_format=torch.channels_last)
    x = x.contiguous(memory_format=torch.channels_last)
    half = [gradients(model, x, y) for _ in range(calls)]
    return {
        name: {
            "max_abs_error": max(float((h[name] - exact[name]).abs().max()) for h in half),
            "distinct_results": len({h[name].numpy().tobytes() for h in half}),
            "exact_scale": float(exact[name].abs().max()),
        }
        for name in LAYERS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = {f"{size} px": check(size, args.calls) for size in (16, 32)}
    for size, layers in sizes.items():
        for name, c in layers.items():
            print(
                f"{size} {name}: max |error| {c['max_abs_error']:.3g} (gradient scale "
                f"{c['exact_scale']:.3g}), {c['distinct_results']} distinct in {args.calls} calls"
            )
    if args.out:
        record = {"calls": args.calls, "sizes": sizes}
        write_json(args.out, {**record, "provenance": provenance.record(ROOT, 1, [args.out])})


if __name__ == "__main__":
    main()

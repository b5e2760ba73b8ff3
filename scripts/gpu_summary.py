"""One readable page from what scripts/gpu_check.sh wrote: OUT_DIR/summary.md.

    python scripts/gpu_summary.py OUT_DIR

Reads gpu_check.log (the stages and how each ended, the CUDA tests' result), sd_gpu_proof.json
and sd_gpu_simulation.json (the 512-px federation deployed and simulated: status, wall time,
phases, payload shapes) and every speed_*.json (the
speed benchmark's own tables), so a lab sees in one page what its GPU did.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from fedbip_flwr.results import SENT_SECONDS
from fedbip_tools.speed import markdown as speed_markdown

ORDER = ["speed_half", "speed_float32", "speed_concept", "speed_compile"]  # gpu_check.sh's order


def stages(log: str) -> list[str]:
    """The `== name: exit N after Ss` lines (and skipped stages), as a list."""
    return [
        line.removeprefix("== ")
        for line in log.splitlines()
        if line.startswith("== ") and ("exit" in line or "skipped" in line)
    ]


def tests_line(log: str) -> str:
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", log, flags=re.M)
    return found[-1] if found else "no test result in the log"


def proof_section(proof: dict) -> list[str]:
    lines = [
        f"Status `{proof.get('status', 'unknown')}` in {proof.get('seconds_wall', float('nan')):.1f} s "
        f"from `flwr run` to its exit (device {proof.get('device', '?')}).",
        "",
        "| phase | seconds | peak RSS (MB) |",
        "|---|---:|---:|",
    ]
    for phase, p in proof.get("phases", {}).items():
        if p:
            lines.append(f"| {phase} | {p['seconds']:.1f} | {p['peak_rss_mb']} |")
    if not any(proof.get("phases", {}).values()):  # a simulation: one process tree, no windows
        lines += [
            f"| {phase} | {seconds:.1f} | |"
            for phase, seconds in recorded_phases(proof.get("metrics", {}))
        ]
        rss = proof.get("processes", {}).get("superlink", {}).get("peak_rss_mb")
        lines += (
            ["", f"The whole simulation (SuperLink, Ray, the apps) peaked at {rss:,} MB RSS."]
            if rss
            else []
        )
    gpu = [r["gpu_mb"] for r in proof.get("samples", []) if r.get("gpu_mb") is not None]
    if gpu:  # device-wide (nvidia-smi each second): the clients' phases overlap
        synthesis = proof.get("phases", {}).get("server: synthesis", {}).get("peak_gpu_mb_device")
        lines += [
            "",
            f"GPU memory in use on the device peaked at {max(gpu):,} MB over the run"
            + (f" and at {synthesis:,} MB during synthesis." if synthesis else "."),
        ]
    lines += ["", "| upload | tensors | bytes |", "|---|---|---:|"]
    for client, shapes in proof.get("payload_shapes", {}).items():
        tensors = ", ".join(f"{k} {v}" for k, v in shapes.items() if not k.startswith("_"))
        lines.append(f"| {client} | {tensors} | {shapes.get('_bytes', 0):,} |")
    return lines


def recorded_phases(metrics: dict) -> list[tuple[str, float]]:
    """Each institution's time and the server's phases, as the run recorded them."""
    found = [
        (f"{c['client_id']}: whole client step", c["metrics"][SENT_SECONDS])
        for c in metrics.get("clients", [])
        if SENT_SECONDS in c.get("metrics", {})
    ]
    return found + [
        (f"server: {phase}", seconds) for phase, seconds in metrics.get("seconds", {}).items()
    ]


def summary(out: Path) -> str:
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    first = log.splitlines()[:3]
    lines = ["# GPU check", "", *(f"    {line}" for line in first), "", "## Stages", ""]
    lines += [f"- {s}" for s in stages(log)] or ["- none ran"]
    lines += ["", f"CUDA tests (`pytest -m cuda tests/test_cuda.py`): {tests_line(log)}.", ""]
    for name, title in (
        ("sd_gpu_proof.json", "through flwr, two SuperNodes"),
        ("sd_gpu_simulation.json", "in Flower's simulation (the README's one-GPU-box command)"),
    ):
        proof = out / name
        if proof.exists():
            lines += [
                f"## SD v1-4's architecture at 512 px {title}",
                "",
                *proof_section(json.loads(proof.read_text())),
                "",
            ]
    for path in sorted(
        out.glob("speed_*.json"),
        key=lambda p: (ORDER.index(p.stem) if p.stem in ORDER else 99, p.stem),
    ):
        result = json.loads(path.read_text())
        command = "fedbip speed " + " ".join(
            f"--{k.replace('_', '-')}={v}"
            for k, v in result["settings"].items()
            if k in ("cases", "batch", "steps", "guidance", "image_size")
        )
        lines += [speed_markdown(result, command).replace("## Speed", f"## Speed ({path.stem})", 1)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    text = summary(args.out)
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Peak server RSS of synthesis + classifier training against the synthetic set's size.

The target: with the shipped miniature model, peak server RSS with multiplier 10 is within
20% of multiplier 2, and with 12 clients within 20% of 3. Each case runs in its own child
process (its peak is ``ru_maxrss`` from ``os.wait4``, so nothing else in this process counts),
once with this tree's code ("after") and once with an older commit's ("before", extracted with
``git archive``, the same child code run with that tree first on ``PYTHONPATH``). Payloads are
made cheaply: the clients' own ``personalize`` with ``fedbip.concept-epochs = 0`` (z(T) exactly as a
client makes it; concepts at their starting phrases). The run config is the default one
(``pyproject.toml``) with fewer denoising steps and classifier epochs, which change time, not
memory.

    python scripts/benchmark_memory.py                       # before (b5dc0f4) and after
    python scripts/benchmark_memory.py --base none           # this tree only

Writes ``benchmarks/memory.json`` and appends a section to docs/benchmarks/memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ((3, 2), (3, 10), (12, 2))  # (clients, multiplier)
CLIENT_DOMAINS = ("sketch", "quickdraw", "painting")


def child(args: argparse.Namespace) -> None:
    """One case, in this process: payloads, synthesize_all, train_global; JSON on stdout."""
    import tomllib

    import torch
    from flwr.common.config import flatten_dict

    from fedbip_flwr import shapes
    from fedbip_flwr.config import FedBiPConfig
    from fedbip_flwr.ldm import load_ldm
    from fedbip_flwr.methods.fedbip import personalize, synthesize_all
    from fedbip_flwr.seeds import client_seed
    from fedbip_flwr.server import RunFolder, train_global

    def peak_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    torch.set_num_threads(args.threads)
    flat = flatten_dict(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    )
    flat.update(
        {
            "fedbip.concept-epochs": 0,
            "synthesis.num-inference-steps": args.steps,
            "synthesis.guidance-scale": args.guidance,
            "classifier.epochs": args.epochs,
            "fedbip.multiplier": args.multiplier,
            "federation.replayable-client-noise": True,
        }
    )
    cfg = FedBiPConfig.from_flat(flat)
    ldm = load_ldm(args.model)
    payloads = {}
    for k in range(args.clients):
        domain, index = CLIENT_DOMAINS[k % 3], k // 3
        client_id = f"{domain}-{index}"
        data = shapes.client_train_set(
            domain, cfg.data.shots_per_class, index, seed=cfg.seed, size=cfg.data.image_size
        )
        payloads[client_id], _ = personalize(
            ldm,
            data.images,
            data.labels,
            list(data.classes),
            domain,
            client_id,
            cfg,
            torch.Generator().manual_seed(client_seed(cfg.seed, client_id)),
        )
    facts = {"after_payloads_mb": peak_mb()}
    folder = RunFolder(Path(args.folder))
    started = time.perf_counter()
    synthetic = synthesize_all(ldm, payloads, cfg, folder.shard_path)
    facts["synthesis_s"] = time.perf_counter() - started
    facts["after_synthesis_mb"] = peak_mb()
    started = time.perf_counter()
    _, trained = train_global(cfg, synthetic, list(shapes.CLASSES), folder, "cpu")
    facts["classifier_s"] = time.perf_counter() - started
    facts["after_training_mb"] = peak_mb()
    facts["images"] = trained["num_synthetic_images"]
    print("RESULT " + json.dumps(facts), flush=True)


def run_case(tree: Path, clients: int, multiplier: int, args: argparse.Namespace) -> dict:
    """The case in a child process with ``tree``'s fedbip_flwr; its own facts and peak RSS."""
    with tempfile.TemporaryDirectory(prefix="fedbip-mem-") as folder:
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            "--clients",
            str(clients),
            "--multiplier",
            str(multiplier),
            "--steps",
            str(args.steps),
            "--guidance",
            str(args.guidance),
            "--epochs",
            str(args.epochs),
            "--threads",
            str(args.threads),
            "--model",
            str(args.model),
            "--folder",
            folder,
        ]
        env = {
            **os.environ,
            "PYTHONPATH": str(tree),
            "FEDBIP_PROJECT_DIR": str(tree),
            "TQDM_DISABLE": "1",
        }
        started = time.perf_counter()
        with tempfile.TemporaryFile("w+") as out:
            proc = subprocess.Popen(
                command, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT
            )
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0)
            text = out.read()
    if proc.returncode != 0:
        raise RuntimeError(f"case {clients} clients x{multiplier} failed:\n{text[-3000:]}")
    facts = json.loads(next(line for line in text.splitlines() if line.startswith("RESULT "))[7:])
    return {
        "clients": clients,
        "multiplier": multiplier,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "wall_s": time.perf_counter() - started,
        **facts,
    }


def extract(commit: str, into: Path) -> Path:
    """The tree of ``commit`` (its code only; the model comes from this tree)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "fedbip_flwr", "pyproject.toml"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def ratio(rows: list[dict], code: str, a: tuple[int, int], b: tuple[int, int]) -> float:
    pick = {(r["clients"], r["multiplier"]): r["peak_rss_mb"] for r in rows if r["code"] == code}
    return pick[b] / pick[a]


def markdown(result: dict) -> str:
    rows, codes = result["cases"], result["codes"]
    lines = [
        "## Peak server RSS against the synthetic set's size",
        "",
        f"`{result['command']}` on {result['machine']}, {result['threads']} torch thread(s), "
        f"load average {result['load_before']} before and {result['load_after']} after "
        f"(the machine was shared with a running test suite); {result['date']}. Each case is its "
        "own child process (peak RSS = its `ru_maxrss`): the default run config with "
        f"{result['steps']} denoising step(s), guidance {result['guidance']} and "
        f"{result['epochs']} classifier epoch(s) "
        "(time, not memory), payloads from `personalize` with `fedbip.concept-epochs = 0`, then "
        f"`synthesize_all` and `train_global`; model: {result['model']}.",
        "",
        "| code | clients | multiplier | synthetic images | peak RSS (MB) | after payloads | "
        "after synthesis | synthesis s | classifier s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['code']} | {r['clients']} | {r['multiplier']} | {r['images']} | "
            f"{r['peak_rss_mb']:.0f} | {r['after_payloads_mb']:.0f} | "
            f"{r['after_synthesis_mb']:.0f} | {r['synthesis_s']:.0f} | {r['classifier_s']:.0f} |"
        )
    lines += ["", "| code | peak RSS x10 / x2 (3 clients) | 12 clients / 3 (x2) |", "|---|---|---|"]
    for code in codes:
        lines.append(
            f"| {code} | {ratio(rows, code, (3, 2), (3, 10)):.3f} | "
            f"{ratio(rows, code, (3, 2), (12, 2)):.3f} |"
        )
    lines += ["", "Target: both ratios at most 1.20.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="b5dc0f4", help="commit measured as 'before'; none: skip")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--guidance",
        type=float,
        default=4.0,
        help="1.0: no classifier-free guidance, half the UNet work",
    )
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch_threads())
    parser.add_argument(
        "--model",
        default=str(ROOT / "models" / "miniature-ldm"),
        help="a diffusers folder, or 'tiny': a random-weight tiny LDM at 64 px "
        "(the same image bytes, a fraction of the UNet's compute)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "memory.json")
    parser.add_argument(
        "--no-markdown", action="store_true", help="do not append to docs/benchmarks/memory.md"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--multiplier", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    command = "python scripts/benchmark_memory.py " + " ".join(sys.argv[1:])
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    trees = {"after": ROOT}
    scratch = Path(tempfile.mkdtemp(prefix="fedbip-base-"))
    try:
        if args.model == "tiny":
            args.model = build_tiny(scratch / "tiny-ldm")
        (scratch / "base").mkdir()
        if args.base != "none":
            trees = {f"before ({args.base})": extract(args.base, scratch / "base"), **trees}
        rows = []
        for clients, multiplier in CASES:  # interleaved: before and after of a case side by side
            for code, tree in trees.items():
                row = {"code": code, **run_case(tree, clients, multiplier, args)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {
        "command": command.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "threads": args.threads,
        "steps": args.steps,
        "guidance": args.guidance,
        "model": model_name(args.model),
        "epochs": args.epochs,
        "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "codes": list(trees),
        "cases": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    print(text)
    if not args.no_markdown:
        with open(ROOT / "docs" / "benchmarks" / "memory.md", "a") as handle:
            handle.write("\n" + text)


def model_name(model: str | Path) -> str:
    if "tiny-ldm" in str(model):
        return "tiny (random weights, 64 px)"
    path = Path(model).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def build_tiny(folder: Path) -> Path:
    """The tests' tiny LDM architecture at the default run's 64 px, saved in diffusers layout."""
    import dataclasses

    from fedbip_flwr import shapes
    from fedbip_tools.build_ldm import TINY, build_ldm

    words = [*shapes.CLASSES, *shapes.DOMAINS, "a", "style", "of"]
    build_ldm(dataclasses.replace(TINY, image_size=64), words, seed=0).save(folder)
    return folder


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()

"""Stable Diffusion v1-4's architecture at 512 px through the real Flower deployment engine.

    FEDBIP_ALLOW_SD_ON_CPU=1 python scripts/sd_proof.py WORK_DIR [--model /tmp/sd-v1-4-random]
    python scripts/sd_proof.py WORK_DIR --device cuda     # on a GPU (scripts/gpu_check.sh)

Two institutions with DomainNet's prompt template, real CLIP tokens for their domain phrases
("quickdraw" = quick draw, "clipart" = cli part) and a few images each in their own folder (the
built-in world's images, class folders named after DomainNet classes, resized to 512 px), one
SuperLink and two SuperNodes (``--insecure``, all on 127.0.0.1: a simulation cannot give each
node its own node config, which dataset "imagefolder" needs), then ``flwr run`` with 1 concept
epoch, 3 PNDM steps, multiplier 1 and 1 classifier epoch. While it runs, every process of the
federation is sampled each second (RSS, threads; on CUDA the GPU memory in use) with the load
average; WORK_DIR/proof.json gets the timeline, the peaks per process and phase, the payload
shapes and metrics.json. Every process started here is stopped by PID. Exit status 0 only if
the run completed.

The model folder is built first if missing (scripts/build_sd_architecture.py, ~4.3 GB).
On the CPU it needs ~12 GB of free memory (three processes map the 4.3 GB model; the two
institutions run concurrently) and ~40 min on 2 cores shared with other jobs (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import psutil
import tomli_w

from fedbip_flwr import results
from fedbip_flwr.results import SENT_SECONDS, RunResults, Seconds
from fedbip_tools.simulation import (
    SimulationError,
    flwr_tool,
    free_port,
    run_simulation,
    run_status,
    stop_local_superlink,
    stop_process_tree,
    superlink_processes,
    wait_for_port,
)

ROOT = Path(__file__).resolve().parents[1]
CLASSES = {"circle": "airplane", "square": "clock"}  # built-in shape folder -> DomainNet class
INSTITUTIONS = ("quickdraw", "clipart")
RUN_CONFIG = {
    "data.dataset": '"imagefolder"',
    "data.classes": '"' + ",".join(CLASSES.values()) + '"',
    "data.prompt-template": '"A {S} of {V}."',  # DomainNet's (Table 5), n_s = n_v = 1
    "data.n-s": "1",
    "data.n-v": "1",
    "data.image-size": "512",
    "fedbip.concept-epochs": "1",
    "fedbip.concept-batch-size": "2",
    "synthesis.num-inference-steps": "3",
    "synthesis.guidance-scale": "7.5",
    "fedbip.multiplier": "1",
    "ldm.vae-batch-size": "2",
    "synthesis.batch-size": "2",
    "classifier.init": '"random"',
    "classifier.epochs": "1",
    "classifier.image-size": "512",
    "classifier.batch-size": "8",
    "federation.evaluation": '"clients"',
    "federation.min-clients": "2",
    "federation.wait-for-clients-s": "600.0",
    "federation.reply-timeout-s": "7200.0",
}


def python_path() -> str:
    """This checkout first, then whatever PYTHONPATH already holds (carried wheels)."""
    return os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))


def write_institution(folder: Path, domain: str, shots: int, test: int, index: int) -> Path:
    """The built-in world's images of ``domain``, two classes renamed to DomainNet's."""
    from fedbip_flwr.shapes import write_image_folder

    if folder.exists():
        shutil.rmtree(folder)
    write_image_folder(folder, domain, shots, test, client_index=index, size=64)
    for split in ("train", "test"):
        for sub in (folder / split).iterdir():
            if sub.name in CLASSES:
                sub.rename(folder / split / f"_{CLASSES[sub.name]}")
            else:
                shutil.rmtree(sub)
        for sub in (folder / split).iterdir():
            sub.rename(folder / split / sub.name[1:])
    return folder


class Sampler(threading.Thread):
    """Each second: RSS and threads of every process under the given roots, and the load."""

    def __init__(self, roles: dict[int, str], gpu: bool = False):
        super().__init__(daemon=True)
        self.roles, self.samples, self.stop_flag = roles, [], threading.Event()
        self.started, self.gpu = time.time(), gpu
        self.discover: Callable[[], dict[int, str]] = dict  # roots that appear while it runs

    @staticmethod
    def gpu_used_mb() -> int | None:
        """GPU memory in use on the whole device (nvidia-smi), MiB."""
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        return int(out[0]) if out and out[0].isdigit() else None

    def role_of(self, proc: psutil.Process, root_role: str) -> str:
        cmd = " ".join(proc.cmdline())
        if "flwr-serverapp" in cmd:
            return "serverapp"
        if "flwr-clientapp" in cmd:
            return f"clientapp-{root_role.split('-', 1)[1]}"
        return root_role

    def run(self) -> None:
        while not self.stop_flag.wait(1.0):
            row = {
                "t": round(time.time() - self.started, 1),
                "load1": os.getloadavg()[0],
                "procs": {},
            }
            self.roles.update(self.discover())
            for pid, role in list(self.roles.items()):
                try:
                    root = psutil.Process(pid)
                    family = [(root, role)] + [(c, None) for c in root.children(recursive=True)]
                    for proc, known in family:
                        name = known or self.role_of(proc, role)
                        info = proc.memory_info().rss, proc.num_threads()
                        old = row["procs"].get(name, (0, 0))
                        row["procs"][name] = (old[0] + info[0], old[1] + info[1])
                except psutil.NoSuchProcess:
                    continue
            if self.gpu:
                row["gpu_mb"] = self.gpu_used_mb()
            self.samples.append(row)


def payload_shapes(run: Path) -> dict:
    from safetensors import safe_open

    shapes = {}
    for path in sorted((run / "payloads").glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            shapes[path.stem] = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
            shapes[path.stem]["_bytes"] = path.stat().st_size
    return shapes


def phase_peaks(samples: list[dict]) -> dict:
    """Peak RSS (MB) and threads per process over the whole run."""
    peaks: dict[str, dict] = {}
    for row in samples:
        for name, (rss, threads) in row["procs"].items():
            p = peaks.setdefault(name, {"peak_rss_mb": 0, "max_threads": 0, "first_t": row["t"]})
            p["peak_rss_mb"] = max(p["peak_rss_mb"], round(rss / 2**20))
            p["max_threads"] = max(p["max_threads"], threads)
            p["last_t"] = row["t"]
    return peaks


def window_peak(samples: list[dict], name: str, start: float, end: float) -> dict:
    rows = [r for r in samples if name in r["procs"] and start <= r["t"] <= end]
    if not rows:
        return {}
    return {
        "seconds": round(end - start, 1),
        "peak_rss_mb": round(max(r["procs"][name][0] for r in rows) / 2**20),
        "max_threads": max(r["procs"][name][1] for r in rows),
        "mean_load1": round(sum(r["load1"] for r in rows) / len(rows), 2),
        **(
            {"peak_gpu_mb_device": max(r["gpu_mb"] or 0 for r in rows)}
            if "gpu_mb" in rows[0]
            else {}
        ),
    }


def first_block(samples: list[dict], name: str) -> tuple[float, float] | None:
    """First and last time of the first unbroken run of samples in which ``name`` is alive:
    a ClientApp process lives for one message (train, later evaluate)."""
    block: tuple[float, float] | None = None
    for row in samples:
        if name in row["procs"]:
            block = (block[0] if block else row["t"], row["t"])
        elif block:
            break
    return block


def phases(samples: list[dict], record: RunResults, sampler_started: float | None = None) -> dict:
    """Peak RSS per phase: windows from the run's own timings, placed on the sampled timeline.

    A client's train process is placed by its first unbroken run of samples: its timed phases
    (instance, then concept) end when the process does, and what comes before them is start-up
    (imports, data, the model). The server's phases start at its ``started_unix`` and follow
    in the order they run. Windows are accurate to the ~1 s sampling.
    """
    found: dict[str, dict] = {}
    for client in record.clients or []:
        name = f"clientapp-{client.domain}"
        block = first_block(samples, name)
        m = client.metrics or {}
        if block is None or SENT_SECONDS not in m:
            continue
        first, end = block
        concept = end - m["seconds-concept"]
        instance = concept - m["seconds-instance"]
        found[f"{client.client_id}: start, data, model load"] = window_peak(
            samples, name, first, instance
        )
        found[f"{client.client_id}: instance (VAE encode, z(T))"] = window_peak(
            samples, name, instance, concept
        )
        found[f"{client.client_id}: concept learning"] = window_peak(samples, name, concept, end)
    server = first_block(samples, "serverapp")
    windows = server_windows(record.seconds or Seconds())
    if server is not None:
        if record.started_unix is not None and sampler_started is not None:
            t = record.started_unix - sampler_started  # the ServerApp's own clock zero
        else:  # back from the process's end (a few seconds of report writing late)
            t = server[1] - sum(windows.values())
        for phase, span in windows.items():
            found[f"server: {phase}"] = window_peak(samples, "serverapp", t, t + span)
            t += span
    return found


def server_windows(seconds: Seconds) -> dict[str, float]:
    """Each server phase's span in the order they run; the model loads inside the round, so
    the round's window holds both."""
    windows = seconds.model_dump(exclude_none=True, exclude={"load_model"})
    if seconds.round is not None:
        windows["round"] += seconds.load_model or 0.0
    return windows


SIMULATION_CONF = ROOT / "conf" / "sd-v1-4-gpu.toml"
SIMULATION_FEDERATION = "num-supernodes=3 client-resources-num-gpus=0.3"  # the README's
SIMULATION_RUN_CONFIG = {  # over SIMULATION_CONF: a few minutes, random weights, offline
    "fedbip.concept-epochs": 1,
    "synthesis.num-inference-steps": 10,
    "classifier.init": "random",  # ImageNet's weights cannot be downloaded offline
    "classifier.epochs": 1,
}


def deploy(args: argparse.Namespace, work: Path, env: dict, sampler: Sampler, result: dict) -> Path:
    """One SuperLink, two SuperNodes on their own folders, then ``flwr run``; the run folder."""
    home, logs = Path(env["FLWR_HOME"]), work / "logs"
    link_port, api_ports = free_port(), [free_port(), free_port()]
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "sd"\n\n[superlink.sd]\naddress = "127.0.0.1:{link_port}"\n'
        "insecure = true\n"
    )
    procs: list[subprocess.Popen] = []

    def start(name: str, cmd: list[str]) -> subprocess.Popen:
        out = open(logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        sampler.roles[proc.pid] = name
        return proc

    run_name = f"sd-{args.device}-proof"
    result["run_config"] = RUN_CONFIG
    try:
        link = start(
            "superlink",
            [
                flwr_tool("flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(link_port),
                "--disable-runtime-dependency-installation",
            ],
        )
        wait_for_port(link_port, link, logs / "superlink.log", timeout=90)
        for i, domain in enumerate(INSTITUTIONS):
            data = write_institution(
                work / "data" / domain, domain, args.shots, args.test_per_class, i
            )
            node_config = (
                f'data-root="{data}" domain="{domain}" client-id="{domain}-0" '
                f'output-dir="{work / "institutions" / domain}"'
            )
            start(
                f"supernode-{domain}",
                [
                    flwr_tool("flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{link_port}",
                    "--port",
                    str(api_ports[i]),
                    "--node-config",
                    node_config,
                ],
            )
        values = {
            **RUN_CONFIG,
            "ldm.model": f'"{args.model}"',
            "output-dir": f'"{work / "outputs"}"',
            "ldm.device": f'"{args.device}"',
            "run-name": f'"{run_name}"',
        }
        run_config = " ".join(f"{k}={v}" for k, v in values.items())
        result["command"] = ["flwr", "run", str(ROOT), "sd", "--stream", "--run-config", run_config]
        started = time.time()
        result["run_started_t"] = round(started - sampler.started, 1)
        proc = subprocess.run(
            [flwr_tool("flwr"), "run", str(ROOT), "sd", "--stream", "--run-config", run_config],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            check=False,
        )
        result["seconds_wall"] = round(time.time() - started, 1)
        (logs / "flwr-run.log").write_text(proc.stdout + proc.stderr)
        match = re.search(r"Successfully started run (\d+)", proc.stdout + proc.stderr)
        if match:
            status = subprocess.run(
                [flwr_tool("flwr"), "ls", "sd", "--run-id", match.group(1), "--format", "json"],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            try:
                result["status"] = json.loads(status.stdout)["runs"][0]["status"]
            except (ValueError, KeyError, IndexError):
                result["status"] = f"unknown: {status.stdout[-500:]}"
    finally:
        for proc in reversed(procs):
            stop_process_tree(proc.pid)
    return work / "outputs" / run_name


def simulate(
    args: argparse.Namespace, work: Path, env: dict, sampler: Sampler, result: dict
) -> Path:
    """The README's one-box command through Flower's simulation engine (Ray), its clients and
    the ServerApp sharing the device: ``conf/sd-v1-4-gpu.toml`` with the model, the sizes and
    the epochs changed (SIMULATION_RUN_CONFIG); the run folder. The SuperLink that ``flwr run``
    starts is sampled as it appears, with all its children."""
    home = Path(env["FLWR_HOME"])
    run_name = f"sd-{args.device}-simulation"
    changed = {
        **SIMULATION_RUN_CONFIG,
        "model": str(args.model),
        "device": args.device,
        "data.shots-per-class": args.shots,
        "data.test-per-class": args.test_per_class,
        "data.image-size": args.image_size,
        "classifier.image-size": args.image_size,
        "output-dir": str(work / "outputs"),
        "run-name": run_name,
        **dict(toml_pair(pair) for pair in args.set),
    }
    conf = work / SIMULATION_CONF.name  # Flower takes one TOML file or key=value pairs, not both
    conf.write_text(tomli_w.dumps({**tomllib.loads(SIMULATION_CONF.read_text()), **changed}))
    result["run_config"] = changed
    result["command"] = [
        "flwr",
        "run",
        str(ROOT),
        "--stream",
        "--run-config",
        str(conf),
        "--federation-config",
        args.federation_config,
    ]
    sampler.discover = lambda: {p.pid: "superlink" for p in superlink_processes(home)}
    started = time.time()
    result["run_started_t"] = round(started - sampler.started, 1)
    try:
        run_id, output = run_simulation(
            home, str(conf), 0, args.timeout, ROOT, env=env, federation=args.federation_config
        )
        (work / "logs" / "flwr-run.log").write_text(output)
        try:
            result["status"] = run_status(home, run_id)
        except SimulationError as err:
            result["status"] = f"unknown: {err}"[:1000]
    finally:
        result["seconds_wall"] = round(time.time() - started, 1)
        stop_local_superlink(home)
    return work / "outputs" / run_name


def toml_pair(pair: str) -> tuple[str, object]:
    """``KEY=VALUE`` with the value read as TOML (``ldm.compile-unet=true``)."""
    key, sep, value = pair.partition("=")
    if not sep:
        raise SystemExit(f"--set takes KEY=VALUE, got {pair!r}")
    return key.strip(), tomllib.loads(f"v = {value}")["v"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--model", type=Path, default=Path("/tmp/sd-v1-4-random"))
    parser.add_argument("--shots", type=int, default=3, help="training images per class")
    parser.add_argument("--test-per-class", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=7200)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--engine",
        choices=("deployment", "simulation"),
        default="deployment",
        help="simulation: the README's one-box command (conf/sd-v1-4-gpu.toml, Ray)",
    )
    parser.add_argument(
        "--federation-config",
        default=SIMULATION_FEDERATION,
        help="simulation only: flwr run's --federation-config",
    )
    parser.add_argument("--image-size", type=int, default=512, help="simulation only")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="simulation only: one more run-config value, e.g. ldm.compile-unet=true",
    )
    args = parser.parse_args(argv)
    work = args.work.resolve()
    # a proof measures a whole round: an earlier proof's run folder would let the ServerApp
    # resume from its uploads, and its clients would never run
    shutil.rmtree(work / "outputs", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    if not (args.model / "build_info.json").exists():
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "build_sd_architecture.py"), str(args.model)],
            check=True,
            env={**os.environ, "PYTHONPATH": python_path()},
        )
    home = work / "flwr-home"
    home.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FEDBIP_PROJECT_DIR": str(ROOT),
        "FEDBIP_ALLOW_SD_ON_CPU": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": python_path(),
    }
    result: dict = {"engine": args.engine, "model": str(args.model), "device": args.device}
    sampler = Sampler({}, gpu=args.device == "cuda")
    sampler.start()
    try:
        engine = simulate if args.engine == "simulation" else deploy
        run = engine(args, work, env, sampler, result)
    finally:
        sampler.stop_flag.set()
        sampler.join()
    record = results.read(run) if (run / results.FILE_NAME).exists() else None
    result.update(
        metrics=record.model_dump(exclude_none=True) if record else {},
        payload_shapes=payload_shapes(run) if run.exists() else {},
        processes=phase_peaks(sampler.samples),
        phases=phases(sampler.samples, record, sampler.started) if record else {},
        sampler_started_unix=sampler.started,
        max_load1=max((r["load1"] for r in sampler.samples), default=0),
        samples=sampler.samples,
    )
    (work / "proof.json").write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in result.items() if k not in ("samples", "metrics")}
    print(json.dumps(summary, indent=1))
    return 0 if result.get("status") == "finished:completed" else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Running the real `flwr run` in tests: own FLWR_HOME and port, every process stopped by PID."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
FLWR = str(Path(sys.executable).with_name("flwr"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flwr_env(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FEDBIP_PROJECT_DIR": str(ROOT),
        "HF_HUB_OFFLINE": "1",
    }


def run_simulation(
    home: Path, run_config: str, supernodes: int, timeout: float, app: Path = ROOT
) -> tuple[int, str]:
    """`flwr run APP --stream` on the local simulation SuperLink; returns (run id, output)."""
    home.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [FLWR, "run", str(app), "--stream", "--run-config", run_config,
         "--federation-config", f"num-supernodes={supernodes} client-resources-num-cpus=1"],
        cwd=home, env=flwr_env(home), capture_output=True, text=True, timeout=timeout, check=False,
    )
    output = proc.stdout + proc.stderr
    match = re.search(r"Successfully started run (\d+)", output)
    assert match, f"flwr run did not start a run:\n{output[-4000:]}"
    return int(match.group(1)), output


def run_status(home: Path, run_id: int) -> str:
    proc = subprocess.run(
        [FLWR, "ls", "--run-id", str(run_id), "--format", "json"],
        cwd=home, env={**os.environ, "FLWR_HOME": str(home)}, capture_output=True, text=True,
        timeout=60, check=False,
    )
    runs = json.loads(proc.stdout)["runs"]
    return runs[0]["status"]


def stop_local_superlink(home: Path) -> list[int]:
    """Kill the SuperLink that `flwr run` auto-started for this FLWR_HOME, and its children."""
    database = str(home / "local-superlink" / "state.db")
    stopped = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if database in " ".join(proc.info["cmdline"] or []):
            family = [proc, *proc.children(recursive=True)]
            for member in family:
                member.kill()
            psutil.wait_procs(family, timeout=20)
            stopped += [p.pid for p in family]
    return stopped


def stop_process_tree(pid: int, timeout: float = 20) -> list[int]:
    """Stop a process and all its descendants: SIGTERM, then SIGKILL; returns the PIDs."""
    try:
        root = psutil.Process(pid)
        family = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return []
    for member in family:
        try:
            member.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=timeout)
    for member in alive:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    return [member.pid for member in family]


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains ``text`` (e.g. a test's tmp folder)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and text in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


def free_port_block(count: int) -> int:
    """A port p such that p .. p+count-1 are all free on 127.0.0.1 right now."""
    for _ in range(100):
        first = free_port()
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first + 1, first + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"found no block of {count} free ports on 127.0.0.1")


def wait_for_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    """Until something listens on 127.0.0.1:port; fail with the log if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise AssertionError(f"nothing listens on port {port} after {timeout} s:\n{log.read_text()[-4000:]}")

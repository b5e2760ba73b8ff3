"""Running the real ``flwr run`` from Python: the benchmark's runs and the end-to-end tests.

Each caller gives its own ``FLWR_HOME``, where ``flwr run`` auto-starts a local simulation
SuperLink on a port of its own (derived from the home, :func:`superlink_port`), so several runs
(benchmark seeds in parallel, tests, a user's own ``flwr run .``) never share a SuperLink, and
``flwr ls`` asks the SuperLink that ran the run; :func:`stop_local_superlink` stops it by its
state database's path when the caller is done. Runs execute in this Python environment, offline
(``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from fedbip_flwr.paths import project_dir


def flwr_tool(name: str) -> str:
    """A Flower command (``flwr``, ``flower-superlink``...) beside this Python, else on PATH
    (where Flower was installed with ``pip --target``, as on a lent GPU machine)."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name) or str(beside)


FLWR = flwr_tool("flwr")


class SimulationError(RuntimeError):
    """``flwr run`` did not start a run; the message holds the end of its output."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(
    port: int, proc: subprocess.Popen, log: Path | None = None, timeout: float = 60
) -> None:
    """Until something listens on 127.0.0.1:port; fail with ``log``'s tail if ``proc`` exits first."""

    def tail() -> str:
        return f":\n{log.read_text()[-4000:]}" if log is not None and log.exists() else ""

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}{tail()}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s{tail()}")


def superlink_port(home: Path) -> int:
    """The port of this FLWR_HOME's local SuperLink, the same on every call, so every ``flwr``
    command of the home (``run``, ``ls``) reaches the same SuperLink. Flower's default port
    would reach whichever SuperLink holds it, e.g. one a user's own ``flwr run .`` left
    running, which knows none of this home's runs. Derived from the home's path (below Linux's
    ephemeral range), moving on past ports that something else holds; nothing is written."""
    digest = hashlib.sha256(str(home.resolve()).encode()).digest()
    first = 20000 + int.from_bytes(digest[:4], "big") % 12000
    ours = " ".join(" ".join(p.info["cmdline"] or []) for p in superlink_processes(home))
    for port in range(first, first + 100):
        if f"--port {port} " in f"{ours} " or port_is_free(port):
            return port
    raise SimulationError(f"no free port for {home}'s SuperLink in {first}-{first + 99}")


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def flwr_env(home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment plus the run's own FLWR_HOME and SuperLink port, offline."""
    root = project_dir()
    return {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(superlink_port(home)),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "HF_HUB_OFFLINE": "1",
        **({"FEDBIP_PROJECT_DIR": str(root)} if root else {}),
        **(extra or {}),
    }


def toml_value(value: Any) -> str:
    """A run-config value as ``--run-config`` reads it (TOML: strings quoted, bools lowercase)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def run_config_arg(values: Mapping[str, Any]) -> str:
    return " ".join(f"{key}={toml_value(value)}" for key, value in values.items())


def run_simulation(
    home: Path,
    run_config: str | Mapping[str, Any],
    supernodes: int,
    timeout: float,
    app: Path | None = None,
    *,
    cpus_per_client: int = 1,
    env: Mapping[str, str] | None = None,
    actors: int | None = None,
    federation: str | None = None,
) -> tuple[int, str]:
    """``flwr run APP --stream`` on this home's local simulation SuperLink; (run id, output).

    ``run_config`` is ``--run-config``'s text (key=value pairs or a TOML file's path) or a dict
    of values. ``env`` adds variables to the processes (e.g. ``OMP_NUM_THREADS``); the SuperLink,
    started by the first run of a home, keeps those it started with. ``actors`` caps how many
    ClientApp processes run at once (default: as many as the cores allow,
    :func:`federation_config`); ``federation`` replaces the whole ``--federation-config`` text
    (``supernodes`` then unused).
    """
    home.mkdir(parents=True, exist_ok=True)
    text = run_config if isinstance(run_config, str) else run_config_arg(run_config)
    federation = federation or federation_config(supernodes, cpus_per_client, actors)
    proc = subprocess.run(
        [
            FLWR,
            "run",
            str(app or project_dir() or Path.cwd()),
            "--stream",
            "--run-config",
            text,
            "--federation-config",
            federation,
        ],
        cwd=home,
        env=flwr_env(home, env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = proc.stdout + proc.stderr
    match = re.search(r"Successfully started run (\d+)", output)
    if not match:
        raise SimulationError(f"flwr run did not start a run:\n{output[-4000:]}")
    return int(match.group(1)), output


def federation_config(supernodes: int, cpus_per_client: int = 1, actors: int | None = None) -> str:
    """``--federation-config`` for ``supernodes`` simulated clients.

    Ray starts one ClientApp process (actor) per ``cpus_per_client`` of the cores it is given;
    each imports torch and diffusers (~10 CPU-seconds) before serving clients in turn. With
    ``actors`` Ray is given only ``actors * cpus_per_client`` cores, so no more actors start: on a
    machine already busy (a test worker beside another) a second actor only adds its start-up.
    """
    federation = f"num-supernodes={supernodes} client-resources-num-cpus={cpus_per_client}"
    if actors is not None:
        federation += f" init-args-num-cpus={actors * cpus_per_client}"
    return federation


def run_status(home: Path, run_id: int) -> str:
    """The run's status as Flower records it, e.g. ``finished:completed``."""
    home.mkdir(parents=True, exist_ok=True)  # flwr runs in the home, as for `flwr run`
    proc = subprocess.run(
        [FLWR, "ls", "--run-id", str(run_id), "--format", "json"],
        cwd=home,
        env=flwr_env(home),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    try:
        return json.loads(proc.stdout)["runs"][0]["status"]
    except (ValueError, KeyError, IndexError) as err:
        raise SimulationError(
            f"flwr ls --run-id {run_id} gave no status:\n{proc.stdout}{proc.stderr}"
        ) from err


def superlink_processes(home: Path) -> list[psutil.Process]:
    """The SuperLinks that ``flwr`` auto-started for this FLWR_HOME (found by their database)."""
    database = str(home / "local-superlink" / "state.db")
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.NoSuchProcess):
            if database in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
    return found


def stop_process_tree(pid: int, timeout: float = 20) -> list[int]:
    """Stop a process and all its descendants: SIGTERM, then SIGKILL; returns the PIDs."""
    try:
        root = psutil.Process(pid)
        family = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return []
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.terminate()
    _, alive = psutil.wait_procs(family, timeout=timeout)
    for member in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(alive, timeout=timeout)
    return [member.pid for member in family]


def stop_local_superlink(home: Path) -> list[int]:
    """Kill the SuperLink that ``flwr run`` auto-started for this FLWR_HOME, and its children."""
    stopped = []
    for proc in superlink_processes(home):
        try:
            family = [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:  # it ended on its own meanwhile
            continue
        for member in family:
            with contextlib.suppress(psutil.NoSuchProcess):  # a child that just exited
                member.kill()
        psutil.wait_procs(family, timeout=20)
        stopped += [p.pid for p in family]
    return stopped

"""Running the real `flwr run` in tests: own FLWR_HOME and port, every process stopped by PID."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import psutil

from fedbip_tools import simulation
from fedbip_tools.simulation import (
    FLWR,
    federation_config,
    free_port,
    run_status,
    stop_local_superlink,
    stop_process_tree,
    wait_for_port,
)

__all__ = [
    "FLWR", "ROOT", "federation", "flwr_env", "free_port", "free_port_block", "processes_mentioning",
    "run_simulation", "run_status", "stop_local_superlink", "stop_process_tree", "wait_for_port",
]  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]
# The checkout under test, not necessarily the one pip installed in editable mode.
CHECKOUT = {"FEDBIP_PROJECT_DIR": str(ROOT)}


# A test run's clients take turns in one Ray actor. The suite runs on two workers sharing the
# cores, so a second actor would only add its start-up (importing torch and diffusers) to every
# `flwr run`; what the tests check does not depend on two clients personalizing at once.
ACTORS = 1


def federation(supernodes: int) -> str:
    """A test run's ``--federation-config`` (for tests that build the `flwr run` command)."""
    return federation_config(supernodes, cpus_per_client=1, actors=ACTORS)


def flwr_env(home: Path) -> dict[str, str]:
    return simulation.flwr_env(home, CHECKOUT)


def run_simulation(
    home: Path, run_config: str, supernodes: int, timeout: float, app: Path = ROOT
) -> tuple[int, str]:
    """`flwr run APP --stream` on the local simulation SuperLink; returns (run id, output)."""
    return simulation.run_simulation(home, run_config, supernodes, timeout, app, env=CHECKOUT, actors=ACTORS)


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



"""docker/compose.yaml for real: build, bring the topology up, run the federation, tear down.

Opt-in (`python -m pytest -m compose tests/test_compose.py`): it needs root, podman with
podman-compose, debootstrap, and Debian's and Python's package repositories; the first run
builds the base images (docker/local-images.sh), later runs reuse them. No image registry is
needed: the official Flower images are replaced by local stand-ins through the build argument
and image variables that compose.yaml exposes for this.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.flower_helpers import FLWR, ROOT, free_port
from tests.test_flower_e2e import SMALL, as_run_config

pytestmark = pytest.mark.compose

COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
FLOWER_STAND_IN = "localhost/flwr-local:1.41.0"
EXECUTOR_BASE = "localhost/flwr-local-torch:1.41.0"
PIP_CERT = "/etc/ssl/certs/ca-certificates.crt"
BUILD_ARGS = "--network host --ulimit nofile=20000:20000 -v /etc/ssl/certs:/etc/ssl/certs:ro"
CONTAINER_UID = 49999  # the user Flower's images run as
INSTITUTIONS = 3
REQUIRED_TOOLS = ("podman", "podman-compose", "debootstrap", "openssl", "ssh-keygen")


def run(args: list[str], env: dict, timeout: float, what: str) -> str:
    proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{output[-6000:]}"
    return output


@pytest.fixture(scope="module")
def topology(tiny_model_dir):
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the compose test needs {', '.join(missing)} on PATH "
                    "(apt-get install podman runc debootstrap; pip install podman-compose)")
    if os.geteuid() != 0:
        pytest.fail("the compose test runs as root (debootstrap and rootful podman)")

    # Outside pytest's private tmp folder: the containers' user must read the mounted files.
    work = Path(tempfile.mkdtemp(prefix="fedbip-compose-"))
    work.chmod(0o755)
    project = f"fedbip-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {
        **os.environ,
        "CONTAINERS_CONF": os.environ.get(
            "CONTAINERS_CONF", str(ROOT / "docker" / "podman-containers.conf")),
        "FLWR_SUPERLINK_IMAGE": FLOWER_STAND_IN,
        "FLWR_SUPERNODE_IMAGE": FLOWER_STAND_IN,
        "SUPEREXEC_BASE_IMAGE": EXECUTOR_BASE,
        "PIP_INSTALL_ARGS": f"--cert {PIP_CERT}",
        "FEDBIP_CREDENTIALS": str(work / "credentials"),
        "FEDBIP_MODELS": str(work / "models"),
        "SUPERLINK_PORT": str(port),
        "FLWR_HOME": str(work / "flwr-home"),
    }
    compose = ["podman-compose", "-f", str(COMPOSE_FILE), "-p", project]
    try:
        started = time.monotonic()
        run([str(ROOT / "docker" / "local-images.sh")], env, 3600, "building the base images")
        run([str(ROOT / "deploy" / "make-credentials.sh"), "-o", str(CONTAINER_UID),
             str(work / "credentials"), str(INSTITUTIONS), "superlink"], env, 60, "credentials")
        shutil.copytree(tiny_model_dir, work / "models" / "tiny-ldm")
        for path in [work / "models", *(work / "models").rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        (work / "flwr-home").mkdir()
        (work / "flwr-home" / "config.toml").write_text(
            '[superlink]\ndefault = "fedbip-compose"\n\n'
            f'[superlink.fedbip-compose]\naddress = "127.0.0.1:{port}"\n'
            f'root-certificates = "{work / "credentials" / "ca" / "ca.crt"}"\n'
        )
        run([*compose, "--podman-build-args", BUILD_ARGS, "up", "--build", "-d"], env, 3600,
            "podman-compose up")
        seconds_up = time.monotonic() - started
        yield {"env": env, "project": project, "compose": compose, "seconds_up": seconds_up}
    finally:
        down = subprocess.run([*compose, "down", "-v"], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=600, check=False)
        shutil.rmtree(work, ignore_errors=True)
        left = subprocess.run(
            ["podman", "ps", "-a", "-q", "--filter", f"label=io.podman.compose.project={project}"],
            env=env, capture_output=True, text=True, timeout=60, check=False).stdout.split()
    assert down.returncode == 0, f"podman-compose down failed:\n{down.stdout}{down.stderr}"
    assert left == [], f"containers of {project} survived the teardown: {left}"


def logs(topology) -> str:
    proc = subprocess.run([*topology["compose"], "logs"], env=topology["env"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    return (proc.stdout + proc.stderr)[-8000:]


def flwr_json(topology, *args: str) -> dict:
    proc = subprocess.run([FLWR, *args, "--format", "json"], env=topology["env"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def test_compose_federation_runs_to_completion(topology):
    # The "register" service registers the three keys; each SuperNode is then accepted.
    deadline = time.monotonic() + 600
    statuses: list[str] = []
    while statuses.count("online") < INSTITUTIONS:
        assert time.monotonic() < deadline, f"SuperNodes: {statuses}\n{logs(topology)}"
        time.sleep(5)
        statuses = [n["status"] for n in flwr_json(topology, "supernode", "ls").get("nodes", [])]

    # The default federation, shrunk: same relative model and output paths as pyproject's.
    values = {**SMALL, "model": '"models/tiny-ldm"', "run-name": '"compose"'}
    run_started = time.monotonic()
    output = run([FLWR, "run", ".", "fedbip-compose", "--stream", "--run-config",
                  as_run_config(values)], topology["env"], 1800, "flwr run")
    run_id = next(line.split()[-1] for line in output.splitlines()
                  if line.startswith("Successfully started run"))
    runs = flwr_json(topology, "ls", "--run-id", run_id)["runs"]
    assert runs[0]["status"] == "finished:completed", output[-6000:] + logs(topology)

    volume = f"{topology['project']}_server-outputs"
    mountpoint = subprocess.run(
        ["podman", "volume", "inspect", volume, "--format", "{{.Mountpoint}}"],
        env=topology["env"], capture_output=True, text=True, timeout=60, check=True,
    ).stdout.strip()
    folder = Path(mountpoint) / "compose"
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["status"] == "completed"
    accepted = sorted(c["client_id"] for c in metrics["clients"] if c["status"] == "accepted")
    assert accepted == ["painting-0", "quickdraw-0", "sketch-0"]
    assert set(metrics["accuracy"]["per_domain"]) == {"sketch", "quickdraw", "painting"}
    assert (folder / "classifier.safetensors").stat().st_size > 1_000_000
    assert sorted(p.name for p in (folder / "payloads").glob("*.safetensors")) == [
        "painting-0.safetensors", "quickdraw-0.safetensors", "sketch-0.safetensors"]
    print(f"compose: built and up in {topology['seconds_up']:.0f} s, "
          f"run {run_id} {runs[0]['status']} in {time.monotonic() - run_started:.0f} s")

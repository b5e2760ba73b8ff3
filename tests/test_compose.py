"""docker/compose.yaml for real: build, bring the topology up, run the federation, tear down.

Part of the default run (the README's test command); `-m "not compose"` leaves it out. It needs
root, podman (with runc, docker/podman-containers.conf) and podman-compose, debootstrap, and
Debian's and Python's package repositories; .ci/run installs them. On a machine without them
(a fresh one, where the README's test command must still pass) the test is skipped, its reason
in pytest's summary; .ci/run sets FEDBIP_REQUIRE_CONTAINERS=1, which turns that skip into a
failure, so CI can never skip it. Where the engine is there but cannot start, the test fails
with one sentence saying why. No image registry is needed: the official Flower
images are replaced by local stand-ins (docker/local-images.sh) through the build argument and
image variables that compose.yaml exposes for this. Images stay in podman's storage: the base
images are rebuilt only when their recipe changes, the executor image through podman's layer
cache (only the layers after a changed file), and the versions they replace are removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from fedbip_flwr import shapes
from tests.helpers import FLWR, ROOT, SMALL, as_run_config, free_port

pytestmark = [pytest.mark.compose, pytest.mark.long(minutes=8)]

COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
FLOWER_STAND_IN = "localhost/flwr-local:1.42.0"
EXECUTOR_BASE = "localhost/flwr-local-torch:1.42.0"
PIP_CERT = "/etc/ssl/certs/ca-certificates.crt"
BUILD_ARGS = "--network host --ulimit nofile=20000:20000 -v /etc/ssl/certs:/etc/ssl/certs:ro"
EXECUTOR_IMAGE = "fedbip-flwr-superexec:0.1.0"  # built by compose (service "serverapp")
CONTAINER_UID = 49999  # the user Flower's images run as
INSTITUTIONS = 3
DOMAINS = ("sketch", "quickdraw", "painting")  # compose.yaml's default domain of institution N
SHOTS, TEST_PER_CLASS = 3, 4
REQUIRED_TOOLS = ("podman", "podman-compose", "debootstrap", "openssl", "ssh-keygen")
INSTALL = "bash .ci/run --tools-only installs them"
DESELECT = "-m 'not compose' leaves this test out"
REQUIRE = "FEDBIP_REQUIRE_CONTAINERS"  # set (to 1) by .ci/run: a missing engine fails the test


def tool(name: str) -> str | None:
    """On PATH, or next to this Python (pip's podman-compose where no shim points to it)."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def engine_absent(reason: str) -> None:
    """Skip with ``reason`` on a machine without the engine, or fail where CI requires it."""
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(
            f"{reason} ({REQUIRE}=1, as .ci/run sets it: the engine must be here).", pytrace=False
        )
    pytest.skip(f"{reason} ({INSTALL}; {DESELECT}; {REQUIRE}=1 makes this a failure).")


def engine_preflight(env: dict) -> None:
    """Skip or fail (:func:`engine_absent`) without the tools or root; fail with one sentence
    where podman is there but cannot run a container at all."""
    missing = [name for name in REQUIRED_TOOLS if tool(name) is None]
    if missing:
        engine_absent(f"The compose test needs {', '.join(missing)}, which this machine lacks")
    if os.geteuid() != 0:
        engine_absent("The compose test needs root for debootstrap and rootful podman")
    # The smallest container there is: the host's /usr, read-only, in an empty root folder (a
    # merged-/usr system such as Debian 12, where /bin, /lib and /lib64 point into /usr).
    conf = env["CONTAINERS_CONF"]
    with tempfile.TemporaryDirectory(prefix="fedbip-probe-") as root:
        for link in ("bin", "lib", "lib64"):
            (Path(root) / link).symlink_to(f"usr/{link}")
        try:
            proc = subprocess.run(
                [
                    "podman",
                    "run",
                    "--rm",
                    "--network",
                    "none",
                    "-v",
                    "/usr:/usr:ro",
                    "--rootfs",
                    root,
                    "/usr/bin/true",
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"Podman did not run a container within 120 s (CONTAINERS_CONF={conf}).",
                pytrace=False,
            )
    if proc.returncode != 0:
        reason = last_line(proc.stderr + proc.stdout).removeprefix("Error: ").rstrip(".")
        pytest.fail(
            f"Podman cannot run a container here (CONTAINERS_CONF={conf}): {reason}.", pytrace=False
        )


def image_id(name: str, env: dict) -> str:
    proc = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", name],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.stdout.strip() if proc.returncode == 0 else ""


def run(args: list[str], env: dict, timeout: float, what: str) -> str:
    proc = subprocess.run(
        args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{output[-6000:]}"
    return output


@pytest.fixture(scope="module")
def topology(tiny_model_dir):
    containers_conf = os.environ.get(
        "CONTAINERS_CONF", str(ROOT / "docker" / "podman-containers.conf")
    )
    engine_preflight({**os.environ, "CONTAINERS_CONF": containers_conf})
    # Outside pytest's private tmp folder: the containers' user must read the mounted files.
    work = Path(tempfile.mkdtemp(prefix="fedbip-compose-"))
    work.chmod(0o755)
    project = f"fedbip-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {
        **os.environ,
        "CONTAINERS_CONF": containers_conf,
        "FLWR_SUPERLINK_IMAGE": FLOWER_STAND_IN,
        "FLWR_SUPERNODE_IMAGE": FLOWER_STAND_IN,
        "SUPEREXEC_BASE_IMAGE": EXECUTOR_BASE,
        "PIP_INSTALL_ARGS": f"--cert {PIP_CERT}",
        "FEDBIP_CREDENTIALS": str(work / "credentials"),
        "FEDBIP_MODELS": str(work / "models"),
        "SUPERLINK_PORT": str(port),
        "FLWR_HOME": str(work / "flwr-home"),
    }
    compose = [tool("podman-compose"), "-f", str(COMPOSE_FILE), "-p", project]
    try:
        started = time.monotonic()
        run([str(ROOT / "docker" / "local-images.sh")], env, 3600, "building the base images")
        seconds_images = time.monotonic() - started
        run(
            [
                str(ROOT / "deploy" / "make-credentials.sh"),
                "-o",
                str(CONTAINER_UID),
                str(work / "credentials"),
                str(INSTITUTIONS),
                "superlink",
            ],
            env,
            60,
            "credentials",
        )
        shutil.copytree(tiny_model_dir, work / "models" / "tiny-ldm")
        for index, domain in enumerate(DOMAINS):  # each institution's own folder, nobody else's
            folder = work / f"institution-{index}-data"
            shapes.write_image_folder(folder, domain, SHOTS, TEST_PER_CLASS, size=32)
            env[f"INSTITUTION_{index}_DATA"] = str(folder)
        for top in [
            work / "models",
            *(work / f"institution-{i}-data" for i in range(INSTITUTIONS)),
        ]:
            for path in [top, *top.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
        (work / "flwr-home").mkdir()
        (work / "flwr-home" / "config.toml").write_text(
            '[superlink]\ndefault = "fedbip-compose"\n\n'
            f'[superlink.fedbip-compose]\naddress = "127.0.0.1:{port}"\n'
            f'root-certificates = "{work / "credentials" / "ca" / "ca.crt"}"\n'
        )
        # The executor image is rebuilt from podman's layer cache: only the steps after a changed
        # file run again. The version it replaces (and that version's own layers) is removed.
        executor_before = image_id(EXECUTOR_IMAGE, env)
        run(
            [*compose, "--podman-build-args", BUILD_ARGS, "up", "--build", "-d"],
            env,
            3600,
            "podman-compose up",
        )
        if executor_before and executor_before != image_id(EXECUTOR_IMAGE, env):
            subprocess.run(
                ["podman", "rmi", executor_before],
                env=env,
                capture_output=True,
                timeout=300,
                check=False,
            )
        seconds_up = time.monotonic() - started
        yield {
            "env": env,
            "credentials": work / "credentials",
            "project": project,
            "compose": compose,
            "seconds_up": seconds_up,
            "seconds_images": seconds_images,
        }
    finally:
        down = subprocess.run(
            [*compose, "down", "-v"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        shutil.rmtree(work, ignore_errors=True)
        left = subprocess.run(
            ["podman", "ps", "-a", "-q", "--filter", f"label=io.podman.compose.project={project}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout.split()
    assert down.returncode == 0, f"podman-compose down failed:\n{down.stdout}{down.stderr}"
    assert left == [], f"containers of {project} survived the teardown: {left}"


def logs(topology) -> str:
    proc = subprocess.run(
        [*topology["compose"], "logs"],
        env=topology["env"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return (proc.stdout + proc.stderr)[-8000:]


def flwr_json(topology, *args: str) -> dict:
    proc = subprocess.run(
        [FLWR, *args, "--format", "json"],
        env=topology["env"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def test_compose_federation_runs_to_completion(topology):
    # The "register" service registers the three keys, each SuperNode is then accepted, and it
    # writes the run config binding them.
    deadline = time.monotonic() + 600
    statuses: list[str] = []
    written = topology["credentials"] / "operator" / "run-config"
    while statuses.count("online") < INSTITUTIONS or not written.exists():
        assert time.monotonic() < deadline, f"SuperNodes: {statuses}\n{logs(topology)}"
        time.sleep(5)
        statuses = [n["status"] for n in flwr_json(topology, "supernode", "ls").get("nodes", [])]

    # The deployment's federation, shrunk, on the institutions' own folders (the server holds
    # none): the run config "register" wrote (the DP upload, federation.client-nodes), then the
    # test's.
    registered = written.read_text().strip()
    values = {
        **SMALL,
        "ldm.model": '"models/tiny-ldm"',
        "run-name": '"compose"',
        "data.dataset": '"imagefolder"',
        "data.classes": f'"{",".join(shapes.CLASSES)}"',
    }
    values.pop("federation.replayable-client-noise")  # institutions keep the private default
    run_started = time.monotonic()
    output = run(
        [
            FLWR,
            "run",
            ".",
            "fedbip-compose",
            "--stream",
            "--run-config",
            registered,
            "--run-config",
            as_run_config(values),
        ],
        topology["env"],
        1800,
        "flwr run",
    )
    run_id = next(
        line.split()[-1]
        for line in output.splitlines()
        if line.startswith("Successfully started run")
    )
    runs = flwr_json(topology, "ls", "--run-id", run_id)["runs"]
    assert runs[0]["status"] == "finished:completed", output[-6000:] + logs(topology)

    folder = volume_path(topology, "server-outputs") / "compose"
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["status"] == "completed"
    assert metrics["config"]["method"] == "fedbip-mixture"
    assert metrics["config"]["fedbip-mixture.dp-epsilon"] == 4.0
    accepted = sorted(c["client_id"] for c in metrics["clients"] if c["status"] == "accepted")
    assert accepted == ["painting-0", "quickdraw-0", "sketch-0"]
    bound = dict(
        pair.split("=") for pair in metrics["config"]["federation.client-nodes"].split(",")
    )
    uploaders = json.loads((folder / "uploaders.json").read_text())
    assert {client: node for node, client in uploaders.items()} == bound
    assert "per_domain" not in metrics["accuracy"], "the server scored on data it cannot hold"
    per_client = metrics["evaluation"]["per_client"]
    assert sorted(per_client) == accepted
    # a DP upload's institution replies its accuracy alone
    assert all(r["status"] == "ok" and "num_examples" not in r for r in per_client.values())
    assert sorted(p.name for p in (folder / "payloads").glob("*.safetensors")) == [
        "painting-0.safetensors",
        "quickdraw-0.safetensors",
        "sketch-0.safetensors",
    ]
    for index, domain in enumerate(DOMAINS):
        kept = (
            volume_path(topology, f"institution-{index}-outputs")
            / "compose"
            / "institutions"
            / f"{domain}-0"
            / "classifier.safetensors"
        )
        assert kept.read_bytes() == (folder / "classifier.safetensors").read_bytes()
        records = volume_path(topology, f"institution-{index}-outputs") / "institutions"
        [line] = (records / f"{domain}-0" / "uploads.jsonl").read_text().splitlines()
        stored = (folder / "payloads" / f"{domain}-0.safetensors").read_bytes()
        assert json.loads(line)["sha256"] == hashlib.sha256(stored).hexdigest()
    assert "/app/data" not in container_mounts(topology, "serverapp")
    assert "/app/data" in container_mounts(topology, "clientapp-0")
    print(
        f"compose: base images ready in {topology['seconds_images']:.0f} s, "
        f"built and up in {topology['seconds_up']:.0f} s, "
        f"run {run_id} {runs[0]['status']} in {time.monotonic() - run_started:.0f} s"
    )


def volume_path(topology, name: str) -> Path:
    volume = f"{topology['project']}_{name}"
    return Path(
        subprocess.run(
            ["podman", "volume", "inspect", volume, "--format", "{{.Mountpoint}}"],
            env=topology["env"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.strip()
    )


def container_mounts(topology, service: str) -> list[str]:
    """Where a service's container has volumes mounted (its Destination paths)."""
    ids = subprocess.run(
        [
            "podman",
            "ps",
            "-q",
            "--filter",
            f"label=io.podman.compose.project={topology['project']}",
            "--filter",
            f"label=io.podman.compose.service={service}",
        ],
        env=topology["env"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert ids, f"no running container of {service}"
    return subprocess.run(
        ["podman", "inspect", ids[0], "--format", "{{range .Mounts}}{{.Destination}} {{end}}"],
        env=topology["env"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()

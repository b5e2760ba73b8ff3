"""The hardening docs/deployment.md promises, read from the shipped files in seconds (no
containers, no Flower processes): compose publishes the SuperLink's port, which carries the
unauthenticated Control API, on loopback only; deploy/superlink.sh will not start without an
explicit --host; deploy/make-credentials.sh hands out no CA key and no private key outside its
owner's folder. tests/test_deployment.py and tests/test_compose.py run the same files for real.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from flwr.common.config import parse_config_args

from fedbip_flwr.client_run import check_policy
from fedbip_flwr.config import FedBiPConfig, NodeConfig
from fedbip_flwr.methods import create_for
from fedbip_flwr.policy import Guarantee, PolicyRefusal
from fedbip_tools.cli import project_run_config
from tests.helpers import ROOT

COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
DEPLOY = ROOT / "deploy"
NUM_SUPERNODES = 2


def resolve(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation of ``${VAR}``, ``${VAR:-default}`` and ``${VAR-default}``."""

    def one(match: re.Match) -> str:
        name, op, default = match.group(1), match.group(2), match.group(3) or ""
        value = env.get(name)
        if op == ":-":
            return value if value else default
        if op == "-":
            return default if value is None else value
        return value or ""

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}", one, text)


def published(env: dict[str, str]) -> dict[str, list[tuple[str, str, str]]]:
    """Every service's published ports as (host address, host port, container port)."""
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    out = {}
    for name, service in services.items():
        mappings = []
        for entry in service.get("ports", []):
            assert isinstance(entry, str), f"{name}: only the short port syntax is parsed here"
            parts = resolve(entry, env).rsplit(":", 2)
            if len(parts) == 2:  # "HOST_PORT:CONTAINER_PORT": every interface
                parts = ["", *parts]
            mappings.append(tuple(parts))
        if mappings:
            out[name] = mappings
    return out


def test_resolve_follows_compose_interpolation():
    assert resolve("${A:-x}:${B-y}:${C}", {}) == "x:y:"
    assert resolve("${A:-x}:${B-y}", {"A": "", "B": ""}) == "x:"
    assert resolve("${A:-x}", {"A": "10.0.0.1"}) == "10.0.0.1"


def test_compose_publishes_only_the_superlink_port_and_on_loopback_by_default():
    ports = published({})
    assert list(ports) == ["superlink"], f"services that publish ports: {sorted(ports)}"
    assert ports["superlink"] == [("127.0.0.1", "9093", "8000")]
    # The operator's variables still move it, and the test's SUPERLINK_PORT still applies.
    assert published({"SUPERLINK_PORT": "18093"})["superlink"] == [("127.0.0.1", "18093", "8000")]
    assert published({"SUPERLINK_BIND": "192.0.2.10"})["superlink"][0][0] == "192.0.2.10"


def test_compose_supernodes_reach_the_superlink_inside_the_federation_network():
    """Loopback-only publishing is possible because no SuperNode dials the published port."""
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    supernodes = {name: s for name, s in services.items() if name.startswith("supernode-")}
    assert len(supernodes) == 3
    for name, service in supernodes.items():
        assert "--superlink=superlink:8000" in service["command"], name
        assert "federation" in service["networks"], name
    assert "federation" in services["superlink"]["networks"]
    assert "--enable-supernode-auth" in services["superlink"]["command"]
    header = COMPOSE_FILE.read_text().split("\nname:")[0]
    assert "SUPERLINK_BIND" in header, "the header's variable list must name SUPERLINK_BIND"


@pytest.fixture(scope="module")
def credentials(tmp_path_factory):
    """deploy/make-credentials.sh's output, and the temporary folder it was given (TMPDIR)."""
    base = tmp_path_factory.mktemp("credentials")
    scratch = base / "tmp"
    scratch.mkdir()
    out = base / "out"
    proc = subprocess.run(
        [str(DEPLOY / "make-credentials.sh"), str(out), str(NUM_SUPERNODES), "superlink"],
        env={**os.environ, "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, scratch


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_make_credentials_hands_out_no_ca_key(credentials):
    out, scratch = credentials
    assert not [p for p in out.rglob("*") if p.name.startswith("ca.key")]
    assert not [p for p in out.rglob("*") if p.suffix == ".srl"]
    assert not any(scratch.iterdir()), "the CA's temporary folder was left behind"
    # The only private keys are the owners' own, in the owners' folders, readable by them only.
    private = {
        str(p.relative_to(out))
        for p in out.rglob("*")
        if p.is_file() and b"PRIVATE KEY" in p.read_bytes()
    }
    owners = {"superlink/server.key", *(f"supernode-{i}/node.key" for i in range(NUM_SUPERNODES))}
    assert private == owners
    for key in owners:
        assert (out / key).stat().st_mode & 0o077 == 0, f"{key} is readable by others"
    assert files_under(out / "ca") == {"ca.crt"}
    assert files_under(out / "superlink") == {
        "ca.crt",
        "server.pem",
        "server.key",
        "superexec.secret",
    }
    for i in range(NUM_SUPERNODES):
        assert files_under(out / f"supernode-{i}") == {"ca.crt", "node.key", "node.key.pub"}


def test_make_credentials_certificate_still_verifies(credentials):
    out, _ = credentials
    for ca in [out / "ca" / "ca.crt", out / "superlink" / "ca.crt", out / "supernode-0" / "ca.crt"]:
        proc = subprocess.run(
            ["openssl", "verify", "-CAfile", str(ca), str(out / "superlink" / "server.pem")],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert proc.returncode == 0 and ": OK" in proc.stdout, proc.stdout + proc.stderr
    sans = subprocess.run(
        [
            "openssl",
            "x509",
            "-noout",
            "-ext",
            "subjectAltName",
            "-in",
            str(out / "superlink" / "server.pem"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert all(name in sans for name in ("DNS:localhost", "IP Address:127.0.0.1", "DNS:superlink"))


@pytest.fixture
def fake_superlink(tmp_path):
    """A PATH whose flower-superlink writes its arguments (and one Flower variable) and exits."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "flower-superlink"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'echo "FAKE-SUPERLINK $* grpc=${FLWR_INTERNAL_GRPC_CONTROL_API:-unset}"\n'
    )
    fake.chmod(0o755)
    creds = tmp_path / "superlink"
    creds.mkdir()
    for name in ("ca.crt", "server.pem", "server.key"):
        (creds / name).write_text("placeholder\n")

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(DEPLOY / "superlink.sh"), str(creds), *args],
            env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    return run


def test_superlink_script_refuses_to_start_without_host(fake_superlink):
    proc = fake_superlink("--port", "9093")
    assert proc.returncode != 0
    assert "FAKE-SUPERLINK" not in proc.stdout, "flower-superlink was started without --host"
    assert "--host" in proc.stderr
    assert fake_superlink("--port", "9093", "--host").returncode != 0  # no value


@pytest.mark.parametrize("host_args", [["--host", "127.0.0.1"], ["--host=127.0.0.1"]])
def test_superlink_script_starts_with_an_explicit_host(fake_superlink, host_args):
    proc = fake_superlink(*host_args, "--port", "9093", FLWR_INTERNAL_GRPC_CONTROL_API="1")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith("FAKE-SUPERLINK ")
    assert " ".join(host_args) in line and "--enable-supernode-auth" in line
    assert "grpc=unset" in line, "the legacy gRPC Control API variable reached flower-superlink"
    assert "warning" not in proc.stderr


def test_superlink_script_warns_on_every_interface(fake_superlink):
    proc = fake_superlink("--host", "0.0.0.0", "--port", "9093")
    assert proc.returncode == 0, proc.stderr
    assert "warning" in proc.stderr and "Control API" in proc.stderr


def test_the_shipped_deployment_binds_client_ids_and_asks_for_a_dp_upload():
    """Issue 91: the demo and compose both register through docker/register-supernodes.sh,
    whose run config binds every client id to its registered node (federation.client-nodes) and
    asks by default for an upload a real institution's default policy accepts; FedBiP's own it
    refuses. tests/test_deployment.py runs the script for real."""
    script = (ROOT / "docker" / "register-supernodes.sh").read_text()
    default = re.search(r': "\$\{FEDBIP_RUN_CONFIG:=(.*)\}"\n', script).group(1).replace('\\"', '"')
    assert '"federation.client-nodes"="%s"' in script and '"$FEDBIP_RUN_CONFIG" "$bound"' in script
    compose = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["register"]
    assert compose["entrypoint"][1:] == [
        "/app/register-supernodes.sh",
        "/app/keys",
        "/app/operator/run-config",
    ]
    targets = [resolve(volume, {}).split(":")[1] for volume in compose["volumes"]]
    assert [t for t in targets if t.startswith("/app/keys/")] == [
        f"/app/keys/{client}.pub" for client in ("sketch-0", "quickdraw-0", "painting-0")
    ], "each key is registered under its institution's client id"
    demo = (DEPLOY / "demo.sh").read_text()
    assert 'register-supernodes.sh" "$keys" "$run_config"' in demo
    assert '--run-config "$(cat "$run_config")' in demo

    node = NodeConfig.from_flat({"data-root": "/srv/data", "domain": "x", "client-id": "a"})
    run = {**project_run_config(), "data.dataset": "imagefolder", "data.classes": "a,b"}
    cfg = FedBiPConfig.from_flat({**run, **parse_config_args([default])})
    assert cfg.settings_of(cfg.method).guarantee == Guarantee(4.0, 1e-5)
    check_policy(create_for(cfg), cfg, node)  # accepted
    fedbip = FedBiPConfig.from_flat({**run, **parse_config_args([default, 'method="fedbip"'])})
    with pytest.raises(PolicyRefusal, match="without a DP guarantee"):
        check_policy(create_for(fedbip), fedbip, node)

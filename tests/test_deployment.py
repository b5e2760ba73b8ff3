"""The deployment engine secured as in docs/deployment.md, through the deploy/ scripts.

Real processes on 127.0.0.1 with their own ports and FLWR_HOME: a SuperLink with TLS and
SuperNode authentication, SuperNodes that present registered EC keys, and `flwr run`.
Every process a test starts is stopped by PID, on failure too.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

import pytest

from fedbip_flwr import results
from fedbip_flwr.results import Scored
from tests.helpers import (
    FLWR,
    ROOT,
    SMALL,
    as_run_config,
    flwr_env,
    free_port,
    free_port_block,
    processes_mentioning,
    stop_process_tree,
    wait_for_port,
)

pytestmark = pytest.mark.long(minutes=3)

DEPLOY = ROOT / "deploy"
NUM_SUPERNODES = 3


# Institution 2 (painting-0) requires epsilon <= 1, stricter than the demo's default upload at
# epsilon 4. Its model does not exist and its folder's train/ is empty: loading either fails
# its job, so a refusal recorded as such proves it refused before touching them.
STRICT = 2
STRICT_POLICY = 'model="/nonexistent/model" max-dp-epsilon=1.0'


@pytest.fixture(scope="module")
def demo(tmp_path_factory, tiny_model_dir):
    """deploy/demo.sh end to end: credentials, SuperLink, 3 registered SuperNodes, the run (the
    demo's default DP upload, client ids bound to the registered nodes)."""
    work = tmp_path_factory.mktemp("demo")
    (work / "data" / f"institution-{STRICT}" / "train").mkdir(parents=True)
    port = free_port_block(1 + NUM_SUPERNODES)
    values = {
        **SMALL,
        "ldm.model": f'"{tiny_model_dir}"',
        "output-dir": f'"{work / "outputs"}"',
        "run-name": '"deployment"',
    }
    values.pop("federation.replayable-client-noise")  # institutions keep the private default
    env = flwr_env(work / "flwr-home")
    proc = subprocess.Popen(
        [
            str(DEPLOY / "demo.sh"),
            "-n",
            str(NUM_SUPERNODES),
            "-p",
            str(port),
            "-k",
            "3",
            "-t",
            "4",
            "-c",
            f"{STRICT}:{STRICT_POLICY}",
            str(work),
            "--run-config",
            as_run_config(values),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=900)
        # The script stops what it started; anything left mentioning the work folder is a leak.
        leftovers = [p.pid for p in processes_mentioning(str(work))]
    finally:
        stop_process_tree(proc.pid)
        for leftover in processes_mentioning(str(work)):
            stop_process_tree(leftover.pid)
    return {
        "work": work,
        "returncode": proc.returncode,
        "output": output,
        "leftovers": leftovers,
        "model": str(tiny_model_dir),
    }


CLIENTS = ("sketch-0", "quickdraw-0", "painting-0")  # institution i's client id


def test_demo_runs_the_federation_to_completion(demo):
    """Three institutions, each with its own image folder and identity in its node config; the
    server holds no image, so the scores come from the institutions themselves. The demo's
    default upload carries a DP guarantee, and each client id is bound to its node."""
    assert demo["returncode"] == 0, demo["output"][-6000:]
    assert "finished:completed" in demo["output"]
    assert f"{NUM_SUPERNODES} SuperNodes online" in demo["output"]
    assert demo["leftovers"] == [], "deploy/demo.sh left processes running"
    run = demo["work"] / "outputs" / "deployment"
    record = results.read(run)
    assert record.status == "completed"
    assert record.config["data.dataset"] == "imagefolder"
    assert record.config["federation.evaluation"] == "clients"
    assert record.config["ldm.model"] == demo["model"]  # the run config reached the ServerApp
    assert record.config["method"] == "fedbip-mixture"
    assert record.config["fedbip-mixture.dp-epsilon"] == 4.0
    accepted = sorted(c.client_id for c in record.clients if c.status == "accepted")
    assert accepted == ["quickdraw-0", "sketch-0"]
    uploaders = json.loads((run / "uploaders.json").read_text())
    bound = dict(pair.split("=") for pair in record.config["federation.client-nodes"].split(","))
    assert sorted(bound) == sorted(CLIENTS)
    assert {client: bound[client] for client in uploaders.values()} == {
        client: node for node, client in uploaders.items()
    }, "each upload came from the node its client id is bound to"
    assert record.accuracy.per_domain is None, "the server scored on data it cannot hold"
    per_client = record.evaluation.per_client
    assert sorted(per_client) == accepted
    for client, score in per_client.items():
        assert isinstance(score, Scored), (client, score)
        assert score.num_examples is None  # a DP upload's institution sends its accuracy alone
    assert 0.0 <= record.evaluation.weighted_mean <= 1.0
    for i in range(NUM_SUPERNODES):
        if i == STRICT:
            continue
        own = demo["work"] / "institutions" / f"institution-{i}"
        kept = own / "deployment" / "institutions" / CLIENTS[i] / "classifier.safetensors"
        assert kept.read_bytes() == (run / "classifier.safetensors").read_bytes()


def test_an_institution_whose_policy_refuses_the_upload_computes_nothing(demo):
    """Institution 2 requires epsilon <= 1: it refused before opening its folder or loading
    its model (either would have failed its job instead), the run completed with the others,
    and the refusal is in clients.json and report.md."""
    assert demo["returncode"] == 0, demo["output"][-6000:]
    run = demo["work"] / "outputs" / "deployment"
    [refused] = [c for c in results.read_clients(run / "clients.json") if c.status == "refused"]
    assert refused.client_id == CLIENTS[STRICT]
    assert refused.reason == (
        "refused by the institution's policy: the run's upload is (4, 1e-05)-DP per image, "
        "weaker than this institution's epsilon <= 1, delta <= 1e-05 per image (node config "
        "max-dp-epsilon, max-dp-delta)"
    )
    report = (run / "report.md").read_text()
    assert "refused by the institution's policy: the run's upload is (4, 1e-05)-DP" in report
    assert not (demo["work"] / "institutions" / f"institution-{STRICT}").exists(), (
        "the refusing institution kept nothing: it uploaded nothing and got nothing back"
    )


def test_every_accepted_upload_is_recorded_by_its_institution(demo):
    """The record each institution keeps of what left it, beside the bytes the server holds."""
    run = demo["work"] / "outputs" / "deployment"
    for i in range(NUM_SUPERNODES):
        if i == STRICT:
            continue
        own = demo["work"] / "institutions" / f"institution-{i}"
        [line] = (own / "institutions" / CLIENTS[i] / "uploads.jsonl").read_text().splitlines()
        record = json.loads(line)
        stored = (run / "payloads" / f"{CLIENTS[i]}.safetensors").read_bytes()
        assert record["sha256"] == hashlib.sha256(stored).hexdigest()
        assert (record["method"], record["bytes"]) == ("fedbip-mixture", len(stored))
        # the accountant's epsilon, just below the one asked for
        assert record["dp"]["epsilon"] == pytest.approx(4.0, abs=1e-3)
        assert (record["dp"]["delta"], record["dp"]["void"]) == (1e-05, False)
        assert record["kinds"] == ["concepts", "counts", "statistics"]
        measured = {m["kind"]: (m["auc"], m["epsilon"]) for m in record["membership"]}
        assert measured == {  # the tiny model at 32 px: 4x16x16 latents, as the miniature's
            "concepts": ([0.49, 0.51], 4.0),
            "counts": (None, None),
            "statistics": ([0.50, 0.52], 4.0),
        }


def test_demo_secured_every_connection(demo):
    logs = demo["work"] / "logs"
    superlink = (logs / "superlink.log").read_text()
    assert "running on https://127.0.0.1" in superlink
    assert "SuperNode authentication is disabled" not in superlink
    for i in range(NUM_SUPERNODES):
        assert (demo["work"] / "data" / f"institution-{i}" / "train").is_dir()
    # Each SuperNode registered exactly once with its own key.
    assert (logs / "register.log").read_text().count("registered successfully") == NUM_SUPERNODES


@pytest.fixture(scope="module")
def secured_superlink(tmp_path_factory):
    """A SuperLink with TLS and SuperNode auth; supernode-0's key is registered, supernode-1's not."""
    work = tmp_path_factory.mktemp("secured")
    creds = work / "credentials"
    subprocess.run(
        [str(DEPLOY / "make-credentials.sh"), str(creds), "2"], check=True, capture_output=True
    )
    home = work / "flwr-home"
    home.mkdir()
    port = free_port()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "tls"\n\n'
        f'[superlink.tls]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{creds / "ca" / "ca.crt"}"\n\n'
        f'[superlink.no-ca]\naddress = "127.0.0.1:{port}"\n'
    )
    env = flwr_env(home)
    log = work / "superlink.log"
    with log.open("w") as out:
        superlink = subprocess.Popen(
            [
                str(DEPLOY / "superlink.sh"),
                str(creds / "superlink"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    started: list[subprocess.Popen] = [superlink]
    try:
        wait_for_port(port, superlink, log)
        flwr(env, "supernode", "register", str(creds / "supernode-0" / "node.key.pub"), "tls")
        yield {
            "work": work,
            "creds": creds,
            "port": port,
            "env": env,
            "log": log,
            "started": started,
        }
    finally:
        for proc in reversed(started):
            stop_process_tree(proc.pid)


def flwr(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [FLWR, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    if check:
        assert proc.returncode == 0, f"flwr {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}"
    return proc


def start_supernode(link: dict, name: str, args: list[str]) -> tuple[subprocess.Popen, Path]:
    log = link["work"] / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(args, env=link["env"], stdout=out, stderr=subprocess.STDOUT)
    link["started"].append(proc)
    return proc, log


def supernode_script(link: dict, node: str, runtime_port: int) -> list[str]:
    return [
        str(DEPLOY / "supernode.sh"),
        str(link["creds"] / node),
        f"127.0.0.1:{link['port']}",
        "partition-id=0",
        "--port",
        str(runtime_port),
        "--max-retries",
        "0",
    ]


def node_statuses(link: dict) -> list[str]:
    listing = flwr(link["env"], "supernode", "ls", "tls", "--format", "json")
    return [node["status"] for node in json.loads(listing.stdout)["nodes"]]


def test_registered_supernode_comes_online(secured_superlink):
    """The control for the refusals below: same SuperLink, registered key, CA certificate."""
    proc, log = start_supernode(
        secured_superlink,
        "registered",
        supernode_script(secured_superlink, "supernode-0", free_port()),
    )
    deadline = time.monotonic() + 120
    while node_statuses(secured_superlink) != ["online"]:
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, "the registered SuperNode did not come online"
        time.sleep(2)
    stop_process_tree(proc.pid)


def test_unregistered_supernode_is_refused(secured_superlink):
    proc, log = start_supernode(
        secured_superlink,
        "unregistered",
        supernode_script(secured_superlink, "supernode-1", free_port()),
    )
    assert proc.wait(timeout=120) != 0, "a SuperNode with an unregistered key kept running"
    assert "Failed to activate SuperNode" in log.read_text()
    assert "No SuperNode found with the given public key" in secured_superlink["log"].read_text()
    assert len(node_statuses(secured_superlink)) == 1, "the unregistered key became a node"


def test_supernode_without_ca_certificate_cannot_connect(secured_superlink):
    """A registered key is not enough: without the CA the SuperLink's certificate is untrusted."""
    creds = secured_superlink["creds"] / "supernode-0"
    proc, log = start_supernode(
        secured_superlink,
        "no-ca",
        [
            str(Path(FLWR).with_name("flower-supernode")),
            "--superlink",
            f"127.0.0.1:{secured_superlink['port']}",
            "--auth-supernode-private-key",
            str(creds / "node.key"),
            "--node-config",
            "partition-id=0",
            "--port",
            str(free_port()),
            "--max-retries",
            "0",
        ],
    )
    assert proc.wait(timeout=120) != 0, "a SuperNode without the CA certificate kept running"
    assert "CERTIFICATE_VERIFY_FAILED" in log.read_text()


def test_cli_without_ca_certificate_cannot_connect(secured_superlink):
    refused = flwr(secured_superlink["env"], "ls", "no-ca", check=False)
    assert refused.returncode != 0
    assert "unavailable" in refused.stdout + refused.stderr
    flwr(secured_superlink["env"], "ls", "tls")  # the same command with the CA works


def test_only_the_executor_with_the_secret_takes_the_serverapp_task(tmp_path):
    """Process isolation (compose): the Runtime API shares the SuperLink's port with the Fleet
    API, so the SuperExec secret is what keeps a stranger from acting as the ServerApp."""
    creds = tmp_path / "credentials"
    subprocess.run(
        [str(DEPLOY / "make-credentials.sh"), str(creds), "1"], check=True, capture_output=True
    )
    secret = creds / "superlink" / "superexec.secret"
    port = free_port()
    env = flwr_env(tmp_path / "flwr-home")
    executor = [
        str(Path(FLWR).with_name("flower-superexec")),
        "--runtime-api-address",
        f"127.0.0.1:{port}",
        "--root-certificates",
        str(creds / "ca" / "ca.crt"),
    ]
    log = tmp_path / "superlink.log"
    started: list[subprocess.Popen] = []
    try:
        with log.open("w") as out:
            started.append(
                subprocess.Popen(
                    [
                        str(DEPLOY / "superlink.sh"),
                        str(creds / "superlink"),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--isolation",
                        "process",
                        "--superexec-auth-secret-file",
                        str(secret),
                    ],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
        wait_for_port(port, started[0], log)
        stranger = subprocess.run(
            executor, env=env, capture_output=True, text=True, timeout=120, check=False
        )
        assert "SuperExec authentication failed" in log.read_text(), stranger.stdout
        started.append(
            subprocess.Popen(
                [*executor, "--superexec-auth-secret-file", str(secret)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        time.sleep(15)
        assert started[1].poll() is None, "the executor holding the secret stopped"
        assert log.read_text().count("SuperExec authentication failed") == 1
    finally:
        for proc in reversed(started):
            stop_process_tree(proc.pid)

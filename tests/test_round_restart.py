"""No upload lost during the round, no institution left out: real TLS deployment, real kill -9.

Three institutions with their own image folders on a SuperLink with TLS and SuperNode
authentication (the deploy/ scripts). "sketch" holds few images and uploads first;
"quickdraw" holds many and is still personalizing when the ServerApp is killed (SIGKILL, by
PID) right after the first upload is on disk. The restart (a second `flwr run` with the same
run-name) must keep that upload, not ask its institution again, ask "quickdraw" again, and send
``train`` to "clipart", whose SuperNode only connects after the restarted round began and whose
node config points at a folder that does not exist: its one-sentence reason is recorded and the
run completes with the other two.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from fedbip_flwr import results, shapes
from fedbip_flwr.results import Scored
from tests.helpers import (
    FLWR,
    ROOT,
    SMALL,
    as_run_config,
    flwr_env,
    free_port_block,
    stop_process_tree,
    wait_for_port,
)

pytestmark = pytest.mark.long(minutes=3.7)

DEPLOY = ROOT / "deploy"
INSTITUTIONS = {  # client id: (domain, training images per class; 0 = no folder at all)
    "sketch-a": ("sketch", 2),
    "quickdraw-b": ("quickdraw", 24),
    "clipart-c": ("clipart", 0),
}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def wait_until(
    condition,
    timeout: float,
    what: str,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"{what}: process exited early\n{log.read_text()[-4000:] if log else ''}"
            )
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)


class Topology:
    """SuperLink + SuperNodes started through deploy/, every process stopped by PID at the end."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.creds = work / "credentials"
        self.port = free_port_block(1 + len(INSTITUTIONS))
        self.env = flwr_env(work / "flwr-home")
        self.started: list[subprocess.Popen] = []
        subprocess.run(
            [str(DEPLOY / "make-credentials.sh"), str(self.creds), str(len(INSTITUTIONS))],
            check=True,
            capture_output=True,
        )
        home = work / "flwr-home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "tls"\n\n[superlink.tls]\naddress = "127.0.0.1:{self.port}"\n'
            f'root-certificates = "{self.creds / "ca" / "ca.crt"}"\n'
        )

    def start(self, name: str, args: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.work / f"{name}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                args, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )
        self.started.append(proc)
        return proc, log

    def superlink(self) -> subprocess.Popen:
        proc, log = self.start(
            "superlink",
            [
                str(DEPLOY / "superlink.sh"),
                str(self.creds / "superlink"),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
        )
        wait_for_port(self.port, proc, log)
        for index in range(len(INSTITUTIONS)):
            self.flwr(
                "supernode",
                "register",
                str(self.creds / f"supernode-{index}" / "node.key.pub"),
                "tls",
            )
        return proc

    def institution(self, index: int, client_id: str) -> Path:
        domain, shots = INSTITUTIONS[client_id]
        data = self.work / "data" / client_id
        if shots:
            shapes.write_image_folder(data, domain, shots, 2, size=32)
        node_config = (  # institutions that let FedBiP's z(T) leave without a DP guarantee
            f'data-root="{data}" domain="{domain}" client-id="{client_id}" '
            f'output-dir="{self.work / "kept" / client_id}" require-dp=false'
        )
        _, log = self.start(
            client_id,
            [
                str(DEPLOY / "supernode.sh"),
                str(self.creds / f"supernode-{index}"),
                f"127.0.0.1:{self.port}",
                node_config,
                "--port",
                str(self.port + 1 + index),
            ],
        )
        return log

    def online(self) -> int:
        listing = self.flwr("supernode", "ls", "tls", "--format", "json")
        return sum(node["status"] == "online" for node in json.loads(listing.stdout)["nodes"])

    def flwr(self, *args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [FLWR, *args],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, f"flwr {' '.join(args)}:\n{proc.stdout}{proc.stderr}"
        return proc

    def stop(self) -> None:
        for proc in reversed(self.started):
            stop_process_tree(proc.pid)


def serverapps(superlink: subprocess.Popen) -> list[psutil.Process]:
    family = psutil.Process(superlink.pid).children(recursive=True)
    return [p for p in family if "flwr-serverapp" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def restarted(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("restart")
    out = work / "outputs"
    values = {
        **SMALL,
        "data.dataset": '"imagefolder"',
        "data.classes": f'"{",".join(shapes.CLASSES)}"',
        "ldm.model": f'"{tiny_model_dir}"',
        "output-dir": f'"{out}"',
        "run-name": '"restart"',
        "fedbip.concept-epochs": 30,
        "federation.min-clients": 2,
    }
    values.pop("federation.replayable-client-noise")  # institutions: the private default
    config = as_run_config(values)
    folder = out / "restart"
    topology = Topology(work)
    facts: dict = {"work": work, "folder": folder}
    try:
        superlink = topology.superlink()
        logs = {c: topology.institution(i, c) for i, c in enumerate(list(INSTITUTIONS)[:2])}
        wait_until(lambda: topology.online() == 2, 120, "two SuperNodes online")

        # 1. The round starts; the ServerApp dies by SIGKILL once the first upload is on disk.
        topology.flwr("run", ".", "tls", "--run-config", config)
        first = folder / "payloads" / "sketch-a.safetensors"
        wait_until(
            first.exists, 600, "the first upload persisted", superlink, work / "superlink.log"
        )
        targets = serverapps(superlink)
        assert targets, "no flwr-serverapp process under the SuperLink"
        for proc in targets:
            proc.kill()
        psutil.wait_procs(targets, timeout=30)
        facts["at_kill"] = {
            "payloads": sorted(p.name for p in (folder / "payloads").glob("*.safetensors")),
            "digest": digest(first),
            "clients_json": (folder / "clients.json").exists(),
            "uploaders": json.loads((folder / "uploaders.json").read_text()),
        }

        # 2. The restart; "clipart-c" connects only once the restarted round is under way.
        rerun, rerun_log = topology.start(
            "rerun", [FLWR, "run", ".", "tls", "--stream", "--run-config", config]
        )
        wait_until(
            lambda: "sent the one train message" in rerun_log.read_text(),
            300,
            "the restarted round began",
            rerun,
            rerun_log,
        )
        logs["clipart-c"] = topology.institution(2, "clipart-c")
        rerun.wait(timeout=900)
        facts["rerun_log"] = rerun_log.read_text()
        facts["institution_logs"] = {c: log.read_text() for c, log in logs.items()}
    finally:
        topology.stop()
    return facts


def test_the_kill_landed_during_the_round(restarted):
    at_kill = restarted["at_kill"]
    assert at_kill["payloads"] == ["sketch-a.safetensors"], at_kill
    assert not at_kill["clients_json"], "the round had already ended"
    assert list(at_kill["uploaders"].values()) == ["sketch-a"]


def test_restart_keeps_the_upload_and_does_not_ask_its_institution_again(restarted):
    folder = restarted["folder"]
    record = results.read(folder)
    assert record.status == "completed", restarted["rerun_log"][-6000:]
    assert digest(folder / "payloads" / "sketch-a.safetensors") == restarted["at_kill"]["digest"]
    status = {c.client_id or c.node_id: c.status for c in record.clients}
    assert status["sketch-a"] == "kept" and status["quickdraw-b"] == "accepted"
    logs = restarted["institution_logs"]
    assert logs["sketch-a"].count("computing its upload") == 1, "sketch-a was asked to upload again"
    assert logs["quickdraw-b"].count("computing its upload") == 2  # killed round, then the restart


def test_a_late_institution_with_a_bad_node_config_is_recorded_in_one_sentence(restarted):
    record = results.read(restarted["folder"])
    failed = [c for c in record.clients if c.status == "failed"]
    assert len(failed) == 1, record.clients
    assert "is not a folder" in failed[0].reason and "clipart-c" in failed[0].reason
    assert "\n" not in failed[0].reason.split("DataError")[-1].strip()


def test_both_uploaders_score_and_keep_the_classifier(restarted):
    folder, work = restarted["folder"], restarted["work"]
    per_client = results.read(folder).evaluation.per_client
    assert sorted(per_client) == ["quickdraw-b", "sketch-a"]
    assert all(isinstance(s, Scored) and s.num_examples == 12 for s in per_client.values())
    for client in per_client:
        kept = (
            work / "kept" / client / "restart" / "institutions" / client / "classifier.safetensors"
        )
        assert kept.read_bytes() == (folder / "classifier.safetensors").read_bytes()

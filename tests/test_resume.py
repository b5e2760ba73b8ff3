"""Never lose an upload: kill the ServerApp during synthesis, restart it, get the same result.

The crash test runs the real `flwr run` three times on a test app whose ServerApp is the
project's own and whose ClientApp records every message it receives: once uninterrupted, once
killed (the process tree running the ServerApp, by PID) as soon as the first synthesis shard
is on disk, and once restarted on the killed run's folder. The fast tests below pin the two
library properties that make a resumed run equal an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.methods.fedbip import personalize, synthesize_all
from fedbip_flwr.server import RunFolder, train_global
from fedbip_flwr.storage import write_tensors
from fedbip_flwr.viz import quantize
from tests.helpers import (
    FLWR,
    RECORDING_CLIENT,
    SMALL,
    as_run_config,
    federation,
    flwr_env,
    make_wrapper_app,
    received,
    run_to_end,
    stop_local_superlink,
)

pytestmark = pytest.mark.long(minutes=3.6)


PASSES = 3  # shards per client: the kill lands after the first of nine
RESUME = {
    **SMALL,
    "fedbip.multiplier": PASSES,
    "fedbip.latents-per-image": 1,
    "run-name": '"resume"',
}


def digests(folder: Path) -> dict[str, str]:
    files = sorted(folder.glob("*.safetensors"))
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def serverapp_process(home: Path) -> psutil.Process | None:
    """The `flwr-simulation` process (ServerApp and Ray) under this FLWR_HOME's SuperLink."""
    database = str(home / "local-superlink" / "state.db")
    for proc in psutil.process_iter(["cmdline"]):
        if database in " ".join(proc.info["cmdline"] or []):
            for child in proc.children(recursive=True):
                if "flwr-simulation" in " ".join(child.cmdline()):
                    return child
    return None


def kill_tree(proc: psutil.Process) -> list[int]:
    family = [proc, *proc.children(recursive=True)]
    for member in family:
        member.kill()
    psutil.wait_procs(family, timeout=30)
    return [p.pid for p in family]


def run_killed_at_first_shard(home: Path, run_config: str, app: Path, shards: Path) -> list[int]:
    """Start `flwr run`, SIGKILL the ServerApp's process tree once a shard exists."""
    home.mkdir()
    command = [
        FLWR,
        "run",
        str(app),
        "--stream",
        "--run-config",
        run_config,
        "--federation-config",
        federation(3),
    ]
    with open(home / "flwr-run.log", "w") as log:
        flwr_run = subprocess.Popen(command, cwd=home, env=flwr_env(home), stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 900
        while not any(shards.glob("*.safetensors")):
            assert flwr_run.poll() is None, (home / "flwr-run.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no synthesis shard within 900 s"
            time.sleep(0.01)
        target = serverapp_process(home)
        assert target is not None, "no flwr-simulation process under this SuperLink"
        killed = kill_tree(target)
        flwr_run.wait(timeout=120)  # the stream ends once the run's process is gone
    finally:
        if flwr_run.poll() is None:
            flwr_run.kill()
            flwr_run.wait()
    return killed


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """(reference folder, crashed-then-resumed folder, facts about the crash) for the tests."""
    base = tmp_path_factory.mktemp("resume")
    app = make_wrapper_app(
        base / "app", {"recording_client": RECORDING_CLIENT}, "recording_client:app"
    )
    result = {}
    for name in ("reference", "crashed"):
        (base / name).mkdir()
        values = {**RESUME, "ldm.model": f'"{tiny_model_dir}"', "output-dir": f'"{base / name}"'}
        result[name] = {"out": base / name, "config": as_run_config(values)}
    ref = result["reference"]
    ref["status"], ref["log"] = run_to_end(base / "home-ref", ref["config"], app)

    crashed, home = result["crashed"], base / "home-crash"
    folder = RunFolder(crashed["out"] / "resume")
    try:
        crashed["killed"] = run_killed_at_first_shard(home, crashed["config"], app, folder.shards)
    finally:
        stop_local_superlink(home)  # the rest of the server side goes down too
    crashed["at_kill"] = {
        "received": received(crashed["out"]),
        "payloads": digests(folder.payloads),
        "clients_json": folder.clients.exists(),
        "metrics_json": folder.metrics.exists(),
        "shards": {
            p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in folder.shards.glob("*.safetensors")
        },
    }
    crashed["status"], crashed["log"] = run_to_end(home, crashed["config"], app)
    return result


def test_kill_lands_during_synthesis(runs):
    at_kill = runs["crashed"]["at_kill"]
    assert runs["crashed"]["killed"], "nothing was killed"
    assert at_kill["clients_json"] and not at_kill["metrics_json"]
    assert 1 <= len(at_kill["shards"]) < 3 * PASSES, at_kill["shards"]
    assert at_kill["received"] == ["0", "1", "2"]
    assert sorted(at_kill["payloads"]) == [
        "painting-0.safetensors",
        "quickdraw-0.safetensors",
        "sketch-0.safetensors",
    ], "every accepted payload is on disk before synthesis starts"


def test_restart_resumes_without_contacting_clients_or_losing_work(runs):
    crashed = runs["crashed"]
    assert crashed["status"] == "finished:completed", crashed["log"][-4000:]
    folder = RunFolder(crashed["out"] / "resume")
    assert received(crashed["out"]) == ["0", "1", "2"], "a client was asked to upload again"
    assert "resuming: 3 payloads on disk, no client is asked to upload again" in crashed["log"]
    assert digests(folder.payloads) == crashed["at_kill"]["payloads"]
    for name, identity in crashed["at_kill"]["shards"].items():
        path = folder.shards / name
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == identity, f"{name} was redone"
        assert f"{name} reused" in crashed["log"]
    assert len(list(folder.shards.glob("*.safetensors"))) == 3 * PASSES


def test_resumed_run_equals_uninterrupted_run(runs):
    ref, crashed = runs["reference"], runs["crashed"]
    assert ref["status"] == "finished:completed", ref["log"][-4000:]
    assert received(ref["out"]) == ["0", "1", "2"]
    ref_folder, folder = RunFolder(ref["out"] / "resume"), RunFolder(crashed["out"] / "resume")
    assert digests(folder.payloads) == digests(ref_folder.payloads), "clients are deterministic"
    assert digests(folder.shards) == digests(ref_folder.shards)
    assert folder.classifier.read_bytes() == ref_folder.classifier.read_bytes()
    got, want = (json.loads(f.metrics.read_text())["accuracy"] for f in (folder, ref_folder))
    assert got["per_domain"] == want["per_domain"] and got["mean"] == want["mean"]
    assert got["num_synthetic_images"] == want["num_synthetic_images"] == 3 * 18 * PASSES


# --- the library properties behind it, fast -----------------------------------------------------


def test_classifier_does_not_depend_on_global_rng_left_by_earlier_work(tmp_path):
    """A resumed run skips work that an uninterrupted one did; the classifier must not care."""
    cfg = FedBiPConfig.from_flat(
        {
            "classifier.init": "random",
            "classifier.epochs": 1,
            "classifier.image-size": 16,
            "classifier.batch-size": 4,
            "seed": 3,
        }
    )
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(8, 3, 16, 16, generator=generator) * 2 - 1
    labels = torch.arange(8) % 2
    shard = write_tensors(
        tmp_path / "a-0-pass0.safetensors", {"images": quantize(images), "labels": labels}
    )
    classifiers = []
    for index, earlier_draws in enumerate((0, 1000)):
        torch.rand(earlier_draws)  # work done (or skipped) before training
        folder = RunFolder(tmp_path / f"run-{index}")
        train_global(cfg, {"a-0": [shard]}, ["zero", "one"], folder, "cpu")
        classifiers.append(folder.classifier.read_bytes())
    assert classifiers[0] == classifiers[1]


def test_shards_are_reused_under_the_same_settings_and_redone_under_others(tiny_ldm, tmp_path):
    flat = {"synthesis.num-inference-steps": 4, "data.image-size": 32, "synthesis.batch-size": 4}
    cfg = FedBiPConfig.from_flat(flat).with_settings(
        "fedbip", concept_epochs=1, multiplier=2, eta_std=0.5
    )
    images = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    payload, _ = personalize(
        tiny_ldm,
        images,
        torch.tensor([0, 0, 1, 1, 2, 2]),
        ["circle", "square", "star"],
        "sketch",
        "sketch-0",
        cfg,
        torch.Generator().manual_seed(0),
    )
    folder = RunFolder(tmp_path)

    def shard_identities() -> list[tuple[int, int]]:
        return [(p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(folder.shards.iterdir())]

    def contents(paths: list[Path]) -> list[bytes]:
        return [p.read_bytes() for p in paths]

    first = synthesize_all(tiny_ldm, {"sketch-0": payload}, cfg, folder.shard_path)["sketch-0"]
    assert first == [folder.shard_path("sketch-0", k) for k in (0, 1)]
    first_bytes = contents(first)
    made = shard_identities()
    assert len(made) == 2
    again = synthesize_all(tiny_ldm, {"sketch-0": payload}, cfg, folder.shard_path)["sketch-0"]
    assert shard_identities() == made
    assert again == first and contents(again) == first_bytes
    other_seed = cfg.model_copy(update={"seed": 1})
    redone = synthesize_all(tiny_ldm, {"sketch-0": payload}, other_seed, folder.shard_path)[
        "sketch-0"
    ]
    assert all(new != old for new, old in zip(shard_identities(), made, strict=True))
    assert contents(redone) != first_bytes

"""`fedbip synthesize`: a run's shards made outside the ServerApp, by one process or several.

Two CPU processes (accelerate's launcher, gloo) must write exactly the bytes that one process
and the ServerApp's own in-process synthesis write; the split over processes must cover every
work unit once, balanced by image count; and a real `flwr run` with ``synthesis = "external"``
must wait for the command, fail with the command in its reason when nobody runs it, and, restarted
with the same run-name, go on to the classifier on the shards the command made. Every process
runs one torch thread: a float reduction over two threads may round a pixel differently.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fedbip_flwr import methods, shapes
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.distributed import (
    RunSynthesis,
    SynthesisTimeout,
    balanced_bins,
    open_run,
    read_run_config,
    wait_for_shards,
)
from fedbip_flwr.ldm import load_ldm
from fedbip_flwr.methods import ServerJob
from fedbip_flwr.methods.fedbip import personalize, synthesize_all
from fedbip_flwr.payload import encode_payload
from fedbip_flwr.server import RunFolder, WorkUnit
from fedbip_flwr.storage import atomic_write, read_small_tensor, write_json
from fedbip_tools import cli
from tests.helpers import (
    FLWR,
    ROOT,
    as_run_config,
    federation,
    flwr_env,
    free_port,
    run_simulation,
    run_status,
    stop_local_superlink,
)
from tests.helpers import (
    SMALL as E2E_SMALL,
)

pytestmark = pytest.mark.long(minutes=2.4)

SHOTS = {"sketch": 2, "quickdraw": 3, "painting": 4}  # unequal clients: 12, 18, 24 images
SMALL = {
    "data.image-size": 32,
    "fedbip.concept-epochs": 0,
    "synthesis.num-inference-steps": 3,
    "fedbip.multiplier": 2,
    "synthesis.batch-size": 4,
    "fedbip.eta-std": 0.5,
    "ldm.device": "cpu",
}
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def digests(folder: RunFolder) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.shards.glob("*.safetensors"))
    }


def fedbip_synthesize(folder: RunFolder, processes: int = 1) -> subprocess.CompletedProcess:
    """The command as a user runs it, on this tree's code: plain, or under accelerate."""
    command = ["-m", "fedbip_tools.cli", "synthesize", str(folder.root)]
    if processes > 1:  # accelerate's torchrun launcher; the command picks gloo on the CPU
        command = [
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--num_cpu_threads_per_process",
            "1",
            "--main_process_port",
            str(free_port()),
            *command,
        ]
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT), "FEDBIP_PROJECT_DIR": str(ROOT)}
    return subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir) -> RunFolder:
    """A run folder as the ServerApp leaves it after its round: config, uploads, clients.json."""
    folder = RunFolder(tmp_path_factory.mktemp("multisynth") / "run")
    cfg = FedBiPConfig.from_flat({"ldm.model": str(tiny_model_dir), **SMALL})
    ldm = load_ldm(tiny_model_dir)
    for domain, shots in SHOTS.items():
        data = shapes.client_train_set(domain, shots, 0, seed=0, size=cfg.data.image_size)
        payload, _ = personalize(
            ldm,
            data.images,
            data.labels,
            list(data.classes),
            domain,
            f"{domain}-0",
            cfg,
            torch.Generator().manual_seed(shots),
        )
        atomic_write(folder.payload_path(f"{domain}-0"), encode_payload(payload))
    write_json(folder.config, cfg.to_flat())
    write_json(folder.clients, [])
    return folder


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fresh_copy(run: RunFolder, dest: Path, shards: bool = False) -> RunFolder:
    shutil.copytree(run.root, dest, ignore=None if shards else shutil.ignore_patterns("shards"))
    return RunFolder(dest)


@pytest.fixture(scope="module")
def single(run, tmp_path_factory) -> tuple[RunFolder, subprocess.CompletedProcess]:
    """Plain `fedbip synthesize RUN_DIR`, one process, on a copy of the run."""
    folder = fresh_copy(run, tmp_path_factory.mktemp("single") / "run")
    return folder, fedbip_synthesize(folder)


def test_two_processes_write_the_bytes_of_one_and_of_the_server(run, single, tmp_path):
    cfg = read_run_config(run)
    in_process = fresh_copy(run, tmp_path / "in-process")
    synthesis = open_run(in_process, cfg, torch.device("cpu"))
    payloads = {client_id: upload.content for client_id, upload in synthesis.uploads.items()}
    synthesize_all(synthesis.job.ldm(), payloads, cfg, in_process.shard_path)
    want = digests(in_process)
    assert sorted(want) == [f"{d}-0-pass{k}.safetensors" for d in sorted(SHOTS) for k in (0, 1)]

    folder, done = single
    assert done.returncode == 0, done.stderr[-4000:]
    assert "(1 process(es))" in done.stdout
    assert digests(folder) == want

    pair = fresh_copy(run, tmp_path / "pair")
    done = fedbip_synthesize(pair, processes=2)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "every shard" in done.stdout and "(2 process(es))" in done.stdout, done.stdout
    assert digests(pair) == want


def test_a_rerun_keeps_finished_shards_and_makes_only_the_missing_one(single, tmp_path):
    assert single[1].returncode == 0, single[1].stderr[-4000:]
    folder = fresh_copy(single[0], tmp_path / "run", shards=True)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.shards.iterdir()}
    lost = folder.shard_path("quickdraw-0", 1)
    lost.unlink()  # as a crash mid-write leaves it: the shard was never renamed into place
    done = fedbip_synthesize(folder)
    assert done.returncode == 0, done.stderr[-4000:]
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.shards.iterdir()}
    assert sorted(after) == sorted(before)
    assert {name for name in after if after[name] != before[name]} == {lost.name}
    with safe_open(lost, "pt") as shard:  # the console counts only the shard it made
        made = shard.get_slice("labels").get_shape()[0]
    assert f"(process 1 of 1): {made} images in" in done.stderr, done.stderr


def test_the_split_covers_every_unit_once_balanced_by_images(run):
    cfg = read_run_config(run)
    synthesis = open_run(run, cfg, torch.device("cpu"))
    units = synthesis.units()
    assert [(u.client_id, u.index, u.images) for u in units] == [
        (f"{d}-0", k, 6 * SHOTS[d]) for d in sorted(SHOTS) for k in (0, 1)
    ]  # one per (client, pass), sized by the client's z(T)
    rng = random.Random(0)
    random_units = [WorkUnit(f"c{i}", 0, rng.randint(1, 500)) for i in range(23)]
    for candidates in (units, random_units):
        for count in (1, 2, 3, 5, 8):
            bins = balanced_bins(candidates, count)
            assert len(bins) == count
            flat = [unit for b in bins for unit in b]
            assert sorted(flat, key=candidates.index) == candidates  # every unit exactly once
            for b in bins:
                assert b == sorted(b, key=candidates.index)  # in the enumeration's order
            loads = [sum(u.images for u in b) for b in bins]
            assert max(loads) - min(loads) <= max(u.images for u in candidates)
    loads = sorted(sum(u.images for u in b) for b in balanced_bins(units, 2))
    assert loads == [54, 54]  # 108 images split evenly, though no client holds half of them


def test_another_method_splits_per_client_through_its_own_train_set(run, tmp_path, tiny_model_dir):
    """Prompts-only's default units: one per client, each its train_set on that upload alone,
    sized as the images it writes; the shards are the bytes of one train_set call."""
    cfg = read_run_config(run).model_copy(update={"method": "prompts-only"})
    method = methods.create("prompts-only", {"images-per-class": 1})
    job = ServerJob(cfg, cfg.data.class_list, functools.cache(lambda: load_ldm(tiny_model_dir)))
    uploads = {}
    for domain, shots in SHOTS.items():
        counts = torch.full((len(cfg.data.class_list),), shots, dtype=torch.int64)
        blob = methods.base.encode_upload(
            methods.prompts_only.PromptsOnlyMeta(
                schema_version=methods.base.SCHEMA_VERSION,
                client_id=f"{domain}-0",
                domain=domain,
                class_names=cfg.data.class_list,
                num_examples=int(counts.sum()),
            ),
            {"class_counts": counts},
        )
        uploads[f"{domain}-0"] = method.accept(blob, job)
    whole, split = RunFolder(tmp_path / "whole"), RunFolder(tmp_path / "split")
    made = method.train_set(uploads, job, whole.shard_path)
    synthesis = RunSynthesis(split, method, job, uploads)
    units = synthesis.units()
    assert [u.client_id for u in units] == sorted(uploads)
    assert synthesis.pending(units) == units
    for unit in units:
        assert synthesis.make(unit) == [split.shard_path(unit.client_id, 0)]
        assert unit.images == len(read_small_tensor(made[unit.client_id][0], "labels")) == 6
    assert synthesis.pending(units) == []
    assert digests(split) == digests(whole)


def test_the_command_refuses_a_round_that_is_not_over(run, tmp_path, capsys):
    folder = fresh_copy(run, tmp_path / "run")
    folder.clients.unlink()
    assert cli.main(["synthesize", str(folder.root)]) == 1
    assert "is not over" in capsys.readouterr().err
    assert not folder.shards.exists()


def test_the_server_waits_for_the_shards_and_times_out_with_the_command(run, single, tmp_path):
    folder = fresh_copy(run, tmp_path / "run")
    synthesis = open_run(folder, read_run_config(folder), torch.device("cpu"))
    with pytest.raises(SynthesisTimeout, match=f"fedbip synthesize {folder.root}"):
        wait_for_shards(synthesis, timeout_s=0.3, poll_s=0.05)
    assert not folder.shards.exists()  # waiting never makes a shard
    done = open_run(single[0], read_run_config(folder), torch.device("cpu"))
    wait_for_shards(done, timeout_s=0.3, poll_s=10.0)  # returns at once: every shard is there


# --- the real `flwr run`: the ServerApp waits for `fedbip synthesize` ---------------------------

EXTERNAL = {
    **E2E_SMALL,
    "data.domains": '"sketch,quickdraw"',
    "fedbip.concept-epochs": 1,
    "run-name": '"external"',
    "synthesis.where": '"external"',
    "federation.evaluation": '"server"',
}
SUPERNODES = 2


def wait_for_line(log: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, f"flwr run ended before '{text}':\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, (
            f"no '{text}' in {timeout} s:\n{log.read_text()[-4000:]}"
        )
        time.sleep(0.2)


@pytest.fixture(scope="module")
def external_runs(tmp_path_factory, tiny_model_dir):
    """Run 1: nobody runs the command, the ServerApp gives up after 3 s. Run 2 (same run-name):
    the ServerApp waits, the test runs `fedbip synthesize`, the run completes."""
    out = tmp_path_factory.mktemp("outputs")
    home = tmp_path_factory.mktemp("flwr-home")
    values = {**EXTERNAL, "ldm.model": f'"{tiny_model_dir}"', "output-dir": f'"{out}"'}
    folder = RunFolder(out / "external")
    result = {"folder": folder}
    try:
        run_id, log = run_simulation(
            home,
            as_run_config({**values, "synthesis.timeout-s": 3}),
            supernodes=SUPERNODES,
            timeout=600,
        )
        result["first"] = {
            "status": run_status(home, run_id),
            "log": log,
            "metrics": json.loads(folder.metrics.read_text()),
        }
    finally:
        stop_local_superlink(home)
    home = tmp_path_factory.mktemp("flwr-home-restart")
    log_path = home / "flwr-run.log"
    command = [
        FLWR,
        "run",
        str(ROOT),
        "--stream",
        "--run-config",
        as_run_config(values),
        "--federation-config",
        federation(SUPERNODES),
    ]
    try:
        with open(log_path, "w") as log:
            flwr_run = subprocess.Popen(
                command, cwd=home, env=flwr_env(home), stdout=log, stderr=log
            )
        try:
            wait_for_line(log_path, "waiting for external synthesis", flwr_run, timeout=300)
            synthesized = fedbip_synthesize(folder)
            result["made"] = digests(folder)
            flwr_run.wait(timeout=300)
        finally:
            if flwr_run.poll() is None:
                flwr_run.kill()
                flwr_run.wait()
        output = log_path.read_text()
        run_id = int(output.split("Successfully started run ")[1].split()[0])
        result["second"] = {
            "status": run_status(home, run_id),
            "log": output,
            "command": synthesized,
        }
    finally:
        stop_local_superlink(home)
    return result


def test_without_the_command_the_server_gives_up_naming_it(external_runs):
    first, folder = external_runs["first"], external_runs["folder"]
    assert first["status"] == "finished:failed", first["log"][-4000:]
    assert first["metrics"]["status"] == "failed"
    assert f"fedbip synthesize {folder.root}" in first["metrics"]["reason"]
    assert f"fedbip synthesize {folder.root}" in first["log"]  # logged while it waited
    assert read_run_config(folder).synthesis.where == "external"


def test_restarted_server_waits_for_the_command_and_trains_on_its_shards(external_runs):
    second, folder = external_runs["second"], external_runs["folder"]
    assert second["command"].returncode == 0, second["command"].stderr[-4000:]
    assert second["status"] == "finished:completed", second["log"][-4000:]
    assert "resuming: 2 payloads on disk, no client is asked to upload again" in second["log"]
    metrics = json.loads(folder.metrics.read_text())
    assert metrics["status"] == "completed"
    assert (
        metrics["accuracy"]["num_synthetic_images"] == 2 * 6 * 3 * 2
    )  # clients x classes x shots x z(T)
    assert folder.classifier.stat().st_size > 1_000_000
    names = [f"{d}-0-pass0.safetensors" for d in ("quickdraw", "sketch")]
    assert sorted(external_runs["made"]) == names
    assert digests(folder) == external_runs["made"]  # the server made none of its own
    for name in names:
        assert f"{name} reused" in second["log"]

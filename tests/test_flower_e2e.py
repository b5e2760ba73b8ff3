"""The real `flwr run` (simulation engine) on a tiny model: one round, outputs on disk."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch
from safetensors import safe_open

from fedbip_flwr import results, shapes
from fedbip_flwr.config import FedBiPConfig, NodeConfig
from fedbip_flwr.ldm import load_ldm
from fedbip_flwr.methods.fedbip import personalize
from fedbip_flwr.results import Scored
from fedbip_flwr.seeds import client_generator
from fedbip_tools.simulation import (
    SimulationError,
    port_is_free,
    superlink_port,
    superlink_processes,
)
from tests.helpers import (
    FLWR,
    SMALL,
    as_run_config,
    flwr_env,
    run_simulation,
    run_status,
    stop_local_superlink,
)

pytestmark = pytest.mark.long(minutes=1.4)

FLOWER_DEFAULT_PORT = 39091  # where `flwr run .` starts its local SuperLink (flwr.cli.constant)


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory, tiny_model_dir):
    home = tmp_path_factory.mktemp("flwr-home")
    out = tmp_path_factory.mktemp("outputs")
    values = {**SMALL, "ldm.model": f'"{tiny_model_dir}"', "output-dir": f'"{out}"'}
    try:
        run_id, log = run_simulation(home, as_run_config(values), supernodes=3, timeout=900)
        status = run_status(home, run_id)
    finally:
        stopped = stop_local_superlink(home)
    return {
        "status": status,
        "log": log,
        "folder": out / "e2e",
        "stopped": stopped,
        "values": values,
    }


def test_the_three_clients_take_turns_in_one_actor(e2e_run):
    """`actors=1` (the tests' federation config) starts one ClientApp process, not one per core:
    every line a ClientApp logged (each actor also logs its own termination) names one PID."""
    pids = set(re.findall(r"ClientAppActor pid=(\d+)", e2e_run["log"]))
    assert len(pids) == 1, (pids, e2e_run["log"][-4000:])


def test_the_console_reads_as_lines_a_person_can_follow(e2e_run):
    """Issue 90: no redrawn bar glued to a log line, no per-load weight bar, no third-party
    notice; per client one line when its upload step starts, one for its concepts, one as its
    upload leaves; one line each for synthesis and the classifier; the last line says what the
    run scored, how long it took and where its report is."""
    log = e2e_run["log"]
    assert "\r" not in log and "it/s]" not in log and "Loading weights" not in log
    assert "FutureWarning" not in log
    for client in ("sketch-0", "quickdraw-0", "painting-0"):
        for what in ("computing its upload (fedbip)", "concepts: 2 epochs in", "uploading 0."):
            assert log.count(f"[{client}] {what}") == 1, (client, what, log[-4000:])
    assert re.search(r"synthesis: 108 images in [\d.]+ s \([\d.]+ images/s\)", log), log
    assert re.search(r"classifier: 2 epochs in [\d.]+ s .*loss [\d.]+ -> [\d.]+", log), log
    done = next(line for line in log.splitlines() if "done in" in line)
    assert re.search(r"done in \d+ s: accuracy painting [\d.]+%, quickdraw [\d.]+%", done), done
    assert done.endswith(str(e2e_run["folder"] / "report.md")), done


def test_run_completes_and_writes_outputs(e2e_run):
    assert e2e_run["status"] == "finished:completed", e2e_run["log"][-4000:]
    assert e2e_run["stopped"], "the local SuperLink was not found to stop"
    folder = e2e_run["folder"]
    record = results.read(folder)  # validates every key and type of the record
    assert record.status == "completed"
    assert set(record.accuracy.per_domain) == {"sketch", "quickdraw", "painting"}
    for acc in record.accuracy.per_domain.values():
        assert 0.0 <= acc <= 1.0
    assert record.accuracy.mean == pytest.approx(sum(record.accuracy.per_domain.values()) / 3)
    # clients x classes x shots x 2: the default federation's 2 z(T) per image, one pass each
    assert record.accuracy.num_synthetic_images == 3 * 6 * 3 * 2
    assert list(record.seconds.phases()) == [
        "load_model",
        "round",
        "synthesis",
        "classifier",
        "evaluation",
    ]
    # the phases' clock zero, for samplers (scripts/sd_proof.py): before the run folder's end
    assert 0 < record.started_unix <= (folder / results.FILE_NAME).stat().st_mtime
    accepted = [c for c in record.clients if c.status == "accepted"]
    assert len(accepted) == 3 and all(c.payload_bytes > 0 for c in accepted)
    assert record.config["fedbip.concept-epochs"] == 2
    assert results.read_clients(folder / "clients.json") == record.clients
    assert (folder / "classifier.safetensors").stat().st_size > 1_000_000
    assert sorted(p.name for p in folder.glob("grid-*.png")) == [
        "grid-painting-0.png",
        "grid-quickdraw-0.png",
        "grid-sketch-0.png",
    ]


def test_run_writes_a_report_naming_every_client_and_linking_pictures_that_exist(e2e_run):
    folder = e2e_run["folder"]
    report = (folder / "report.md").read_text()
    for name in ("sketch-0", "quickdraw-0", "painting-0", "sketch", "quickdraw", "painting"):
        assert name in report
    linked = re.findall(r"\]\(([^)]+\.png)\)", report)
    assert {"grid-sketch-0.png", "classifier-curves.png"} <= set(linked), linked
    assert all((folder / name).is_file() for name in linked)


def test_institutions_score_the_classifier_they_get_back(e2e_run):
    """evaluation = both (the default): each client scores the classifier on its own domain's
    held-out images, which are the server's test set here, and keeps the classifier file."""
    folder = e2e_run["folder"]
    record = results.read(folder)
    per_client = record.evaluation.per_client
    assert sorted(per_client) == ["painting-0", "quickdraw-0", "sketch-0"]
    test_size = 6 * 4  # classes x data.test-per-class
    for client, score in per_client.items():
        assert isinstance(score, Scored), score
        assert score.num_examples == sum(score.per_class_total) == test_size
        assert score.accuracy == pytest.approx(sum(score.per_class_correct) / test_size)
        server_side = record.accuracy.per_domain[client.split("-")[0]]
        assert score.accuracy == pytest.approx(server_side, abs=1 / test_size + 1e-9)
        kept = folder / "institutions" / client / "classifier.safetensors"
        assert kept.read_bytes() == (folder / "classifier.safetensors").read_bytes()
    assert record.evaluation.weighted_mean == pytest.approx(
        sum(s.accuracy for s in per_client.values()) / 3
    )
    assert len(record.classifier.epoch_loss) == 2


def test_persisted_payloads_are_what_the_clients_computed(e2e_run, tiny_model_dir):
    """Plain safetensors reads them, and a local recomputation gives the same tensors."""
    cfg = FedBiPConfig.from_flat(results.read(e2e_run["folder"]).config)
    assert cfg.settings_of("fedbip").latents_per_image == 2, "the default federation's"
    ldm = load_ldm(tiny_model_dir)
    for domain in ("sketch", "quickdraw", "painting"):
        path = e2e_run["folder"] / "payloads" / f"{domain}-0.safetensors"
        with safe_open(str(path), framework="pt") as f:
            stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
            meta = f.metadata()
        assert json.loads(meta["fedbip.domain"]) == domain
        data = shapes.client_train_set(domain, cfg.data.shots_per_class, 0, seed=cfg.seed, size=32)
        local, _ = personalize(
            ldm,
            data.images,
            data.labels,
            list(data.classes),
            domain,
            f"{domain}-0",
            cfg,
            generator=client_generator(cfg, NodeConfig(), f"{domain}-0"),
        )
        assert torch.equal(stored["labels"], local.labels)
        # another process, maybe other threads: z(T) shares its noise draw, only z0 (|z0| < 0.2,
        # the VAE in another blocking, ~20 x 2^-24 relative) differs: ~1e-7 against atol 1e-5
        assert torch.allclose(stored["latents"], local.latents, atol=1e-5)
        # 2 epochs of Adam on those: rounding (~1e-8 here) stays far below one step, lr x scale
        # = 0.1 x 0.02 per coordinate; atol 1e-3, half a step, still sees a step missed or added
        assert torch.allclose(stored["domain_concept"], local.domain_concept, atol=1e-3)


def test_a_homes_flwr_commands_reach_its_own_superlink(tmp_path):
    """A SuperLink a user's own `flwr run .` left on Flower's default port (39091) must not
    answer another home's `flwr ls`: it knows none of that home's runs ("Run ID not found")."""
    foreign, home = tmp_path / "users-flwr-home", tmp_path / "home"
    env = {
        **os.environ,
        "FLWR_HOME": str(foreign),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    }
    try:
        if port_is_free(FLOWER_DEFAULT_PORT):  # else someone's SuperLink already holds it
            subprocess.run([FLWR, "ls"], env=env, capture_output=True, timeout=60, check=False)
            assert superlink_processes(foreign), "no SuperLink on Flower's default port to stand in"
        assert flwr_env(home)["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] == str(superlink_port(home))
        with pytest.raises(SimulationError, match="gave no status"):
            run_status(home, 1)
        assert superlink_processes(home), "flwr ls asked another home's SuperLink"
        assert superlink_port(home) != FLOWER_DEFAULT_PORT
    finally:
        stop_local_superlink(home)
        stop_local_superlink(foreign)

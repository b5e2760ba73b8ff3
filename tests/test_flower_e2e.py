"""The real `flwr run` (simulation engine) on a tiny model: one round, outputs on disk."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from fedbip_flwr import shapes
from fedbip_flwr.client import personalize
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import load_ldm
from fedbip_flwr.server import client_seed
from tests.flower_helpers import run_simulation, run_status, stop_local_superlink

SMALL = {
    "domains": '"sketch,quickdraw,painting"',
    "shots-per-class": 3,
    "test-per-class": 4,
    "image-size": 32,
    "classifier-image-size": 32,
    "concept-epochs": 2,
    "num-inference-steps": 4,
    "multiplier": 1,
    "classifier-epochs": 2,
    "run-name": '"e2e"',
}


def as_run_config(values: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory, tiny_model_dir):
    home = tmp_path_factory.mktemp("flwr-home")
    out = tmp_path_factory.mktemp("outputs")
    values = {**SMALL, "model": f'"{tiny_model_dir}"', "output-dir": f'"{out}"'}
    try:
        run_id, log = run_simulation(home, as_run_config(values), supernodes=3, timeout=900)
        status = run_status(home, run_id)
    finally:
        stopped = stop_local_superlink(home)
    return {"status": status, "log": log, "folder": out / "e2e", "stopped": stopped, "values": values}


def test_run_completes_and_writes_outputs(e2e_run):
    assert e2e_run["status"] == "finished:completed", e2e_run["log"][-4000:]
    assert e2e_run["stopped"], "the local SuperLink was not found to stop"
    folder = e2e_run["folder"]
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["status"] == "completed"
    assert set(metrics["accuracy"]["per_domain"]) == {"sketch", "quickdraw", "painting"}
    for acc in metrics["accuracy"]["per_domain"].values():
        assert 0.0 <= acc <= 1.0
    mean = sum(metrics["accuracy"]["per_domain"].values()) / 3
    assert metrics["accuracy"]["mean"] == pytest.approx(mean)
    assert metrics["accuracy"]["num_synthetic_images"] == 3 * 6 * 3  # clients x classes x shots
    assert {"load-model", "round", "synthesis", "classifier"} <= set(metrics["seconds"])
    accepted = [c for c in metrics["clients"] if c["status"] == "accepted"]
    assert len(accepted) == 3 and all(c["payload_bytes"] > 0 for c in accepted)
    assert metrics["config"]["concept-epochs"] == 2
    assert (folder / "classifier.safetensors").stat().st_size > 1_000_000
    assert sorted(p.name for p in folder.glob("grid-*.png")) == [
        "grid-painting-0.png", "grid-quickdraw-0.png", "grid-sketch-0.png"
    ]


def test_persisted_payloads_are_what_the_clients_computed(e2e_run, tiny_model_dir):
    """Plain safetensors reads them, and a local recomputation gives the same tensors."""
    cfg = FedBiPConfig.from_flat(
        {k: json.loads(v) if isinstance(v, str) else v for k, v in e2e_run["values"].items()}
    )
    ldm = load_ldm(tiny_model_dir)
    for domain in ("sketch", "quickdraw", "painting"):
        path = e2e_run["folder"] / "payloads" / f"{domain}-0.safetensors"
        with safe_open(str(path), framework="pt") as f:
            stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
            meta = f.metadata()
        assert json.loads(meta["fedbip.domain"]) == domain
        data = shapes.client_train_set(domain, cfg.shots_per_class, 0, seed=cfg.seed, size=32)
        local, _ = personalize(
            ldm, data.images, data.labels, list(data.classes), domain, f"{domain}-0", cfg,
            seed=client_seed(cfg.seed, f"{domain}-0"),
        )
        assert torch.equal(stored["labels"], local.labels)
        assert torch.allclose(stored["latents"], local.latents, atol=1e-5)
        assert torch.allclose(stored["domain_concept"], local.domain_concept, atol=1e-3)

"""What the test modules share, in one place (no test module imports another): running the real
`flwr run` with its own FLWR_HOME and port, every process stopped by PID; the test federations'
run configs; a method's client and server jobs on a tiny model; concept gradients by precision;
a project copy with a wrapping ClientApp; a finished run's metrics."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import psutil
import torch
from PIL import Image

from fedbip_flwr import dataset, shapes
from fedbip_flwr.concepts import diffusion_loss, initial_concepts, loss_scaler, prompt_layout
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import LDM
from fedbip_flwr.methods import ClientJob, ServerJob, create
from fedbip_flwr.methods.base import decode_upload
from fedbip_flwr.payload import encode_tensors
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
    "ACCEPTED", "FLWR", "METHOD_CFG", "ONE_SHOT", "PRECISION_CLASSES", "RECORDING_CLIENT",
    "ROOT", "SMALL", "WORDS", "as_run_config", "client_job", "completed_metrics", "federation",
    "flwr_env", "free_port", "free_port_block", "make_wrapper_app", "method_config",
    "processes_mentioning", "received", "relative_error", "reported_client", "run_folder",
    "run_simulation", "run_status", "run_to_end", "s_gradient", "server_job",
    "stop_local_superlink", "stop_process_tree", "tampered", "wait_for_port",
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




# --- Run configs of the test federations ----------------------------------------------------------


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
    "replayable-client-noise": "true",  # simulation opt-in: lets tests recompute payloads
}


def as_run_config(values: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


# Every word the tiny test models' tokenizer knows: the shapes world's classes and domains
# and the template's words.
WORDS = [*shapes.CLASSES, *shapes.DOMAINS, "a", "style", "of"]


# --- One method's client and server steps on a tiny model -----------------------------------------


METHOD_CFG = {"image-size": 32, "classifier-image-size": 32, "num-inference-steps": 4, "multiplier": 2,
       "local-epochs": 1, "classifier-epochs": 1, "shots-per-class": 2, "concept-epochs": 1,
       "replayable-client-noise": True, "classifier-init": "random"}  # fmt: skip


ONE_SHOT = ("prompts-only", "central", "local", "oscar", "fedlmg")  # peers join as their modules land


def method_config(method: str, **values) -> FedBiPConfig:
    return FedBiPConfig.from_flat({**METHOD_CFG, "method": method, **values})


def client_job(cfg: FedBiPConfig, ldm, partition: int = 0) -> ClientJob:
    data = dataset.load_client_data(cfg, partition)
    return ClientJob(cfg, data, torch.Generator().manual_seed(partition), lambda: ldm)


def server_job(cfg: FedBiPConfig, ldm) -> ServerJob:
    return ServerJob(cfg, dataset.class_names(cfg), lambda: ldm)


def tampered(blob: bytes, method: str, cfg: FedBiPConfig, change) -> bytes:
    """The upload re-encoded after ``change(tensors, metadata)``: a client that lies."""
    upload = decode_upload(blob, create(method).meta_model,
                           tuple(create(method).expected_tensors(server_job(cfg, None))), 2**40)  # fmt: skip
    tensors = dict(upload.tensors)
    meta = {f"fedbip.{k}": json.dumps(v) for k, v in upload.meta.model_dump().items()}
    change(tensors, meta)
    return encode_tensors(tensors, meta)


# --- Concept gradients in a given precision -------------------------------------------------------


PRECISION_CLASSES = ["circle", "square", "star"]


def s_gradient(ldm: LDM, dtype: torch.dtype, scaled: bool, device: str = "cpu") -> torch.Tensor:
    """d loss / d S on one SD-sized batch, with the LDM in ``dtype`` on ``device``."""
    ldm.to(device, dtype)
    layout = prompt_layout(ldm.tokenizer, "a {S} style of a {V}", 1, 1, "sketch", PRECISION_CLASSES)
    s0, v0 = initial_concepts(ldm, layout, "token")
    s = s0.clone().requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    z0, noise = torch.randn(2, 8, 4, 64, 64, generator=g)
    labels, t = torch.arange(8) % 3, torch.randint(1, 982, (8,), generator=g)
    loss = diffusion_loss(ldm, layout, "token", s, v0, z0, labels, t, noise)
    scaler = loss_scaler(ldm) if scaled else torch.amp.GradScaler(device, enabled=False)
    scaler.scale(loss).backward()
    grad = s.grad / scaler.get_scale() if scaler.is_enabled() else s.grad
    return grad.float().cpu()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# --- A project copy with a wrapping ClientApp, run to its end -------------------------------------


RECORDING_CLIENT = '''
"""The project's ClientApp, leaving one file per message it receives in the output folder."""
import uuid
from pathlib import Path

from flwr.clientapp import ClientApp

from client_app.app import train as project_train

app = ClientApp()


def record(context):
    out = Path(context.run_config["output-dir"])
    (out / f"received-{context.node_config['partition-id']}-{uuid.uuid4().hex}").touch()


@app.train()
def train(msg, context):
    record(context)
    return project_train(msg, context)
'''


def make_wrapper_app(folder: Path, modules: dict[str, str], clientapp: str) -> Path:
    """This tree's project with another ClientApp; the FAB carries the packages under test.

    Copying the packages (rather than importing whatever fedbip-flwr is installed) makes the
    ServerApp and ClientApp that run the ones of the tree being tested.
    """
    folder.mkdir()
    for package in ("fedbip_flwr", "client_app", "server_app"):
        shutil.copytree(ROOT / package, folder / package, ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = (ROOT / "pyproject.toml").read_text()
    pyproject = re.sub(r'clientapp = ".*"', f'clientapp = "{clientapp}"', pyproject)
    pyproject = pyproject.replace('name = "fedbip-flwr"', 'name = "fedbip-wrapped-client"')
    pyproject = re.sub(r"(?ms)^fab-include = \[.*?\]\n", "", pyproject)  # lists this tree's files
    (folder / "pyproject.toml").write_text(pyproject.replace('readme = "README.md"\n', ""))
    for name, source in modules.items():
        (folder / f"{name}.py").write_text(source)
    return folder


def run_to_end(home: Path, run_config: str, app: Path) -> tuple[str, str]:
    """`flwr run` the app with three clients: (final status, output); its SuperLink is stopped."""
    try:
        run_id, output = run_simulation(home, run_config, 3, timeout=900, app=app)
        return run_status(home, run_id), output
    finally:
        stop_local_superlink(home)


def received(out: Path) -> list[str]:
    return sorted(p.name.split("-")[1] for p in out.glob("received-*"))


# --- A finished run's metrics.json, as the ServerApp writes it ------------------------------------


ACCEPTED = {"sketch-0": "sketch", "quickdraw 1": "quickdraw", "painting-0": "painting"}


def reported_client(client_id: str, domain: str, **metrics: Any) -> dict[str, Any]:
    return {
        "node_id": 100 + len(client_id),
        "status": "accepted",
        "reason": "",
        "client_id": client_id,
        "domain": domain,
        "payload_bytes": 412_345,
        "metrics": {"seconds-total": 66.0, "num-examples": 96, **metrics},
    }


def completed_metrics() -> dict[str, Any]:
    """Every key a run writes today plus the optional curves and per-institution scores."""
    clients = [
        reported_client(cid, dom, **{"concept-losses": [0.5, 0.4, 0.3]}) for cid, dom in ACCEPTED.items()
    ]
    clients.append(
        {"node_id": 7, "status": "failed", "reason": "ClientApp raised | out of\nmemory",
         "client_id": "", "domain": "", "payload_bytes": 0, "metrics": None}
    )
    return {
        "status": "completed",
        "clients": clients,
        "accuracy": {
            "per_domain": {"sketch": 0.693, "quickdraw": 0.6, "painting": 0.8},
            "mean": 0.6977,
            "num_synthetic_images": 576,
            "classifier_seconds": 143.0,
        },
        "seconds": {"load-model": 2.5, "round": 66.0, "synthesis": 175.0, "classifier": 143.0},
        "classifier": {"epoch_loss": [1.8, 1.1, 0.7], "epoch_accuracy": [0.3, 0.6, 0.8]},
        "evaluation": {
            "where": "both",
            "per_client": {
                "sketch-0": {"accuracy": 0.7, "num_examples": 300, "status": "ok", "reason": ""},
                "quickdraw 1": {"accuracy": 0.5, "num_examples": 100, "status": "ok", "reason": ""},
            },
            "weighted_mean": 0.65,
        },
        "config": {"seed": 0},
    }


def run_folder(root: Path, metrics: dict[str, Any], grids: list[str]) -> Path:
    root.mkdir()
    (root / "metrics.json").write_text(json.dumps(metrics, sort_keys=True))  # as the server
    for client_id in grids:
        Image.new("RGB", (8, 4), "white").save(root / f"grid-{client_id}.png")
    return root

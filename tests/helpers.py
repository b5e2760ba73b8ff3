"""What the test modules share, in one place (no test module imports another): running the real
`flwr run` with its own FLWR_HOME and port, every process stopped by PID; the test federations'
run configs; a method's client and server jobs on a tiny model; concept gradients by precision;
a project copy with a wrapping ClientApp; a finished run's metrics; payloads to alter and a
catalogue of malformed blobs."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import shutil
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import safetensors.torch
import torch
from PIL import Image

from fedbip_flwr import dataset, shapes
from fedbip_flwr.concepts import diffusion_loss, initial_concepts, loss_scaler, prompt_layout
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import LDM
from fedbip_flwr.method_settings import MethodSettings
from fedbip_flwr.methods import ClientJob, ServerJob, create
from fedbip_flwr.methods.base import decode_upload
from fedbip_flwr.payload import Expectations, Payload, PayloadMeta, Plausibility, encode_payload
from fedbip_flwr.storage import atomic_write
from fedbip_flwr.upload import SCHEMA_VERSION, encode_tensors, read_header
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
    "ACCEPTED",
    "D",
    "FLWR",
    "LATENT_SHAPE",
    "MALFORMED",
    "METHOD_CFG",
    "N",
    "ONE_SHOT",
    "PAYLOAD_CLASSES",
    "PAYLOAD_FINGERPRINT",
    "PAYLOAD_TEMPLATE",
    "PLAUSIBLE",
    "PRECISION_CLASSES",
    "RECORDING_CLIENT",
    "ROOT",
    "SMALL",
    "WORDS",
    "as_run_config",
    "client_job",
    "completed_metrics",
    "edit_header",
    "federation",
    "flwr_env",
    "free_port",
    "free_port_block",
    "make_expectations",
    "make_meta",
    "make_payload",
    "make_wrapper_app",
    "meta_strings",
    "method_config",
    "processes_mentioning",
    "raw_blob",
    "received",
    "relative_error",
    "reported_client",
    "run_folder",
    "run_simulation",
    "run_status",
    "script",
    "run_to_end",
    "s_gradient",
    "save_payload",
    "server_job",
    "split_blob",
    "stop_local_superlink",
    "stop_process_tree",
    "tampered",
    "wait_for_port",
    "with_header",
]

ROOT = Path(__file__).resolve().parents[1]
# The checkout under test, not necessarily the one pip installed in editable mode.
CHECKOUT = {"FEDBIP_PROJECT_DIR": str(ROOT)}


# A test run's clients take turns in one Ray actor. The suite runs on two workers sharing the
# cores, so a second actor would only add its start-up (importing torch and diffusers) to every
# `flwr run`; what the tests check does not depend on two clients personalizing at once.
ACTORS = 1


def script(name: str) -> ModuleType:
    """``scripts/NAME.py`` as a module, loaded from its file (scripts are not a package, and
    no test edits ``sys.path``); loaded once, so every test shares its module state."""
    if name not in _SCRIPTS:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _SCRIPTS[name] = module
    return _SCRIPTS[name]


_SCRIPTS: dict[str, ModuleType] = {}


def federation(supernodes: int) -> str:
    """A test run's ``--federation-config`` (for tests that build the `flwr run` command)."""
    return federation_config(supernodes, cpus_per_client=1, actors=ACTORS)


def flwr_env(home: Path) -> dict[str, str]:
    return simulation.flwr_env(home, CHECKOUT)


def run_simulation(
    home: Path, run_config: str, supernodes: int, timeout: float, app: Path = ROOT
) -> tuple[int, str]:
    """`flwr run APP --stream` on the local simulation SuperLink; returns (run id, output)."""
    return simulation.run_simulation(
        home, run_config, supernodes, timeout, app, env=CHECKOUT, actors=ACTORS
    )


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains ``text`` (e.g. a test's tmp folder)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and text in " ".join(
            proc.info["cmdline"] or []
        ):
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
    "data.domains": '"sketch,quickdraw,painting"',
    "data.shots-per-class": 3,
    "data.test-per-class": 4,
    "data.image-size": 32,
    "classifier.image-size": 32,
    "fedbip.concept-epochs": 2,  # fedbip-mixture's too: it runs FedBiP's client step
    "synthesis.num-inference-steps": 4,
    "fedbip.multiplier": 1,
    "classifier.epochs": 2,
    "run-name": '"e2e"',
    # simulation opt-in: lets tests recompute payloads
    "federation.replayable-client-noise": "true",
}


def as_run_config(values: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


# Every word the tiny test models' tokenizer knows: the shapes world's classes and domains
# and the template's words.
WORDS = [*shapes.CLASSES, *shapes.DOMAINS, "a", "style", "of"]


# --- One method's client and server steps on a tiny model -----------------------------------------


METHOD_CFG = {
    "data.image-size": 32,
    "classifier.image-size": 32,
    "synthesis.num-inference-steps": 4,
    "fedbip.multiplier": 2,  # fedbip-mixture's too
    "local.epochs": 1,
    "fedlmg.local-epochs": 1,
    "espresso.epochs": 1,
    "classifier.epochs": 1,
    "data.shots-per-class": 2,
    "fedbip.concept-epochs": 1,
    "federation.replayable-client-noise": True,
    "classifier.init": "random",
}


ONE_SHOT = (
    "prompts-only",
    "central",
    "local",
    "oscar",
    "fedlmg",
    "fedld",
    "fedbip-mixture",
    "espresso",
    "fedpft",
)


def method_config(method: str, **values) -> FedBiPConfig:
    return FedBiPConfig.from_flat({**METHOD_CFG, "method": method, **values})


def own(cfg: FedBiPConfig) -> MethodSettings:
    """The run's settings of its own method (its table)."""
    return cfg.settings_of(cfg.method)


def client_job(cfg: FedBiPConfig, ldm, partition: int = 0) -> ClientJob:
    data = dataset.load_client_data(cfg.data_description, partition)
    return ClientJob(cfg, data, torch.Generator().manual_seed(partition), lambda: ldm)


def server_job(cfg: FedBiPConfig, ldm) -> ServerJob:
    return ServerJob(cfg, dataset.class_names(cfg.data_description), lambda: ldm)


def tampered(blob: bytes, method: str, cfg: FedBiPConfig, change) -> bytes:
    """The upload re-encoded after ``change(tensors, metadata)``: a client that lies."""
    upload = decode_upload(blob, create(method).meta_model, tuple(read_header(blob)[0]), 2**40)
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
        shutil.copytree(
            ROOT / package, folder / package, ignore=shutil.ignore_patterns("__pycache__")
        )
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
    """Every key a completed run writes, an institution that failed to score included."""
    clients = [
        reported_client(cid, dom, **{"concept-losses": [0.5, 0.4, 0.3]})
        for cid, dom in ACCEPTED.items()
    ]
    clients.append(
        {
            "node_id": 7,
            "status": "failed",
            "reason": "ClientApp raised | out of\nmemory",
            "client_id": "",
            "domain": "",
            "payload_bytes": 0,
        }
    )
    return {
        "status": "completed",
        "clients": clients,
        "started_unix": 1_700_000_000.0,
        "accuracy": {
            "per_domain": {"sketch": 0.693, "quickdraw": 0.6, "painting": 0.8},
            "mean": 0.6977,
            "num_synthetic_images": 576,
            "classifier_seconds": 143.0,
        },
        "seconds": {"load_model": 2.5, "round": 66.0, "synthesis": 175.0, "classifier": 143.0},
        "classifier": {"epoch_loss": [1.8, 1.1, 0.7]},
        "evaluation": {
            "where": "both",
            "per_client": {
                "sketch-0": {
                    "status": "ok",
                    "accuracy": 0.7,
                    "num_examples": 300,
                    "per_class_correct": [100, 110],
                    "per_class_total": [150, 150],
                },
                "quickdraw 1": {
                    "status": "ok",
                    "accuracy": 0.5,
                    "num_examples": 100,
                    "per_class_correct": [30, 20],
                    "per_class_total": [50, 50],
                },
                "painting-0": {"status": "failed", "reason": "no reply before the timeout"},
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


# --- Payloads: valid ones to alter, and a catalogue of malformed blobs -------------------------


N, LATENT_SHAPE, D = 6, (4, 8, 8), 32


PAYLOAD_CLASSES = ("cat", "dog", "fish")


PAYLOAD_TEMPLATE = "a {S} style of a {V}"


PAYLOAD_FINGERPRINT = "ab12"


# Stable Diffusion's schedule at T = 981, and concepts of unit scale learned for 2 steps: what
# make_payload's N(0, I) latents and concepts are plausible under (concepts: RMS <= 2.46).
PLAUSIBLE = Plausibility(
    alpha_bar=0.0057755,
    concept_scale=1.0,
    concept_init_rms=1.0,
    concept_step=0.727,
    concept_epochs=2,
    concept_batch_size=8,
    latents_per_image=1,
)


def make_meta(**overrides: Any) -> PayloadMeta:
    fields: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "client_id": "partition-0",
        "domain": "sketch",
        "timestep": 981,
        "scheduler": "PNDMScheduler",
        "num_inference_steps": 50,
        "n_s": 1,
        "n_v": 2,
        "concept_space": "token",
        "class_names": list(PAYLOAD_CLASSES),
        "prompt_template": PAYLOAD_TEMPLATE,
        "base_model": PAYLOAD_FINGERPRINT,
        "latent_shape": list(LATENT_SHAPE),
        "latent_dtype": "float32",
        "num_examples": N,
    }
    return PayloadMeta(**{**fields, **overrides})


def make_payload(
    *, latent_dtype: str = "float32", seed: int = 0, **tensors: torch.Tensor
) -> Payload:
    """A valid payload; keyword tensors replace the random ones (for building bad cases)."""
    meta = make_meta(latent_dtype=latent_dtype)
    gen = torch.Generator().manual_seed(seed)
    parts = {
        "latents": torch.randn(N, *LATENT_SHAPE, generator=gen).to(getattr(torch, latent_dtype)),
        "labels": torch.arange(N, dtype=torch.int64) % len(PAYLOAD_CLASSES),
        "domain_concept": torch.randn(meta.n_s, D, generator=gen),
        "class_concepts": torch.randn(len(PAYLOAD_CLASSES), meta.n_v, D, generator=gen),
    }
    return Payload(**{**parts, **tensors}, meta=meta)


def save_payload(p_or_blob: Payload | bytes, path: Path) -> Path:
    """A payload written as a client or server writes files (:func:`atomic_write`): encoded,
    and so validated, first; bytes as given."""
    blob = encode_payload(p_or_blob) if isinstance(p_or_blob, Payload) else bytes(p_or_blob)
    return atomic_write(path, blob)


def make_expectations(**overrides: Any) -> Expectations:
    fields: dict[str, Any] = {
        "max_bytes": 1 << 20,
        "base_model": PAYLOAD_FINGERPRINT,
        "latent_shape": LATENT_SHAPE,
        "concept_dim": D,
        "timestep": 981,
        "num_inference_steps": 50,
        "scheduler": "PNDMScheduler",
        "n_s": 1,
        "n_v": 2,
        "concept_space": "token",
        "class_names": PAYLOAD_CLASSES,
        "prompt_template": PAYLOAD_TEMPLATE,
        "domains": ("sketch", "painting"),
        "plausibility": PLAUSIBLE,
    }
    return Expectations(**{**fields, **overrides})


def meta_strings(**overrides: Any) -> dict[str, str]:
    """The ``fedbip.*`` metadata of a valid payload, with fields replaced (raw JSON values)."""
    meta = {f"fedbip.{k}": json.dumps(v) for k, v in make_meta().model_dump().items()}
    meta.update({f"fedbip.{k}": json.dumps(v) for k, v in overrides.items()})
    return meta


def raw_blob(metadata: dict[str, str] | None = None, **tensors: torch.Tensor) -> bytes:
    """Write with plain safetensors, bypassing our encoder's checks (a hostile or buggy client)."""
    parts = {**make_payload().tensors(), **tensors}
    return safetensors.torch.save(parts, metadata=meta_strings() if metadata is None else metadata)


def split_blob(blob: bytes) -> tuple[dict[str, Any], bytes]:
    size = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + size]), blob[8 + size :]


def with_header(header: Any, data: bytes = b"") -> bytes:
    """Hand-craft a blob: any header (object, list, or raw bytes) followed by ``data``."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def edit_header(edit: Callable[[dict[str, Any]], None]) -> bytes:
    """A valid blob whose header was changed by ``edit`` (data bytes untouched)."""
    header, data = split_blob(encode_payload(make_payload()))
    edit(header)
    return with_header(header, data)


def _shift_offsets(header: dict[str, Any], name: str, delta: int) -> None:
    header[name]["data_offsets"] = [o + delta for o in header[name]["data_offsets"]]


def _last_tensor(header: dict[str, Any]) -> str:
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    return max(tensors, key=lambda k: tensors[k]["data_offsets"][1])


def _second_tensor(header: dict[str, Any]) -> str:
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    return sorted(tensors, key=lambda k: tensors[k]["data_offsets"][0])[1]


def _without(metadata: dict[str, str], key: str) -> dict[str, str]:
    return {k: v for k, v in metadata.items() if k != key}


MALFORMED: dict[str, tuple[Callable[[], bytes], str]] = {
    "empty": (lambda: b"", "only 0 bytes"),
    "seven bytes": (lambda: b"\x01" * 7, "8-byte header length"),
    "huge header length": (lambda: struct.pack("<Q", 2**63) + b"{}", "exceeds"),
    "header length past end": (lambda: struct.pack("<Q", 100) + b"{}", "past the end"),
    "non-json header": (lambda: with_header(b"not json at all"), "not valid JSON"),
    "non-utf8 header": (lambda: with_header(b"\xff\xfe{}"), "UTF-8"),
    "nan literal in header": (lambda: with_header(b'{"x": NaN}'), "not valid JSON"),
    "deeply nested header": (lambda: with_header(b"[" * 100_000), "not valid JSON"),
    "header is a list": (lambda: with_header([1, 2]), "JSON array"),
    "header is a string": (lambda: with_header("latents"), "JSON string"),
    "duplicate key": (lambda: with_header(b'{"a": 1, "a": 2}'), "duplicate key"),
    "metadata not an object": (lambda: with_header({"__metadata__": [1]}), "__metadata__"),
    "metadata value not a string": (
        lambda: with_header({"__metadata__": {"fedbip.n_s": 1}}),
        "metadata values are strings",
    ),
    "entry not an object": (lambda: with_header({"latents": [0, 1]}), "header entry 'latents'"),
    "unhashable dtype": (
        lambda: with_header({"latents": {"dtype": [], "shape": [1], "data_offsets": [0, 4]}}),
        "dtype",
    ),
    "bool in shape": (
        lambda: with_header({"latents": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}),
        "invalid shape",
    ),
    "negative offsets": (
        lambda: with_header({"latents": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}),
        "data_offsets",
    ),
    "unsupported dtype": (lambda: raw_blob(labels=torch.zeros(N, dtype=torch.int32)), "'I32'"),
    "labels float": (lambda: raw_blob(labels=torch.zeros(N)), "labels must be int64"),
    "concepts float16": (
        lambda: raw_blob(domain_concept=torch.zeros(1, D, dtype=torch.float16)),
        "domain_concept must be float32",
    ),
    "latents dtype disagrees with meta": (
        lambda: raw_blob(latents=torch.zeros(N, *LATENT_SHAPE, dtype=torch.float16)),
        "latent_dtype",
    ),
    "latents wrong shape": (lambda: raw_blob(latents=torch.zeros(N, 4, 8, 7)), "latents has shape"),
    "latents wrong count": (lambda: raw_blob(latents=torch.zeros(N + 1, 4, 8, 8)), "latents has"),
    "labels wrong shape": (
        lambda: raw_blob(labels=torch.zeros(N - 1, dtype=torch.int64)),
        "labels has shape",
    ),
    "class concepts wrong class count": (
        lambda: raw_blob(class_concepts=torch.zeros(2, 2, D)),
        "class_concepts has shape",
    ),
    "concept dims disagree": (
        lambda: raw_blob(class_concepts=torch.zeros(3, 2, D + 1)),
        "class_concepts has shape",
    ),
    "domain concept 1-d": (lambda: raw_blob(domain_concept=torch.zeros(D)), "(n_s, d)"),
    "nan latents": (
        lambda: raw_blob(latents=torch.full((N, *LATENT_SHAPE), float("nan"))),
        "latents contain NaN or Inf",
    ),
    "inf class concepts": (
        lambda: raw_blob(class_concepts=torch.full((3, 2, D), float("inf"))),
        "class_concepts contain NaN or Inf",
    ),
    "label out of range": (
        lambda: raw_blob(labels=torch.tensor([0, 1, 2, 3, 0, 1])),
        "labels must lie in [0, 3)",
    ),
    "negative label": (
        lambda: raw_blob(labels=torch.tensor([0, 1, -1, 2, 0, 1])),
        "found -1",
    ),
    "schema version 2": (lambda: raw_blob(meta_strings(schema_version=2)), "schema version 2"),
    "schema version as string": (
        lambda: raw_blob(meta_strings(schema_version="1")),
        "schema version '1'",
    ),
    "schema version as bool": (
        lambda: raw_blob(meta_strings(schema_version=True)),
        "schema version True",
    ),
    "no metadata": (lambda: raw_blob({}), "missing 'fedbip.schema_version'"),
    "meta missing a field": (
        lambda: raw_blob(_without(meta_strings(), "fedbip.domain")),
        "missing ['fedbip.domain']",
    ),
    "meta unknown key": (lambda: raw_blob({**meta_strings(), "format": "pt"}), "unknown key"),
    "meta value not json": (
        lambda: raw_blob({**meta_strings(), "fedbip.n_s": "one"}),
        "'fedbip.n_s' is not valid JSON",
    ),
    "meta value out of range": (lambda: raw_blob(meta_strings(n_s=0)), "'fedbip.n_s'"),
    "meta value wrong type": (lambda: raw_blob(meta_strings(timestep="981")), "'fedbip.timestep'"),
    "meta template without slot": (
        lambda: raw_blob(meta_strings(prompt_template="a {V}")),
        "prompt_template must contain {S}",
    ),
    "meta duplicate class names": (
        lambda: raw_blob(meta_strings(class_names=["cat", "cat", "dog"])),
        "unique",
    ),
    "meta bad concept space": (
        lambda: raw_blob(meta_strings(concept_space="pixels")),
        "'fedbip.concept_space'",
    ),
    "client id with a path": (
        lambda: raw_blob(meta_strings(client_id="../../etc/passwd")),
        "'fedbip.client_id'",
    ),
    "client id hidden file": (lambda: raw_blob(meta_strings(client_id=".x")), "'fedbip.client_id'"),
    "client id too long": (
        lambda: raw_blob(meta_strings(client_id="x" * 49)),
        "'fedbip.client_id'",
    ),
    "meta num_examples disagrees": (
        lambda: raw_blob(meta_strings(num_examples=5)),
        "num_examples=5",
    ),
    "extra tensor": (
        lambda: raw_blob(extra=torch.zeros(1)),
        "unexpected tensor(s) ['extra']: expected ['latents', 'labels', 'domain_concept', "
        "'class_concepts'], found ['class_concepts', 'domain_concept', 'extra', 'labels', 'latents']",
    ),
    "missing tensor": (
        lambda: safetensors.torch.save(
            {k: v for k, v in make_payload().tensors().items() if k != "labels"}, meta_strings()
        ),
        "missing tensor(s) ['labels']: expected ['latents', 'labels', 'domain_concept', "
        "'class_concepts'], found ['class_concepts', 'domain_concept', 'latents']",
    ),
    "offsets past the end": (
        lambda: edit_header(lambda h: _shift_offsets(h, _last_tensor(h), 8)),
        "leaves a gap",
    ),
    "overlapping offsets": (
        lambda: edit_header(lambda h: _shift_offsets(h, _second_tensor(h), -8)),
        "overlaps",
    ),
    "shape disagrees with offsets": (
        lambda: edit_header(lambda h: h["labels"].update(shape=[N + 1])),
        "needs 56 bytes",
    ),
    "trailing bytes": (lambda: encode_payload(make_payload()) + b"\0" * 8, "padded"),
}

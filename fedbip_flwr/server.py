"""The server's whole job after the one round: payloads -> synthetic set -> classifier -> metrics.

Plain library code over a run folder; the Flower strategy only collects the replies and calls
:func:`accept_payload` for each, then :func:`synthesize_all`, :func:`train_global` and, where
the server holds test data, :func:`evaluate_on_server`.
Everything accepted is on disk before any heavy work, synthesis is written in shards (one per
client and pass), and a restart over the same folder resumes from what is there.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .classifier import (
    ShardImages,
    TrainSettings,
    build_classifier,
    evaluate,
    save_classifier,
    train_classifier,
)
from .concepts import count_tokens
from .config import FedBiPConfig
from .instance import start_timestep
from .ldm import LDM
from .payload import Expectations, Payload, PayloadError, decode_payload
from .storage import atomic_write, read_metadata, write_tensors_streamed
from .synthesis import SynthesisSettings, draw_etas, iter_pass
from .viz import image_grid, quantize

log = logging.getLogger(__name__)
SHARD_KEY = "fedbip.shard-key"


@dataclass(frozen=True)
class RunFolder:
    """Where one run keeps everything: payloads/, shards/, metrics.json, classifier, PNGs."""

    root: Path

    @property
    def payloads(self) -> Path:
        return self.root / "payloads"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def clients(self) -> Path:
        """Outcome of the one round; its presence means the round is complete."""
        return self.root / "clients.json"

    @property
    def classifier(self) -> Path:
        return self.root / "classifier.safetensors"

    @property
    def uploaders(self) -> Path:
        """Which node uploaded which client id: written as each upload is accepted."""
        return self.root / "uploaders.json"

    def payload_path(self, client_id: str) -> Path:
        return self.payloads / f"{client_id}.safetensors"

    def shard_path(self, client_id: str, pass_index: int) -> Path:
        return self.shards / f"{client_id}-pass{pass_index}.safetensors"

    def grid_path(self, client_id: str) -> Path:
        return self.root / f"grid-{client_id}.png"

    def persisted_payloads(self) -> dict[str, Path]:
        """Payloads already accepted by an earlier (interrupted) run, by client id."""
        return {p.stem: p for p in sorted(self.payloads.glob("*.safetensors"))}


def expectations(cfg: FedBiPConfig, ldm: LDM, class_names: list[str]) -> Expectations:
    """What every payload must agree with: the server's config and its base model."""
    return Expectations(
        max_bytes=int(cfg.max_payload_mb * 2**20),
        base_model=ldm.fingerprint,
        latent_shape=ldm.latent_shape(cfg.image_size),
        concept_dim=ldm.concept_dim,
        timestep=start_timestep(ldm.scheduler, cfg.num_inference_steps, cfg.start_timestep),
        num_inference_steps=cfg.num_inference_steps,
        scheduler=type(ldm.scheduler).__name__,
        n_s=cfg.n_s,
        n_v=cfg.n_v,
        concept_space=cfg.concept_space,
        class_names=tuple(class_names),
        prompt_template=cfg.prompt_template,
        domains=tuple(cfg.domain_list),
        phrase_tokens=functools.partial(count_tokens, ldm.tokenizer),
    )


def accept_payload(
    blob: bytes, expect: Expectations, folder: RunFolder, taken: set[str]
) -> Payload:
    """Validate an upload and persist it durably; raise PayloadError with the reason if not.

    The metadata's client_id pattern keeps it a safe file name, so it names the file directly.
    """
    payload = decode_payload(blob, expect)
    client_id = payload.meta.client_id
    if client_id in taken:
        raise PayloadError(f"a payload from '{client_id}' was already accepted")
    atomic_write(folder.payload_path(client_id), blob)
    taken.add(client_id)
    return payload


def synthesis_settings(cfg: FedBiPConfig) -> SynthesisSettings:
    return SynthesisSettings(
        multiplier=cfg.multiplier,
        num_inference_steps=cfg.num_inference_steps,
        guidance_scale=cfg.guidance_scale,
        eta_std=cfg.eta_std,
        batch_size=cfg.synthesis_batch_size,
        vae_batch_size=cfg.vae_batch_size,
        n_v=cfg.n_v,
    )


def client_seed(seed: int, client_id: str) -> int:
    """A per-client seed that survives restarts (Python's hash() is salted per process)."""
    return (seed * 1_000_003 + zlib.crc32(client_id.encode())) % 2**31


def payload_digest(payload: Payload) -> str:
    """sha256 over a payload's metadata and tensors: what its shards are made from."""
    digest = hashlib.sha256(payload.meta.model_dump_json().encode())
    for tensor in payload.tensors().values():
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def shard_key(payload_sha: str, settings: SynthesisSettings, eta: torch.Tensor) -> str:
    """Digest of everything a shard's pixels depend on, stored in the shard.

    A restart reuses a shard only under the same key, so resuming with a changed seed or
    synthesis setting recomputes instead of silently mixing two configurations.
    """
    knobs = (payload_sha, settings.num_inference_steps, settings.guidance_scale, settings.batch_size)
    return hashlib.sha256(repr(knobs).encode() + eta.contiguous().numpy().tobytes()).hexdigest()


def synthesize_all(
    ldm: LDM, payloads: Mapping[str, Payload], cfg: FedBiPConfig, folder: RunFolder
) -> dict[str, list[Path]]:
    """The synthetic shards per client, in pass order; shards on disk are reused, missing ones made.

    Each shard holds one pass over a client's z(T) as uint8 (what a PNG holds), written batch by
    batch as synthesis goes (a pass is never whole in memory) and atomically. The classifier
    reads the shards back (:class:`ShardImages`), so a resumed run trains on exactly the bytes
    an uninterrupted one would. Every shard depends only on its own payload, pass and seed,
    never on which shards were made before it.
    """
    settings = synthesis_settings(cfg)
    total = sum(len(p.labels) for p in payloads.values()) * settings.multiplier
    out: dict[str, list[Path]] = {}
    with tqdm(total=total, desc="synthesis", unit="img", mininterval=5) as bar:
        for client_id, payload in sorted(payloads.items()):
            etas = draw_etas(payload, settings, client_seed(cfg.seed, client_id))
            payload_sha = payload_digest(payload)
            out[client_id] = []
            for index, eta in enumerate(etas):
                path = folder.shard_path(client_id, index)
                key = shard_key(payload_sha, settings, eta)
                if read_metadata(path).get(SHARD_KEY) == key:
                    bar.update(len(payload.labels))
                    log.info("synthesis: %s pass %d reused from %s", client_id, index, path.name)
                else:
                    if path.exists():
                        log.warning("synthesis: %s was made under other settings; redoing it", path)
                    write_shard(path, ldm, payload, settings, eta, key, on_batch=bar.update)
                    log.info("synthesis: %s pass %d/%d written", client_id, index + 1, len(etas))
                out[client_id].append(path)
    return out


def write_shard(
    path: Path,
    ldm: LDM,
    payload: Payload,
    settings: SynthesisSettings,
    eta: torch.Tensor,
    key: str,
    on_batch: Callable[[int], None] | None = None,
) -> Path:
    """One pass as a shard (``labels`` int64, ``images`` uint8), each batch quantized and
    written as it is decoded; the same bytes as saving the whole pass at once."""
    batches = (quantize(images) for images in iter_pass(ldm, payload, settings, eta, on_batch))
    first = next(batches)
    shape = (len(payload.labels), *first.shape[1:])
    return write_tensors_streamed(
        path, {"labels": payload.labels}, ("images", torch.uint8, shape),
        itertools.chain([first], batches), {SHARD_KEY: key},
    )  # fmt: skip


def synthetic_dataset(synthetic: Mapping[str, Sequence[Path]], image_size: int) -> ShardImages:
    """All clients' shards as one dataset (clients in name order), read at ``image_size``."""
    return ShardImages([p for _, paths in sorted(synthetic.items()) for p in paths], image_size)


def first_images(paths: Sequence[Path], n: int = 12) -> torch.Tensor:
    """The first ``n`` synthetic images of a client as stored (for its grid PNG)."""
    shards = ShardImages(paths, image_size=0)
    return shards.read(torch.arange(min(n, len(shards))))


def train_global(
    cfg: FedBiPConfig,
    synthetic: Mapping[str, Sequence[Path]],
    class_names: list[str],
    folder: RunFolder,
    device: torch.device | str,
) -> tuple[nn.Module, dict]:
    """Train ResNet-18 on the pooled synthetic set (eq. 6), save it; (model, training facts).

    ``synthetic`` is :func:`synthesize_all`'s shards per client: they are read a batch at a
    time, so memory does not grow with the synthetic set.
    """
    data = synthetic_dataset(synthetic, cfg.classifier_image_size)
    settings = train_settings(cfg)
    started = time.perf_counter()
    # The initial weights come from the global RNG: seed it here, or they would depend on
    # whatever ran before in this process (e.g. how much synthesis a resumed run still did).
    torch.manual_seed(cfg.seed)
    model = build_classifier(len(class_names), cfg.classifier_init)
    losses: list[float] = []

    def on_epoch(_epoch: int, loss: float) -> None:
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.3f}")
        bar.update()

    with tqdm(total=settings.epochs, desc="classifier", unit="epoch", mininterval=5) as bar:
        train_classifier(model, data, None, settings, seed=cfg.seed, device=device,
                         on_epoch=on_epoch)  # fmt: skip
    save_classifier(model, folder.classifier, {"class_names": ",".join(class_names)})
    return model, {
        "num_synthetic_images": len(data),
        "classifier_seconds": time.perf_counter() - started,
        "epoch_loss": losses,
    }


def train_settings(cfg: FedBiPConfig) -> TrainSettings:
    return TrainSettings(
        epochs=cfg.classifier_epochs,
        lr=cfg.classifier_lr,
        momentum=cfg.classifier_momentum,
        batch_size=cfg.classifier_batch_size,
        image_size=cfg.classifier_image_size,
    )


def evaluate_on_server(
    model: nn.Module,
    test_sets: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    image_size: int,
    device: torch.device | str,
) -> dict:
    """Accuracy per domain on test sets the server holds (simulations, paper presets), and mean.

    Hold them at the classifier's size (:func:`fedbip_flwr.classifier.fit_to_classifier`): the
    scores are the same and the memory that of the classifier's input, not the LDM's."""
    per_domain = {}
    for domain, (x, y) in sorted(test_sets.items()):
        result = evaluate(model, x, y, image_size, device=device)
        per_domain[domain] = result.accuracy
        log.info("accuracy on %s: %.3f", domain, result.accuracy)
        if result.predictions.unique().numel() == 1:
            log.warning("the classifier predicts one class for every %s image", domain)
    mean = sum(per_domain.values()) / len(per_domain) if per_domain else float("nan")
    return {"per_domain": per_domain, "mean": mean}


def weighted_mean(per_client: Mapping[str, Mapping]) -> float:
    """Example-weighted mean accuracy over the institutions that scored the classifier."""
    scored = [r for r in per_client.values() if r.get("status") == "ok" and r["num_examples"]]
    total = sum(r["num_examples"] for r in scored)
    return sum(r["accuracy"] * r["num_examples"] for r in scored) / total if total else float("nan")


def load_persisted(folder: RunFolder, expect: Expectations) -> dict[str, Payload]:
    """Re-read payloads accepted before a restart (they were validated when they arrived)."""
    loaded = {}
    for client_id, path in folder.persisted_payloads().items():
        loaded[client_id] = decode_payload(path.read_bytes(), expect)
    return loaded


def save_grid(
    folder: RunFolder, client_id: str, real: torch.Tensor | None, synthetic: torch.Tensor
) -> Path:
    """PNG for a person: real images of the client's domain (where the server has them, as in
    a simulation) above its synthetic ones."""
    rows, labels = ([real], ["real"]) if real is not None else ([], [])
    return image_grid(
        [*rows, synthetic], folder.grid_path(client_id), row_labels=[*labels, "synthetic"]
    )

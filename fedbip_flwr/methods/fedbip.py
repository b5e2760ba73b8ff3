"""FedBiP (this paper): z(T) of interpolated latents plus learned concepts S and V, uploaded
once; the server denoises every z(T) m times with the client's concepts.

The steps themselves are :mod:`fedbip_flwr.instance` (z(T)), :mod:`fedbip_flwr.concepts`
(S, V), :mod:`fedbip_flwr.payload` (the upload's contract) and :mod:`fedbip_flwr.synthesis`
(eq. 5); this module only plugs them into the method shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..client import personalize
from ..payload import (
    CLUSTER_TENSOR,
    TENSOR_NAMES,
    Payload,
    PayloadMeta,
    decode_payload,
    encode_payload,
)
from ..seeds import client_seed
from ..server import (
    WorkUnit,
    expectations,
    synthesis_units,
    synthesize_all,
    synthesize_unit,
)
from ..synthesis import SynthesisSettings, draw_etas, pass_conditioning
from .base import ClientJob, Method, ServerJob, Upload, fresh_noise_set, register


@register
class FedBiP(Method):
    name = "fedbip"
    meta_model = PayloadMeta
    tensor_names = TENSOR_NAMES

    def upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        data = job.data
        payload, report = personalize(
            job.ldm(), data.images, data.labels, list(data.classes), data.domain,
            data.client_id, job.cfg, job.generator,
        )  # fmt: skip
        blob = encode_payload(payload)
        return blob, {
            "seconds-instance": report.seconds["instance"],
            "seconds-concept": report.seconds["concept"],
            "concept-losses": report.concept_losses,
            "concept-drift-s": report.concept_drift["s"],
            "concept-drift-v": report.concept_drift["v"],
        }

    def expected_tensors(self, server: ServerJob) -> tuple[str, ...]:
        """With class-clusters > 1, each z(T)'s sub-cluster too."""
        return (*TENSOR_NAMES, CLUSTER_TENSOR) if server.cfg.class_clusters > 1 else TENSOR_NAMES

    def audit(self, blob: bytes, max_bytes: int) -> Upload:
        """The full payload contract that needs no model: schema, shapes, dtypes, labels."""
        return as_upload(decode_payload(blob, max_bytes=max_bytes))

    def accept(self, blob: bytes, server: ServerJob) -> Upload:
        """The full payload contract (docs/payload.md), against the server's model and config."""
        return as_upload(decode_payload(blob, expectations(server.cfg, server.ldm(), server.class_names)))

    def train_set(
        self, uploads: Mapping[str, Upload], server: ServerJob, shard_path: Callable[[str, int], Path]
    ) -> dict[str, list[Path]]:
        payloads = {client_id: upload.content for client_id, upload in uploads.items()}
        if server.cfg.synthesis_start == "fresh-noise":
            return concept_only(payloads, server, shard_path)
        return synthesize_all(server.ldm(), payloads, server.cfg, shard_path)

    def work_units(self, uploads: Mapping[str, Upload], server: ServerJob) -> list[WorkUnit]:
        """One per (client, pass): the shards :meth:`train_set` writes, one by one."""
        payloads = {client_id: upload.content for client_id, upload in uploads.items()}
        return synthesis_units(payloads, server.cfg.multiplier)

    def make_unit(
        self,
        unit: WorkUnit,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> list[Path]:
        payload = uploads[unit.client_id].content
        if server.cfg.synthesis_start == "fresh-noise":
            return [concept_only_unit(payload, server, unit, shard_path)]
        return [synthesize_unit(server.ldm(), payload, server.cfg, unit, shard_path)]


def concept_only(
    payloads: Mapping[str, Payload], server: ServerJob, shard_path: Callable[[str, int], Path]
) -> dict[str, list[Path]]:
    """The paper's concept-only ablation: each pass's images from fresh noise toward the
    client's learned concepts (S perturbed by that pass's eta, as in synthesis), never from
    its z(T); as many images as FedBiP makes, in the same (client, pass) units."""
    out: dict[str, list[Path]] = {}
    for unit in synthesis_units(payloads, server.cfg.multiplier):
        path = concept_only_unit(payloads[unit.client_id], server, unit, shard_path)
        out.setdefault(unit.client_id, []).append(path)
    return out


def concept_only_unit(
    payload: Payload, server: ServerJob, unit: WorkUnit, shard_path: Callable[[str, int], Path]
) -> Path:
    """One concept-only shard: pass ``unit.index``'s eta, noise of that pass's own."""
    settings = SynthesisSettings.from_config(server.cfg)
    eta = draw_etas(payload, settings, client_seed(server.cfg.seed, unit.client_id))[unit.index]
    return fresh_noise_set(
        server, f"{unit.client_id}/pass{unit.index}",
        pass_conditioning(server.ldm(), payload, settings, eta),
        payload.labels, shard_path(unit.client_id, unit.index),
        None if payload.latent_clusters is None else payload.concept_rows,
    )  # fmt: skip


def as_upload(payload: Payload) -> Upload:
    """A decoded (validated) payload as the server keeps every method's upload."""
    return Upload(meta=payload.meta, tensors=payload.tensors(), content=payload)

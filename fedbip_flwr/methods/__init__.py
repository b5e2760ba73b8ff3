"""One registry of one-shot FL methods, each one module, created by name (like timm's models).

FedBiP and its instance-free mixture mode (fedbip-mixture), its peers OSCAR, FedLMG, FedLD,
Espresso and FedPFT, and the references Prompts-only, Central and Local, all have the shape of
:class:`~fedbip_flwr.methods.base.Method`; FedAvg (multi-round, Flower's own strategy) is a
:class:`~fedbip_flwr.methods.base.MultiRound`. Their names and settings are listed in
:data:`fedbip_flwr.method_settings.METHOD_SETTINGS`. ``flwr run`` (run config ``method``), the
benchmark and the tests create them here, so no method is implemented twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import dataset
from ..config import FedBiPConfig, NodeConfig
from ..dp import EPSILON_METRIC
from ..ldm import LDM
from ..partitions import DataError
from ..policy import UploadPolicy
from ..results import SENT_BYTES, SENT_IMAGES, SENT_SECONDS, SENT_SKIPPED
from ..seeds import client_generator
from ..upload import PayloadError, upload_method
from . import (
    central,
    espresso,
    fedavg,
    fedbip,
    fedbip_mixture,
    fedld,
    fedlmg,
    fedpft,
    local,
    oscar,
    prompts_only,
)
from .base import (
    ClientJob,
    Method,
    MethodSettings,
    MultiRound,
    ServerJob,
    Teacher,
    Upload,
    create,
    create_for,
    create_one_shot,
    names,
    one_shot_for,
    register,
    upload_kinds,
)

__all__ = [
    "ClientJob",
    "Method",
    "MethodSettings",
    "MultiRound",
    "ServerJob",
    "Teacher",
    "Upload",
    "audit_upload",
    "central",
    "create",
    "espresso",
    "create_for",
    "create_one_shot",
    "fedavg",
    "fedbip",
    "fedbip_mixture",
    "fedld",
    "fedlmg",
    "fedpft",
    "institution_upload",
    "local",
    "names",
    "one_shot_for",
    "oscar",
    "prompts_only",
    "register",
    "upload_kinds",
]

log = logging.getLogger(__name__)


def audit_upload(blob: bytes, max_bytes: int) -> Upload:
    """Any method's upload checked on its own, without a server's model or run config: the
    method its header names, then that method's exact tensor names, layout, finite floats and
    metadata schema (FedBiP's full payload contract). What ``fedbip inspect`` shows; the
    server's :meth:`Method.accept` adds the checks against its own model and classes."""
    name = upload_method(blob, max_bytes)
    try:
        method = create_one_shot(name)
    except ValueError as err:
        raise PayloadError(str(err)) from None
    return method.audit(blob, max_bytes)


def institution_upload(
    cfg: FedBiPConfig,
    node: NodeConfig,
    ldm: Callable[[], LDM],
    device: torch.device | None = None,
    policy: UploadPolicy | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """An institution's whole job: its own images -> the one upload's bytes, and the metrics
    sent beside it, for the run's method. The ClientApp and ``fedbip personalize`` both call
    this, so what an institution computes and audits offline is exactly what it would upload.
    The ClientApp passes the institution's ``policy``: its caps on images and bytes are checked
    once the images are counted, before the model loads, and on the upload before it leaves
    (:class:`~fedbip_flwr.policy.PolicyRefusal`); offline, nothing leaves."""
    started = time.perf_counter()
    method = one_shot_for(cfg)
    data = dataset.institution_data(cfg.data_description, node)
    if (
        len(data) > cfg.federation.max_images_per_client
    ):  # the server would refuse the upload: fail before the work
        log.error("[%s] holds %d private images", data.client_id, len(data))  # its count stays here
        raise DataError(
            f"{data.client_id} holds more private images than the run's "
            f"federation.max-images-per-client {cfg.federation.max_images_per_client} (counted in "
            "its own log): the server refuses an upload that stands for more (ask its operator to "
            "raise it, or hold fewer images)"
        )
    if policy is not None:
        policy.check_before_compute(len(data), lambda: method.upload_floor(cfg, len(data)))
    log.info(
        "[%s] computing its upload (%s) from its %d private images (torch threads: %d)",
        data.client_id,
        cfg.method,
        len(data),
        torch.get_num_threads(),
    )
    generator = client_generator(cfg, node, data.client_id)
    job = ClientJob(cfg, data, generator, ldm, device or torch.device("cpu"))
    blob, metrics = method.upload(job)
    if policy is not None:
        policy.check_size(len(blob))
    if (
        EPSILON_METRIC in metrics
    ):  # a DP upload: nothing beside it that its guarantee does not cover
        if cfg.federation.replayable_client_noise:
            log.warning(
                "[%s] federation.replayable-client-noise is on: a server that replays it removes "
                "the DP noise",
                data.client_id,
            )
        return blob, {EPSILON_METRIC: metrics[EPSILON_METRIC]}
    return blob, {
        SENT_IMAGES: len(data),
        SENT_SKIPPED: data.skipped_files,
        SENT_BYTES: len(blob),
        **metrics,
        SENT_SECONDS: time.perf_counter() - started,
    }

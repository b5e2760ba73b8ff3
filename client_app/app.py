"""FedBiP ClientApp: on the single ``train`` message, personalize and upload once.

Thin over the library: load this node's partition, run instance- and concept-level
personalization (:func:`fedbip_flwr.client.personalize`), reply with the safetensors payload.
An exception here becomes a Flower error reply whose reason the server records.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedbip_flwr import dataset
from fedbip_flwr.client import personalize
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import LDM, load_for_run
from fedbip_flwr.logs import setup_logging
from fedbip_flwr.payload import encode_payload
from fedbip_flwr.server import client_seed
from fedbip_flwr.wire import payload_content

log = logging.getLogger("fedbip_flwr.client_app")
NODE_KEYS = ("data-root",)  # run-config keys a SuperNode may set for itself
app = ClientApp()


@functools.lru_cache(maxsize=1)
def _model(model: str, device: str, half_precision: bool, image_size: int) -> LDM:
    """One frozen LDM per process: a simulation actor serves several clients."""
    return load_for_run(model, device, half_precision, image_size)


def node_overrides(run_config: Mapping, node_config: Mapping) -> dict:
    """An institution's own ``data-root`` (``--node-config``) wins over the run config's."""
    local = {key: node_config[key] for key in NODE_KEYS if key in node_config}
    return {**run_config, **local}


@app.train()
def train(msg: Message, context: Context) -> Message:
    setup_logging()
    started = time.perf_counter()
    cfg = FedBiPConfig.from_flat(node_overrides(context.run_config, context.node_config))
    partition_id = int(context.node_config["partition-id"])
    data = dataset.load_client_data(cfg, partition_id, context.node_config.get("num-partitions"))
    domain, client_id = data.domain, data.client_id
    log.info("[%s] %d private images, personalizing", client_id, len(data))
    ldm = _model(cfg.model, cfg.device, cfg.half_precision, cfg.image_size)
    payload, report = personalize(
        ldm,
        data.images,
        data.labels,
        list(data.classes),
        domain,
        client_id,
        cfg,
        seed=client_seed(cfg.seed, client_id),
    )
    blob = encode_payload(payload)
    metrics = {
        "num-examples": len(data),
        "payload-bytes": len(blob),
        "seconds-instance": report.seconds["instance"],
        "seconds-concept": report.seconds["concept"],
        "seconds-total": time.perf_counter() - started,
        "concept-loss-first": report.concept_losses[0] if report.concept_losses else 0.0,
        "concept-loss-last": report.concept_losses[-1] if report.concept_losses else 0.0,
    }
    log.info("[%s] uploading %.2f MB once", client_id, len(blob) / 1e6)
    return Message(content=payload_content(blob, metrics), reply_to=msg)

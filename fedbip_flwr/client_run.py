"""A ClientApp's answers for a one-shot method: on ``train`` its one upload (what the run's
method computes from this institution's images), on ``evaluate`` its score of the classifier
sent back, which it keeps.

Who this node is and where its data lives come from its own node config
(:class:`~fedbip_flwr.config.NodeConfig`): a real institution names its folder, domain phrase
and client id there; a simulated node gets a partition id. So does what it lets leave it (its
upload policy, :mod:`fedbip_flwr.policy`), checked before any image is read or model loaded;
every upload it sends is recorded in its own output folder (:mod:`fedbip_flwr.upload_record`).
Its randomness never comes from anything the server sets
(:func:`fedbip_flwr.seeds.client_generator`). An exception here becomes a Flower error reply
whose reason the server records.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict

from . import dataset, upload_record
from .classifier import load_classifier_bytes
from .client import kept_classifier_path, score_classifier
from .config import FedBiPConfig, NodeConfig
from .folders import UnreadableImages
from .ldm import LDM, load_for_run, release_cached_memory, select_device
from .methods import Method, MultiRound, institution_upload
from .policy import REFUSAL_PREFIX, PolicyRefusal, UploadRequest
from .results import SENT_ACCURACY
from .storage import atomic_write
from .wire import (
    METRICS_RECORD,
    RUN_FOLDER,
    UPLOADED,
    classifier_bytes,
    message_config,
    payload_content,
    refused_content,
    skipped_content,
)

log = logging.getLogger("fedbip_flwr.client_app")  # what the ClientApp logs, under its name


@functools.lru_cache(maxsize=1)
def _model(model: str, device: str, half_precision: bool, image_size: int) -> LDM:
    """One frozen LDM per process: a simulation actor serves several clients."""
    return load_for_run(model, device, half_precision, image_size)


def configs(context: Context) -> tuple[FedBiPConfig, NodeConfig]:
    """The run config with this institution's own keys (data.root, ldm.model, ...) over it."""
    node = NodeConfig.from_flat(context.node_config)
    return FedBiPConfig.from_flat({**context.run_config, **node.run_overrides()}), node


@contextlib.contextmanager
def names_stay_here() -> Iterator[None]:
    """An error reply carries its text to the server: unreadable files are named in this
    institution's log and counted, not named, in the reply."""
    try:
        yield
    except UnreadableImages as err:
        log.error("%s", err)
        raise err.for_server() from None


def check_policy(method: Method | MultiRound, cfg: FedBiPConfig, node: NodeConfig) -> None:
    """The run's request against this institution's upload policy, from the run config alone:
    :class:`~fedbip_flwr.policy.PolicyRefusal` where the policy refuses it."""
    request = UploadRequest(
        method=method.name,
        kinds=method.uploads,
        guarantee=method.settings.guarantee,
        # the institution's own seed, not the run's, then draws its noise
        replayable_noise=cfg.federation.replayable_client_noise and node.seed is None,
    )
    node.upload_policy.check_request(request)


def upload_reply(method: Method, msg: Message, cfg: FedBiPConfig, node: NodeConfig) -> RecordDict:
    """The one upload (or, where the server already holds it, the note that it does; or, where
    this institution's policy refuses it, why), recorded in its own folder as it leaves."""
    _, client_id = dataset.institution_identity(cfg.data_description, node)
    if client_id in message_config(msg).get(UPLOADED, []):
        log.info("[%s] the server already holds this upload; not personalizing again", client_id)
        return skipped_content(client_id)
    ldm = functools.partial(
        _model, cfg.ldm.model, cfg.ldm.device, cfg.ldm.half_precision, cfg.data.image_size
    )
    try:
        check_policy(method, cfg, node)
        device = select_device(cfg.ldm.device)
        blob, metrics = institution_upload(cfg, node, ldm, device, node.upload_policy)
    except PolicyRefusal as refusal:
        log.warning("[%s] %s%s", client_id, REFUSAL_PREFIX, refusal.detail)
        return refused_content(client_id, refusal.reason)
    if (released := release_cached_memory(device)) is not None:
        log.info(
            "[%s] CUDA memory reserved after the step: %.0f MiB, %.0f MiB once the cache was "
            "released (%.0f MiB allocated)",
            client_id,
            released[0] / 2**20,
            released[1] / 2**20,
            torch.cuda.memory_allocated(device) / 2**20,
        )
    record = upload_record.sent(blob, msg.metadata.run_id)
    kept = upload_record.keep(record, upload_record.records_path(_own_folder(cfg, node), client_id))
    log.info("[%s] uploading %s; recorded in %s", client_id, upload_record.summary(record), kept)
    return payload_content(blob, metrics, client_id)


def _own_folder(cfg: FedBiPConfig, node: NodeConfig) -> str:
    """Where this institution keeps what it gets back and what it sent: its own output-dir."""
    return node.output_dir or cfg.output_dir


def score_reply(method: Method, msg: Message, cfg: FedBiPConfig, node: NodeConfig) -> RecordDict:
    """This institution's score of the classifier the server sent, on its own held-out
    images; the classifier is kept in its own output folder."""
    domain, client_id = dataset.institution_identity(cfg.data_description, node)
    blob = classifier_bytes(msg, int(cfg.federation.max_payload_mb * 2**20))
    model = load_classifier_bytes(blob, cfg.data.class_list)
    test = dataset.institution_test_set(cfg.data_description, node, domain)
    scores = score_classifier(model, test, cfg.classifier.image_size, method.settings.private)
    run_folder = message_config(msg)[RUN_FOLDER]
    kept = kept_classifier_path(_own_folder(cfg, node), run_folder, client_id)
    atomic_write(kept, blob)
    log.info(
        "[%s] the classifier scores %.1f%% on its %d held-out images; kept as %s",
        client_id,
        100 * scores[SENT_ACCURACY],
        len(test.labels),
        kept,
    )
    return RecordDict({METRICS_RECORD: MetricRecord(scores)})

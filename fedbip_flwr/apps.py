"""What the ServerApp and the ClientApp do for the run's method: the one place where a
multi-round method's path (its own Flower strategy and client hooks) parts from the one-shot
path every other method shares (:mod:`fedbip_flwr.server_run`, :mod:`fedbip_flwr.client_run`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid

from . import client_run, dataset, methods, server_run
from .classifier import check_classifier_init
from .config import FedBiPConfig, NodeConfig
from .ldm import select_device
from .logs import setup_logging
from .methods import Method, MultiRound
from .report import write_report
from .results import RunResults
from .server import RunFolder

log = logging.getLogger("fedbip_flwr.server_app")


@dataclass(frozen=True)
class _OneShot:
    """One upload per client, then the server's training set, classifier and scores."""

    method: Method

    def serve(
        self, grid: Grid, cfg: FedBiPConfig, folder: RunFolder, device: torch.device
    ) -> RunResults:
        return server_run.run_one_shot(self.method, grid, cfg, folder, device)

    def train(self, msg: Message, cfg: FedBiPConfig, node: NodeConfig) -> RecordDict:
        return client_run.upload_reply(self.method, msg, cfg, node)

    def evaluate(self, msg: Message, cfg: FedBiPConfig, node: NodeConfig) -> RecordDict:
        return client_run.score_reply(self.method, msg, cfg, node)


@dataclass(frozen=True)
class _Rounds:
    """Rounds on the method's own Flower strategy, scored like every other method."""

    method: MultiRound

    def serve(
        self, grid: Grid, cfg: FedBiPConfig, folder: RunFolder, device: torch.device
    ) -> RunResults:
        return server_run.run_rounds(self.method, grid, cfg, folder, device)

    def train(self, msg: Message, cfg: FedBiPConfig, node: NodeConfig) -> RecordDict:
        # a refusal fails the round's reply, which Flower's strategy leaves out of the average
        client_run.check_policy(self.method, cfg, node)
        return self.method.client_round(msg, cfg, node, select_device(cfg.ldm.device))

    def evaluate(self, msg: Message, cfg: FedBiPConfig, node: NodeConfig) -> RecordDict:
        return self.method.client_evaluate(msg, cfg, node)


def _path(cfg: FedBiPConfig) -> _OneShot | _Rounds:
    """The run's method, on its path."""
    method = methods.create_for(cfg)
    return _Rounds(method) if isinstance(method, MultiRound) else _OneShot(method)


def serve(grid: Grid, context: Context) -> RunResults:
    """One run: its folder and checks, the method's work, then the report."""
    setup_logging()
    started = time.perf_counter()
    cfg = FedBiPConfig.from_flat(context.run_config)
    folder = server_run.open_run_folder(cfg, context.run_id)
    dataset.verify(cfg.data_description)
    check_classifier_init(cfg.classifier.init, cfg.ldm.model)  # fails now, not after synthesis
    record = _path(cfg).serve(grid, cfg, folder, select_device(cfg.ldm.device))
    report = write_report(folder.root)
    log.info(
        "done in %.0f s: %s; report: %s", time.perf_counter() - started, record.headline(), report
    )
    return record


def train(msg: Message, context: Context) -> Message:
    """This client's reply to ``train``: its one upload, or its part of a round."""
    setup_logging()
    with client_run.names_stay_here():
        cfg, node = client_run.configs(context)
        return Message(content=_path(cfg).train(msg, cfg, node), reply_to=msg)


def evaluate(msg: Message, context: Context) -> Message:
    """This client's score of the classifier sent back, on its own held-out images."""
    setup_logging()
    with client_run.names_stay_here():
        cfg, node = client_run.configs(context)
        return Message(content=_path(cfg).evaluate(msg, cfg, node), reply_to=msg)

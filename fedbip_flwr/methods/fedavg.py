"""FedAvg (reference, multi-round): the clients train the shared ResNet-18 on their real images
for ``fedavg-rounds`` rounds of ``fedavg-local-epochs`` each, and Flower's own FedAvg strategy
averages the weights. Not one-shot: it is what FedBiP's single upload is compared against.

The client's round reads the same private data as every other method
(:func:`fedbip_flwr.dataset.institution_data`) and trains with the shared classifier recipe;
the server writes the same run folder (classifier, metrics.json, report.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy import Result
from torch import nn

from .. import dataset, results
from ..classifier import build_classifier, save_classifier, train_classifier
from ..client import score_classifier
from ..config import FedBiPConfig, NodeConfig
from ..method_settings import FedAvgSettings
from ..results import SENT_ACCURACY, SENT_IMAGES, Accuracy, Evaluation, RunResults, Seconds
from ..seeds import client_generator
from ..server import RunFolder, train_settings
from .base import MultiRound, register

log = logging.getLogger(__name__)
ARRAYS, METRICS = "arrays", "metrics"  # Flower's FedAvg's record keys


@register
class FedAvg(MultiRound):
    name = "fedavg"
    settings: FedAvgSettings

    def client_round(self, msg: Message, cfg: FedBiPConfig, node: NodeConfig, device: torch.device) -> RecordDict:
        """One client's round: the global weights, trained locally on its own images."""
        data = dataset.institution_data(cfg.data, node)
        model = build_classifier(len(data.classes), "random")
        model.load_state_dict(msg.content[ARRAYS].to_torch_state_dict())
        generator = client_generator(cfg, node, data.client_id)
        seed = int(torch.randint(2**31 - 1, (1,), generator=generator))
        train_classifier(model, data.images, data.labels, train_settings(cfg, self.settings.local_epochs), seed=seed, device=device)
        return RecordDict({
            ARRAYS: ArrayRecord(model.cpu().state_dict()),
            METRICS: MetricRecord({SENT_IMAGES: len(data)}),
        })  # fmt: skip

    def client_evaluate(self, msg: Message, cfg: FedBiPConfig, node: NodeConfig) -> RecordDict:
        """Flower's federated evaluation: the global weights scored on the client's held-out images."""
        domain, _ = dataset.institution_identity(cfg.data, node)
        model = build_classifier(len(cfg.class_list), "random")
        model.load_state_dict(msg.content[ARRAYS].to_torch_state_dict())
        scores = score_classifier(model, dataset.institution_test_set(cfg.data, node, domain),
                                  cfg.classifier_image_size)  # fmt: skip
        return RecordDict({METRICS: MetricRecord(
            {SENT_ACCURACY: scores[SENT_ACCURACY], SENT_IMAGES: scores[SENT_IMAGES]}
        )})  # fmt: skip

    def run_server(
        self,
        grid: Grid,
        cfg: FedBiPConfig,
        folder: RunFolder,
        evaluate: Callable[[nn.Module], Accuracy],
    ) -> RunResults:
        """Flower's FedAvg over every connected client; the global model saved and scored.

        ``evaluate(model)`` scores on the server's test sets (empty where it holds none);
        institutions score every round's model on their own images when ``evaluation`` asks.
        """
        started = time.perf_counter()
        torch.manual_seed(cfg.seed)
        model = build_classifier(len(cfg.class_list), cfg.classifier_init, cfg.model)
        on_clients = cfg.evaluation in ("clients", "both")
        strategy = FlowerFedAvg(
            fraction_train=1.0,
            fraction_evaluate=1.0 if on_clients else 0.0,
            min_train_nodes=cfg.min_clients,
            min_available_nodes=cfg.min_clients,
            min_evaluate_nodes=cfg.min_clients if on_clients else 0,
        )
        result = strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=self.settings.rounds,
                                timeout=cfg.reply_timeout_s)  # fmt: skip
        if len(result.arrays) == 0:
            raise RuntimeError("FedAvg produced no global model: every client failed (see the log)")
        model.load_state_dict(result.arrays.to_torch_state_dict())
        save_classifier(model, folder.classifier, {"class_names": ",".join(cfg.class_list)})
        record = RunResults(
            status="completed",
            config=cfg.to_flat(),
            accuracy=evaluate(model),
            evaluation=_last_evaluation(cfg, result) if on_clients else None,
            seconds=Seconds(rounds=time.perf_counter() - started),
        )
        results.write(record, folder.root)
        return record


def _last_evaluation(cfg: FedBiPConfig, result: Result) -> Evaluation | None:
    """The institutions' mean accuracy of the last round they scored, if any; Flower's FedAvg
    aggregates their scores, so none is kept per institution."""
    if not result.evaluate_metrics_clientapp:
        return None
    last = max(result.evaluate_metrics_clientapp)
    mean = float(result.evaluate_metrics_clientapp[last][SENT_ACCURACY])  # as client_evaluate sent
    return Evaluation(where=cfg.evaluation, per_client={}, weighted_mean=mean, round=last)

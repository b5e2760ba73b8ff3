"""FedAvg (reference, multi-round): the clients train on their real images for ``fedavg.rounds``
rounds of ``fedavg.local-epochs`` each, and Flower's own FedAvg strategy averages what they
send back. Not one-shot: it is what FedBiP's single upload is compared against.

``fedavg.part`` says what is federated:

- ``all`` (default): the whole ResNet-18, from ``classifier.init``, trained with the shared
  classifier recipe; every weight and BatchNorm statistic travels.
- ``head``: only a linear head (512 -> C) on the frozen backbone shipped with the base model,
  FedPFT's encoder (:func:`fedbip_flwr.clusters.public_encoder`): the Flower FedPFT baseline's
  comparison. A client computes its images' features once a round (no augmentation, as FedPFT)
  and trains the global head on them with FedPFT's head recipe (:func:`~fedbip_flwr.methods.fedpft.fit_head`: AdamW with
  ``fedpft.head-lr`` and ``fedpft.head-batch-size``, ``fedavg.local-epochs`` per round); only
  the head's ``weight`` (C, 512) and ``bias`` (C,) travel, a few kilobytes. The server names
  its backbone's fingerprint in every message, and a client whose own base model ships another
  refuses the round. The global classifier is that backbone with the averaged head, as FedPFT's
  :meth:`~fedbip_flwr.methods.fedpft.FedPFT.final_models` builds it.

Everything received is checked before it is loaded (:func:`checked_arrays`): the client refuses
a global model whose arrays are not exactly the model's names, shapes and dtypes, or hold NaN or
Inf; the server drops such a client reply (and one claiming more than
``federation.max-images-per-client`` images, its averaging weight) before Flower's FedAvg
averages it (:class:`CheckedFedAvg`).

The client's round reads the same private data as every other method
(:func:`fedbip_flwr.dataset.institution_data`); the server writes the same run folder
(classifier, metrics.json, report.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy import Result
from torch import nn

from .. import dataset, results
from ..classifier import build_classifier, save_classifier, train_classifier
from ..client import score_classifier
from ..clusters import public_encoder
from ..config import FedBiPConfig, NodeConfig
from ..method_settings import FedAvgSettings, FedPFTSettings
from ..policy import UploadKind
from ..results import SENT_ACCURACY, SENT_IMAGES, Accuracy, Evaluation, RunResults, Seconds
from ..seeds import client_generator
from ..server import RunFolder, train_settings
from ..upload import PayloadError, check_dtype_shape, check_finite, refuse_mismatch
from .base import MultiRound, register
from .fedpft import encoder_identity, fit_head

log = logging.getLogger(__name__)
ARRAYS, METRICS, CONFIG = "arrays", "metrics", "config"  # Flower's FedAvg's record keys
ROUND = "server-round"  # what Flower's FedAvg puts in every train message's config
ENCODER = "encoder"  # part = head: the server's backbone fingerprint, in every message's config
_SEED_BOUND = 2**31 - 1
_SHOWN_NAMES = 4  # names an error lists at most (a hostile record may hold thousands)


@register
class FedAvg(MultiRound):
    name = "fedavg"
    # uploads: its trained weights, every round
    uploads = frozenset({UploadKind.CLASSIFIER})
    settings: FedAvgSettings

    @property
    def head_only(self) -> bool:
        return self.settings.part == "head"

    def classifier(self, cfg: FedBiPConfig, init: str) -> nn.Module:
        """The global classifier's architecture: a ResNet-18 from ``init`` (part all), or the
        frozen backbone shipped with the base model with a fresh linear head (part head)."""
        return build_classifier(
            len(cfg.data.class_list), "pretrained" if self.head_only else init, cfg.ldm.model
        )

    def federated(self, model: nn.Module) -> nn.Module:
        """The part of ``model`` whose weights travel and are averaged."""
        return model.fc if self.head_only else model

    def fresh_part(self, cfg: FedBiPConfig) -> nn.Module:
        """The federated part alone, randomly initialised: the head's shapes are any
        ResNet-18's, so no backbone is read for them."""
        return self.federated(build_classifier(len(cfg.data.class_list), "random"))

    def client_round(
        self, msg: Message, cfg: FedBiPConfig, node: NodeConfig, device: torch.device
    ) -> RecordDict:
        """One client's round: the server's message checked, then :meth:`local_update`."""
        data = dataset.institution_data(cfg.data_description, node)
        if self.head_only:
            self._check_encoder(msg, cfg)
        rounds = self.settings.rounds
        server_round = _config(msg).get(ROUND, 1)
        # bounded: the round sizes the client's draw (a hostile server could ask for 10**12)
        if (
            isinstance(server_round, bool)
            or not isinstance(server_round, int)
            or not 1 <= server_round <= rounds
        ):
            raise PayloadError(
                f"the server calls this round {server_round!r}, not one of 1..{rounds} (fedavg.rounds)"
            )
        template = self.fresh_part(cfg).state_dict()
        start = checked_arrays(_arrays(msg), template, f"the server's global {self._what}")
        sent = self.local_update(
            start,
            data,
            cfg,
            server_round,
            client_generator(cfg, node, data.client_id),
            device,
        )
        return RecordDict(
            {
                ARRAYS: ArrayRecord(sent),
                METRICS: MetricRecord({SENT_IMAGES: len(data)}),
            }
        )

    def local_update(
        self,
        start: Mapping[str, torch.Tensor],
        data: dataset.ClientSet,
        cfg: FedBiPConfig,
        server_round: int,
        generator: torch.Generator,
        device: torch.device | str = "cpu",
    ) -> dict[str, torch.Tensor]:
        """What a client sends back in ``server_round``: the federated part, loaded from
        ``start`` (the global weights), trained on its own images for ``local-epochs``.

        The round's shuffles and augmentations are the ``server_round``-th draw of the client's
        ``generator`` (recreated every round from its stream), so each round draws anew."""
        seed = int(torch.randint(_SEED_BOUND, (server_round,), generator=generator)[-1])
        part = self.fresh_part(cfg)
        part.load_state_dict(start)
        if self.head_only:
            features = public_encoder(cfg.ldm.model, cfg.classifier.image_size, device)(data.images)
            recipe = cast(FedPFTSettings, cfg.settings_of("fedpft"))  # FedPFT's head recipe
            fit_head(
                part,
                features,
                data.labels,
                self.settings.local_epochs,
                recipe,
                torch.Generator().manual_seed(seed),
                device,
            )
        else:
            train_classifier(
                part,
                data.images,
                data.labels,
                train_settings(cfg.classifier, self.settings.local_epochs),
                seed=seed,
                device=device,
            )
        return part.cpu().state_dict()

    def client_evaluate(self, msg: Message, cfg: FedBiPConfig, node: NodeConfig) -> RecordDict:
        """Flower's federated evaluation: the global weights scored on the client's held-out images."""
        domain, _ = dataset.institution_identity(cfg.data_description, node)
        if self.head_only:
            self._check_encoder(msg, cfg)
        model = self.classifier(cfg, "random")
        part = self.federated(model)
        part.load_state_dict(
            checked_arrays(_arrays(msg), part.state_dict(), f"the server's global {self._what}")
        )
        scores = score_classifier(
            model,
            dataset.institution_test_set(cfg.data_description, node, domain),
            cfg.classifier.image_size,
        )
        return RecordDict(
            {
                METRICS: MetricRecord(
                    {SENT_ACCURACY: scores[SENT_ACCURACY], SENT_IMAGES: scores[SENT_IMAGES]}
                )
            }
        )

    def run_server(
        self,
        grid: Grid,
        cfg: FedBiPConfig,
        folder: RunFolder,
        evaluate: Callable[[nn.Module], Accuracy],
    ) -> RunResults:
        """Flower's FedAvg over every connected client; the global model saved and scored.

        ``evaluate(model)`` scores on the server's test sets (empty where it holds none);
        institutions score every round's model on their own images where
        ``federation.evaluation`` asks.
        """
        started = time.perf_counter()
        torch.manual_seed(cfg.seed)
        model = self.classifier(cfg, cfg.classifier.init)
        part = self.federated(model)
        template = {name: t.clone() for name, t in part.state_dict().items()}
        on_clients = cfg.federation.scored_at_institutions
        strategy = CheckedFedAvg(
            template,
            cfg.federation.max_images_per_client,
            fraction_train=1.0,
            fraction_evaluate=1.0 if on_clients else 0.0,
            min_train_nodes=cfg.federation.min_clients,
            min_available_nodes=cfg.federation.min_clients,
            min_evaluate_nodes=cfg.federation.min_clients if on_clients else 0,
        )
        config = ConfigRecord(
            {ENCODER: encoder_identity(cfg.ldm.model)[0]} if self.head_only else {}
        )
        result = strategy.start(
            grid,
            ArrayRecord(part.state_dict()),
            num_rounds=self.settings.rounds,
            timeout=cfg.federation.reply_timeout_s,
            train_config=config,
            evaluate_config=ConfigRecord(dict(config)),
        )
        if len(result.arrays) == 0:
            raise RuntimeError("FedAvg produced no global model: every client failed (see the log)")
        part.load_state_dict(
            checked_arrays(result.arrays, template, f"FedAvg's global {self._what}")
        )
        save_classifier(model, folder.classifier, {"class_names": ",".join(cfg.data.class_list)})
        record = RunResults(
            status="completed",
            config=cfg.to_flat(),
            accuracy=evaluate(model),
            evaluation=_last_evaluation(cfg, result) if on_clients else None,
            seconds=Seconds(rounds=time.perf_counter() - started),
        )
        results.write(record, folder.root)
        return record

    @property
    def _what(self) -> str:
        return "head" if self.head_only else "model"

    def _check_encoder(self, msg: Message, cfg: FedBiPConfig) -> None:
        """The head is only meaningful on the backbone it was trained on: the server's."""
        refuse_mismatch(
            [
                (
                    "the server's encoder",
                    _config(msg).get(ENCODER),
                    encoder_identity(cfg.ldm.model)[0],
                    "fedavg.part = head trains on the features of the backbone shipped with the base "
                    "model: this client's base model must ship the server's",
                )
            ]
        )


class CheckedFedAvg(FlowerFedAvg):
    """Flower's FedAvg, each training reply checked (:func:`check_reply`) before it is averaged:
    one that fails is dropped and logged, so a malformed client can neither break the round
    (Flower refuses a whole round of replies whose records differ) nor skew the average."""

    def __init__(self, template: Mapping[str, torch.Tensor], max_images: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.template, self.max_images = template, max_images

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        kept = []
        for msg in replies:
            if not msg.has_error():  # Flower logs the errors itself
                try:
                    check_reply(msg.content, self.template, self.max_images)
                except PayloadError as err:
                    log.warning(
                        "round %d: node %d's reply left out of the average: %s",
                        server_round,
                        msg.metadata.src_node_id,
                        err.reason,
                    )
                    continue
            kept.append(msg)
        return super().aggregate_train(server_round, kept)


def check_reply(content: RecordDict, template: Mapping[str, torch.Tensor], max_images: int) -> None:
    """A training reply as :meth:`FedAvg.client_round` sends it: exactly the ``arrays`` record
    (:func:`checked_arrays` against ``template``) and the ``metrics`` record holding only its
    image count, an int in [1, ``max_images``] (the average's weight); else
    :class:`~fedbip_flwr.upload.PayloadError`."""
    if sorted(content.keys()) != sorted((ARRAYS, METRICS)):
        raise PayloadError(
            f"the reply holds records {_names(content.keys())}, not {ARRAYS!r} and {METRICS!r}"
        )
    if not isinstance(content[ARRAYS], ArrayRecord) or not isinstance(
        content[METRICS], MetricRecord
    ):
        raise PayloadError(f"{ARRAYS!r} must be an ArrayRecord and {METRICS!r} a MetricRecord")
    checked_arrays(content[ARRAYS], template, "the reply's weights")
    metrics = content[METRICS]
    if list(metrics.keys()) != [SENT_IMAGES]:
        raise PayloadError(
            f"the reply's metrics are {_names(metrics.keys())}, not [{SENT_IMAGES!r}]"
        )
    count = metrics[SENT_IMAGES]
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= max_images:
        raise PayloadError(
            f"the reply claims {count!r} images, not an integer in 1..{max_images} (run config "
            "federation.max-images-per-client): the claim weighs its weights in the average"
        )


def checked_arrays(
    record: object, template: Mapping[str, torch.Tensor], what: str
) -> dict[str, torch.Tensor]:
    """``record``'s arrays as tensors, if exactly ``template``'s names and shapes, each floating
    one of the template's dtype and finite; or :class:`~fedbip_flwr.upload.PayloadError` saying
    which is not. An integer array (BatchNorm's batch count) may also arrive as float64, which is
    what Flower's FedAvg makes of it in the weighted average."""
    if not isinstance(record, ArrayRecord):
        raise PayloadError(f"{what}: no ArrayRecord, a {type(record).__name__}")
    names = set(record.keys())
    if names != set(template):
        missing, extra = sorted(set(template) - names), sorted(names - set(template))
        raise PayloadError(
            f"{what} lack {_names(missing)} and hold {_names(extra)} that the model has not"
        )
    out = {}
    for name, want in template.items():
        try:
            got = torch.from_numpy(record[name].numpy())
        except (TypeError, ValueError) as err:
            raise PayloadError(f"{what}: {name!r} is no readable array ({err})") from None
        label = f"{what}: {name!r}"
        if want.is_floating_point() or got.dtype != torch.float64:
            check_dtype_shape(label, got, want.dtype, tuple(want.shape))
        else:
            check_dtype_shape(
                label, got, torch.float64, tuple(want.shape), "Flower's average of an integer array"
            )
        out[name] = check_finite(label, got) if got.is_floating_point() else got
    return out


def _arrays(msg: Message) -> object:
    return msg.content.get(ARRAYS)


def _config(msg: Message) -> ConfigRecord | dict:
    config = msg.content.get(CONFIG)
    return config if isinstance(config, ConfigRecord) else {}


def _names(names: Iterable[str]) -> str:
    names = [str(n) for n in names]
    shown = ", ".join(repr(n) for n in names[:_SHOWN_NAMES])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > _SHOWN_NAMES else ''}]"


def _last_evaluation(cfg: FedBiPConfig, result: Result) -> Evaluation | None:
    """The institutions' mean accuracy of the last round they scored, if any; Flower's FedAvg
    aggregates their scores, so none is kept per institution."""
    if not result.evaluate_metrics_clientapp:
        return None
    last = max(result.evaluate_metrics_clientapp)
    mean = float(result.evaluate_metrics_clientapp[last][SENT_ACCURACY])  # as client_evaluate sent
    return Evaluation(
        where=cfg.federation.evaluation, per_client={}, weighted_mean=mean, round=last
    )

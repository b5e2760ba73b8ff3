"""The one-shot FedBiP strategy: one ``train`` message per client, one reply each, never more.

Each reply is size-checked before it is decoded, decoded and validated as untrusted
input, and persisted atomically on arrival. A failed, missing or invalid reply is recorded with
its reason; nothing a client sends can crash the server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedbip_flwr.payload import Expectations, Payload, PayloadError
from fedbip_flwr.server import RunFolder, accept_payload
from fedbip_flwr.wire import payload_bytes, reply_metrics

log = logging.getLogger("fedbip_flwr.strategy")


class NotEnoughClients(RuntimeError):
    """Fewer valid payloads (or connected clients) than the configured minimum."""


@dataclass
class ClientOutcome:
    """What happened to one client's upload; written to metrics.json."""

    node_id: int
    status: str  # accepted | rejected | failed | missing
    reason: str = ""
    client_id: str = ""
    domain: str = ""
    payload_bytes: int = 0
    metrics: dict | None = None


def wait_for_nodes(grid: Grid, minimum: int, timeout_s: float, poll_s: float = 1.0) -> list[int]:
    """All connected nodes once at least ``minimum`` are there; bounded by ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= minimum:
            return nodes
        if time.monotonic() >= deadline:
            raise NotEnoughClients(
                f"only {len(nodes)} client(s) connected within {timeout_s:.0f} s; "
                f"min-clients is {minimum}"
            )
        time.sleep(poll_s)


class FedBiPStrategy(Strategy):
    """Exactly one round: send ``train`` once to every node, collect and persist payloads."""

    def __init__(
        self,
        expect: Expectations,
        folder: RunFolder,
        *,
        min_clients: int,
        wait_for_clients_s: float,
        already_accepted: Iterable[str] = (),
    ) -> None:
        self.expect = expect
        self.folder = folder
        self.min_clients = min_clients
        self.wait_for_clients_s = wait_for_clients_s
        self.sent_to: list[int] = []
        self.outcomes: list[ClientOutcome] = []
        self.accepted: dict[str, Payload] = {}
        self._taken = set(already_accepted)

    # --- Strategy API ---------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.sent_to:
            raise RuntimeError("FedBiP is one-shot: the train message was already sent")
        nodes = wait_for_nodes(grid, self.min_clients, self.wait_for_clients_s)
        self.sent_to = list(nodes)
        log.info("sending the one train message to %d clients", len(nodes))
        content = RecordDict({"config": config})
        return [
            Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN)
            for node in nodes
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replied = set()
        for reply in replies:
            replied.add(reply.metadata.src_node_id)
            self.outcomes.append(self._take(reply))
        for node in self.sent_to:
            if node not in replied:
                self.outcomes.append(ClientOutcome(node, "missing", "no reply before the timeout"))
                log.warning("client on node %d: no reply before the timeout", node)
        counts = {s: sum(o.status == s for o in self.outcomes) for s in ("accepted", "rejected", "failed", "missing")}
        return None, MetricRecord(counts)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []  # evaluation happens on the server; clients are never contacted twice

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        log.info(
            "FedBiPStrategy: one round, min-clients %d, payload cap %.0f MB",
            self.min_clients,
            self.expect.max_bytes / 2**20,
        )

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int = 1,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: None = None,
    ) -> Result:
        """The single round. Other round counts are refused: an upload happens once."""
        if num_rounds != 1:
            raise ValueError(f"FedBiP runs exactly one round, not {num_rounds}")
        self.summary()
        messages = self.configure_train(1, initial_arrays or ArrayRecord(), train_config or ConfigRecord(), grid)
        replies = grid.send_and_receive(messages, timeout=timeout)
        _, metrics = self.aggregate_train(1, replies)
        result = Result()
        result.train_metrics_clientapp[1] = metrics
        return result

    # --- one reply ------------------------------------------------------------------------

    def _take(self, reply: Message) -> ClientOutcome:
        node = reply.metadata.src_node_id
        if reply.has_error():
            log.warning("client on node %d failed: %s", node, reply.error.reason)
            return ClientOutcome(node, "failed", f"client error {reply.error.code}: {reply.error.reason}")
        outcome = ClientOutcome(node, "rejected")
        try:
            outcome.metrics = reply_metrics(reply)
            blob = payload_bytes(reply, self.expect.max_bytes)  # size-capped before decoding
            outcome.payload_bytes = len(blob)
            payload = accept_payload(blob, self.expect, self.folder, self._taken)
        except PayloadError as err:
            outcome.reason = str(err)
        except Exception as err:  # a bug of ours, not the client's: record it, keep the round
            log.exception("unexpected error while decoding the reply of node %d", node)
            outcome.reason = f"unexpected {type(err).__name__}: {err}"
        else:
            outcome.status = "accepted"
            outcome.client_id, outcome.domain = payload.meta.client_id, payload.meta.domain
            self.accepted[payload.meta.client_id] = payload
            log.info("accepted %s (%s, %d images, %.2f MB)", outcome.client_id, outcome.domain,
                     payload.meta.num_examples, outcome.payload_bytes / 1e6)
            return outcome
        log.warning("rejected the reply of node %d: %s", node, outcome.reason)
        return outcome


def outcomes_json(outcomes: Iterable[ClientOutcome]) -> list[dict]:
    return [asdict(o) for o in outcomes]

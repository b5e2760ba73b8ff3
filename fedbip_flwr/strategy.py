"""The one-shot strategy (FedBiP and every one-shot peer): one ``train`` message per client, one
reply each, never more.

Replies are pulled as they arrive and each is size-checked, decoded and validated as untrusted
input by the run's method (:meth:`fedbip_flwr.methods.Method.accept`) and, if accepted,
persisted atomically at once, with the node it came from: a ServerApp
that dies mid-round loses no upload, and its restart sends ``train`` only to the nodes whose
upload is not on disk (nodes that reconnect under a new id are told which client ids are held,
and answer without personalizing). Institutions that connect while the round is open are sent
``train`` too. Messages live as long as the round (``federation.reply-timeout-s``), not Flower's
12-hour default. A failed, missing or invalid reply is recorded with its reason, and so is an
institution's refusal of the run's request under its own upload policy
(:mod:`fedbip_flwr.policy`); nothing a client sends can crash the server.

After training, :meth:`OneShotStrategy.evaluate_at_institutions` sends the classifier back to
every node that uploaded, in one ``evaluate`` message each, and records the metrics they reply.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import get_args

from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from pydantic import ValidationError

from .methods import Upload
from .policy import REFUSAL_PREFIX
from .results import SCORE_KEYS, ClientOutcome, Scored, Unscored, UploadStatus
from .server import RunFolder
from .storage import atomic_write, write_json
from .upload import CLIENT_ID_PATTERN, PayloadError, printable
from .wire import (
    CLIENT_ID,
    REFUSED,
    blob_record,
    carries_payload,
    evaluate_content,
    message_config,
    payload_bytes,
    reply_metrics,
    train_content,
)

log = logging.getLogger("fedbip_flwr.strategy")
KEPT = "its upload from before the restart is on disk; not asked again"
NO_REPLY = "no reply before the timeout"


class NotEnoughClients(RuntimeError):
    """Fewer valid payloads (or connected clients) than the configured minimum."""


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
                f"federation.min-clients is {minimum}"
            )
        time.sleep(poll_s)


class OneShotStrategy(Strategy):
    """Exactly one round: ``train`` once to every node, each upload persisted as it arrives.

    ``accept`` is the method's validation of one upload's bytes (it raises PayloadError with
    the reason); ``max_bytes`` caps a reply before anything parses it; ``owners`` (run config
    federation.client-nodes) binds client ids to the nodes registered for them.
    """

    def __init__(
        self,
        accept: Callable[[bytes], Upload],
        max_bytes: int,
        folder: RunFolder,
        *,
        min_clients: int,
        wait_for_clients_s: float,
        already_accepted: Iterable[str] = (),
        uploaded_by_node: Mapping[int, str] | None = None,
        owners: Mapping[str, int] | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.accept = accept
        self.max_bytes = max_bytes
        self.folder = folder
        self.min_clients = min_clients
        self.wait_for_clients_s = wait_for_clients_s
        self.poll_s = poll_s
        self.sent_to: list[int] = []
        self._replied: set[int] = set()
        self.accepted: dict[str, Upload] = {}
        self._taken = set(already_accepted)
        self.uploaded_by_node: dict[int, str] = dict(uploaded_by_node or {})
        self.owners: dict[str, int] = dict(owners or {})
        self.outcomes = [
            ClientOutcome(node_id=node, status="kept", reason=KEPT, client_id=client)
            for node, client in sorted(self.uploaded_by_node.items())
        ]
        self._ttl = 3600.0

    # --- Strategy API ---------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """``train`` for every connected node not yet asked whose upload is not on disk."""
        nodes = [
            n
            for n in sorted(grid.get_node_ids())
            if n not in self.sent_to and n not in self.uploaded_by_node
        ]
        self.sent_to += nodes
        content = train_content(sorted(self._taken))
        return [
            Message(
                content=content, dst_node_id=node, message_type=MessageType.TRAIN, ttl=self._ttl
            )
            for node in nodes
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Take every reply: each accepted payload is on disk before the next is looked at."""
        for reply in replies:
            self._replied.add(reply.metadata.src_node_id)
            self.outcomes.append(self._take(reply))
        counts = {s: sum(o.status == s for o in self.outcomes) for s in get_args(UploadStatus)}
        return None, MetricRecord(counts)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The classifier (one raw safetensors array) for every connected node that uploaded."""
        if not self.uploaded_by_node:
            return []
        connected = set(grid.get_node_ids())
        return [
            Message(
                content=evaluate_content(arrays, config),
                dst_node_id=node,
                message_type=MessageType.EVALUATE,
                ttl=self._ttl,
            )
            for node in sorted(self.uploaded_by_node)
            if node in connected
        ]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None  # see evaluate_at_institutions: metrics are kept per institution

    def summary(self) -> None:
        log.info(
            "OneShotStrategy: one round, federation.min-clients %d, payload cap %.0f MB",
            self.min_clients,
            self.max_bytes / 2**20,
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
        """The single round, open for ``timeout`` seconds. Other round counts are refused."""
        if num_rounds != 1:
            raise ValueError(f"FedBiP runs exactly one round, not {num_rounds}")
        if self.sent_to:
            raise RuntimeError("FedBiP is one-shot: the train message was already sent")
        self.summary()
        self._ttl = timeout
        deadline = time.monotonic() + timeout
        wait_for_nodes(grid, self.min_clients, self.wait_for_clients_s, self.poll_s)
        pending: set[str] = set()  # ids of train messages not answered yet
        metrics = MetricRecord()
        while True:
            self._send(grid, pending, train_config or ConfigRecord())
            if not pending or time.monotonic() >= deadline:
                break
            replies = list(grid.pull_messages(sorted(pending)))
            for reply in replies:
                pending.discard(reply.metadata.reply_to_message_id)
            _, metrics = self.aggregate_train(1, replies)
            if pending:
                time.sleep(self.poll_s)
        self.finish_round()
        result = Result()
        result.train_metrics_clientapp[1] = metrics
        return result

    def finish_round(self) -> None:
        """Every node that was sent ``train`` and has not replied is recorded as missing."""
        for node in self.sent_to:
            if node not in self._replied:
                self.outcomes.append(ClientOutcome(node_id=node, status="missing", reason=NO_REPLY))
                log.warning("client on node %d: %s", node, NO_REPLY)

    def _send(self, grid: Grid, pending: set[str], config: ConfigRecord) -> None:
        messages = list(self.configure_train(1, ArrayRecord(), config, grid))
        if not messages:
            return
        pending.update(grid.push_messages(messages))
        log.info(
            "sent the one train message to %d client(s) (%d in all)",
            len(messages),
            len(self.sent_to),
        )

    # --- one reply ------------------------------------------------------------------------

    def _take(self, reply: Message) -> ClientOutcome:
        node = reply.metadata.src_node_id
        if reply.has_error():
            log.warning("client on node %d failed: %s", node, reply.error.reason)
            reason = f"client error {reply.error.code}: {reply.error.reason}"
            return ClientOutcome(node_id=node, status="failed", reason=reason)
        if REFUSED in (config := message_config(reply)):
            return _refused(node, config)
        outcome = ClientOutcome(node_id=node, status="rejected")
        try:
            outcome.metrics = reply_metrics(reply)
            claimed = message_config(reply).get(CLIENT_ID)
            if not carries_payload(reply) and claimed in self._taken:
                return self._kept(outcome, str(claimed))
            blob = payload_bytes(reply, self.max_bytes)  # size-capped before decoding
            outcome.payload_bytes = len(blob)
            upload = self._persist(node, self.accept(blob), blob)
        except PayloadError as err:
            outcome.reason = str(err)
        except Exception as err:  # a bug of ours, not the client's: record it, keep the round
            log.exception("unexpected error while decoding the reply of node %d", node)
            outcome.reason = f"unexpected {type(err).__name__}: {err}"
        else:
            outcome.status = "accepted"
            outcome.client_id, outcome.domain = upload.client_id, upload.domain
            self.accepted[upload.client_id] = upload
            log.info(
                "accepted %s (%s, %d images, %.2f MB)",
                outcome.client_id,
                outcome.domain,
                upload.meta.num_examples,
                outcome.payload_bytes / 1e6,
            )
            return outcome
        log.warning("rejected the reply of node %d: %s", node, outcome.reason)
        return outcome

    def _persist(self, node: int, upload: Upload, blob: bytes) -> Upload:
        """A valid upload durably on disk under its client id (a safe file name by its
        metadata's pattern), once per client id. Its node is recorded first, so a payload on
        disk always has its uploader on disk too, whenever the ServerApp dies (a restart
        ignores a recorded node whose payload never landed)."""
        self._check_owner(node, upload.client_id)
        if upload.client_id in self._taken:
            raise PayloadError(f"an upload from '{upload.client_id}' was already accepted")
        self._remember(node, upload.client_id)
        atomic_write(self.folder.payload_path(upload.client_id), blob)
        self._taken.add(upload.client_id)
        return upload

    def _kept(self, outcome: ClientOutcome, client_id: str) -> ClientOutcome:
        """A reply that says its upload is on disk: only the node that uploaded it can say so
        (a client id is bound to the node that first uploaded it; with SuperNode
        authentication, node ids are bound to the institutions' registered keys). Anyone else
        claiming it is refused, so it neither gets the classifier nor scores it for them."""
        self._check_owner(outcome.node_id, client_id)
        owner = next((n for n, c in self.uploaded_by_node.items() if c == client_id), None)
        if owner is not None and owner != outcome.node_id:
            raise PayloadError(
                f"'{client_id}' uploaded from node {owner}; node {outcome.node_id} cannot claim "
                "its upload (a client id belongs to the node that first uploaded it)"
            )
        outcome.status, outcome.client_id, outcome.reason = "kept", client_id, KEPT
        self._remember(outcome.node_id, client_id)
        log.info("%s: upload already on disk, not asked to personalize again", client_id)
        return outcome

    def _check_owner(self, node: int, client_id: str) -> None:
        """With run config federation.client-nodes, only the node registered for a client id may
        upload under it or claim its upload: a squatter is refused before it can take the id, so
        the institution that owns it is never locked out."""
        if not self.owners:
            return
        owner = self.owners.get(client_id)
        if owner is None:
            raise PayloadError(
                f"'{client_id}' is not in run config federation.client-nodes: no node may upload "
                "under it"
            )
        if owner != node:
            raise PayloadError(
                f"'{client_id}' belongs to node {owner} (run config federation.client-nodes); "
                f"node {node} cannot upload under it or claim its upload"
            )

    def _remember(self, node: int, client_id: str) -> None:
        """Which node uploaded what, on disk at once: a restart skips those nodes."""
        self.uploaded_by_node[node] = client_id
        write_json(self.folder.uploaders, {str(n): c for n, c in self.uploaded_by_node.items()})

    # --- the classifier back at the institutions -------------------------------------------

    def evaluate_at_institutions(
        self, grid: Grid, classifier: bytes, config: dict, timeout: float, bounds: ScoreBounds
    ) -> dict[str, Scored | Unscored]:
        """Send the classifier to every node that uploaded; their scores, by client id, each
        consistent and within ``bounds`` or recorded as refused (never averaged)."""
        messages = list(
            self.configure_evaluate(1, blob_record(classifier), ConfigRecord(config), grid)
        )
        by_node = dict(self.uploaded_by_node)
        asked = {m.metadata.dst_node_id for m in messages}
        results: dict[str, Scored | Unscored] = {
            client: Unscored(
                reason=NO_REPLY
                if node in asked
                else "not connected under the node id it uploaded from"
            )
            for node, client in by_node.items()
        }
        if not messages:
            log.warning("no institution that uploaded is connected: nothing scored at the clients")
            return results
        log.info("sending the classifier to %d institution(s) to score", len(messages))
        for reply in grid.send_and_receive(messages, timeout=timeout):
            client = by_node.get(reply.metadata.src_node_id, "")
            results[client] = score = _scores(reply, bounds)
            if isinstance(score, Unscored):
                log.warning("%s could not score the classifier: %s", client, score.reason)
        return results


def _refused(node: int, config: dict) -> ClientOutcome:
    """A reply saying the institution's own upload policy refuses what the run asks: recorded
    with its reason (and the client id it names, where that is one), never a failure of ours."""
    reason = f"{REFUSAL_PREFIX}{printable(config[REFUSED])}"
    claimed = str(config.get(CLIENT_ID, ""))
    client_id = claimed if re.fullmatch(CLIENT_ID_PATTERN, claimed) else ""
    log.warning("client %s on node %d: %s", client_id or "?", node, reason)
    return ClientOutcome(node_id=node, status="refused", reason=reason, client_id=client_id)


@dataclass(frozen=True)
class ScoreBounds:
    """What an institution's scores can be: one count per server class, and no more held-out
    images than run config federation.max-images-per-client lets an institution hold; under a DP
    upload (``private``) the accuracy alone, which elsewhere is refused (it would change the
    mean's weights)."""

    classes: int
    max_examples: int
    private: bool = False


def _scores(reply: Message, bounds: ScoreBounds) -> Scored | Unscored:
    """An institution's evaluate reply as the run record keeps it; a reply whose metrics are
    missing, malformed, inconsistent or out of ``bounds`` is recorded as failed, with why:
    nothing a client sends crashes the server or moves the mean."""
    if reply.has_error():
        return Unscored(reason=reply.error.reason)
    metrics = reply_metrics(reply)
    try:
        sent = {field: metrics[key] for field, key in SCORE_KEYS.items() if key in metrics}
        score = Scored.model_validate(sent)
    except ValidationError as err:
        problems = "; ".join(
            f"{SCORE_KEYS[str(e['loc'][0])]}: {e['msg']}"
            if e["loc"]
            else e["msg"].removeprefix("Value error, ")
            for e in err.errors()
        )
        return Unscored(reason=f"its scores are malformed ({problems})")
    if not score.counted:
        return (
            score
            if bounds.private
            else Unscored(reason="its scores carry no counts (only a DP run's may)")
        )
    if len(score.per_class_total or ()) != bounds.classes:
        return Unscored(
            reason=f"its scores count {len(score.per_class_total or ())} classes, not the server's {bounds.classes}"
        )
    if (score.num_examples or 0) > bounds.max_examples:
        return Unscored(
            reason=f"its scores claim {score.num_examples} held-out images, more than "
            f"federation.max-images-per-client {bounds.max_examples}"
        )
    return score

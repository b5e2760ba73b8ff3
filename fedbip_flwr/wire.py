"""How FedBiP's files travel in Flower messages: one raw byte Array inside an ArrayRecord.

The only module of the library that imports Flower; the apps use it on both sides so the
record names live in one place. Two files ever travel: the client's payload (its one upload)
and the trained classifier the server sends back for evaluation at the institutions. Flower
chunks Arrays on the wire (5 MiB, content-addressed), so large files stream; ConfigRecord bytes
would not be chunked.
"""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from .upload import PayloadError, check_size

PAYLOAD_RECORD = "fedbip.payload"
CLASSIFIER_RECORD = "fedbip.classifier"
_WHAT = {PAYLOAD_RECORD: "FedBiP payload", CLASSIFIER_RECORD: "FedBiP classifier"}
BLOB_ARRAY = "safetensors"
METRICS_RECORD = "fedbip.metrics"
CONFIG_RECORD = "fedbip.config"
BLOB_STYPE = "raw/safetensors"
UPLOADED = "uploaded"  # train config: client ids whose upload the server already holds
CLIENT_ID = "client-id"  # reply config: who answered
REFUSED = "refused"  # reply config: why the institution's upload policy refuses the run's upload
RUN_FOLDER = "run-folder"  # evaluate config: the run's folder name, kept by the institutions too


def blob_record(blob: bytes) -> ArrayRecord:
    """A file's bytes as one raw uint8 Array: Flower streams it in chunks."""
    array = Array(dtype="uint8", shape=(len(blob),), stype=BLOB_STYPE, data=blob)
    return ArrayRecord({BLOB_ARRAY: array})


def payload_content(blob: bytes, metrics: dict, client_id: str) -> RecordDict:
    """A client's reply to ``train``: its payload, its metrics and its id."""
    return RecordDict(
        {
            PAYLOAD_RECORD: blob_record(blob),
            METRICS_RECORD: MetricRecord(metrics),
            CONFIG_RECORD: ConfigRecord({CLIENT_ID: client_id}),
        }
    )


def skipped_content(client_id: str) -> RecordDict:
    """A client's reply to ``train`` when the server already holds its upload: no payload."""
    return RecordDict({CONFIG_RECORD: ConfigRecord({CLIENT_ID: client_id})})


def refused_content(client_id: str, reason: str) -> RecordDict:
    """A client's reply to ``train`` when its own upload policy refuses what the run asks."""
    return RecordDict({CONFIG_RECORD: ConfigRecord({CLIENT_ID: client_id, REFUSED: reason})})


def train_content(uploaded: list[str]) -> RecordDict:
    """The one ``train`` message: which client ids need not upload (their payload is on disk)."""
    return RecordDict({CONFIG_RECORD: ConfigRecord({UPLOADED: list(uploaded)})})


def evaluate_content(classifier: ArrayRecord, config: ConfigRecord) -> RecordDict:
    """The ``evaluate`` message: the trained classifier (:func:`blob_record`) and its settings."""
    return RecordDict({CLASSIFIER_RECORD: classifier, CONFIG_RECORD: config})


def payload_bytes(reply: Message, max_bytes: int) -> bytes:
    """The reply's payload, refused on size before anything parses or stores it."""
    return _blob(reply, PAYLOAD_RECORD, max_bytes)


def classifier_bytes(msg: Message, max_bytes: int) -> bytes:
    """The classifier the server sent, refused on size like a payload."""
    return _blob(msg, CLASSIFIER_RECORD, max_bytes)


def reply_metrics(reply: Message) -> dict[str, int | float | list]:
    record = reply.content.metric_records.get(METRICS_RECORD)
    return dict(record) if record is not None else {}


def message_config(msg: Message) -> dict:
    record = msg.content.config_records.get(CONFIG_RECORD)
    return dict(record) if record is not None else {}


def carries_payload(reply: Message) -> bool:
    return PAYLOAD_RECORD in reply.content.array_records


def _blob(msg: Message, record_name: str, max_bytes: int) -> bytes:
    """The bytes of a blob record, checked before anything parses them.

    The sender controls both the Array's declared shape and its data, so both are held to the
    cap and to each other; only then are the bytes handed to a decoder.
    """
    record = msg.content.array_records.get(record_name)
    if record is None or BLOB_ARRAY not in record:
        raise PayloadError(f"the message carries no {_WHAT[record_name]}")
    array = record[BLOB_ARRAY]
    if array.stype != BLOB_STYPE:
        raise PayloadError(
            f"{record_name} array has stype '{array.stype}', expected '{BLOB_STYPE}'"
        )
    if array.dtype != "uint8" or len(array.shape) != 1:
        raise PayloadError(
            f"{record_name} array must be 1-D uint8, got {array.dtype} {array.shape}"
        )
    declared, carried = int(array.shape[0]), len(array.data)
    check_size(max(declared, carried), max_bytes)
    if declared != carried:
        raise PayloadError(f"{record_name} array declares {declared} bytes but carries {carried}")
    return bytes(array.data)

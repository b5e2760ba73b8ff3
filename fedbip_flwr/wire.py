"""How a payload travels in a Flower message: one raw byte Array inside an ArrayRecord.

The only module of the library that imports Flower; the apps use it on both sides so the
record names live in one place. Flower chunks Arrays on the wire (5 MiB, content-addressed), so
large uploads stream; ConfigRecord bytes would not be chunked.
"""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from .payload import PayloadError, check_size

PAYLOAD_RECORD = "fedbip.payload"
PAYLOAD_ARRAY = "safetensors"
METRICS_RECORD = "fedbip.metrics"
PAYLOAD_STYPE = "raw/safetensors"


def payload_content(blob: bytes, metrics: dict[str, int | float]) -> RecordDict:
    array = Array(dtype="uint8", shape=(len(blob),), stype=PAYLOAD_STYPE, data=blob)
    return RecordDict(
        {
            PAYLOAD_RECORD: ArrayRecord({PAYLOAD_ARRAY: array}),
            METRICS_RECORD: MetricRecord(metrics),
        }
    )


def payload_bytes(reply: Message, max_bytes: int) -> bytes:
    """The reply's payload, refused on size before anything parses or stores it.

    The sender controls both the Array's declared shape and its data, so both are held to the
    cap and to each other; only then are the bytes handed to the decoder.
    """
    array = _payload_array(reply)
    if array.dtype != "uint8" or len(array.shape) != 1:
        raise PayloadError(f"payload array must be 1-D uint8, got {array.dtype} {array.shape}")
    declared, carried = int(array.shape[0]), len(array.data)
    check_size(max(declared, carried), max_bytes)
    if declared != carried:
        raise PayloadError(f"payload array declares {declared} bytes but carries {carried}")
    return bytes(array.data)


def reply_metrics(reply: Message) -> dict[str, int | float]:
    record = reply.content.metric_records.get(METRICS_RECORD)
    return dict(record) if record is not None else {}


def _payload_array(reply: Message) -> Array:
    record = reply.content.array_records.get(PAYLOAD_RECORD)
    if record is None or PAYLOAD_ARRAY not in record:
        raise PayloadError("the reply carries no FedBiP payload")
    array = record[PAYLOAD_ARRAY]
    if array.stype != PAYLOAD_STYPE:
        raise PayloadError(f"payload array has stype '{array.stype}', expected '{PAYLOAD_STYPE}'")
    return array

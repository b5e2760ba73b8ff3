"""metrics.json as one typed record: what is written reads back equal, every key of it
snake_case, and a file that is not a run's results is refused with its name and the key."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from fedbip_flwr import results
from fedbip_flwr.results import (
    Accuracy,
    ClientOutcome,
    Evaluation,
    ResultsError,
    RunResults,
    Scored,
    Seconds,
    Unscored,
)
from tests.helpers import completed_metrics

DATA = {"config", "metrics"}  # kept under the names they arrived with
NAMED = {"per_domain", "per_client", "per_model"}  # keyed by domain, client or model


def record_keys(value: object, keyed_by_name: bool = False) -> set[str]:
    """Every key the record itself names, not those of its data or its per-name maps."""
    if isinstance(value, list):
        return set().union(*map(record_keys, value))
    if not isinstance(value, dict):
        return set()
    keys = set() if keyed_by_name else set(value)
    for key, item in value.items():
        if keyed_by_name or key not in DATA:
            keys |= record_keys(item, not keyed_by_name and key in NAMED)
    return keys


def test_a_completed_run_reads_back_equal_and_writes_the_same_file(tmp_path: Path) -> None:
    record = RunResults.model_validate(completed_metrics())
    path = results.write(record, tmp_path)
    assert path == tmp_path / results.FILE_NAME
    assert results.read(tmp_path) == record
    assert json.loads(path.read_text()) == completed_metrics()  # nothing added, nothing null


def test_every_key_of_the_record_is_snake_case(tmp_path: Path) -> None:
    keys = record_keys(completed_metrics())
    assert {"started_unix", "load_model", "num_synthetic_images", "weighted_mean"} <= keys
    assert [k for k in keys if not re.fullmatch(r"[a-z]+(_[a-z]+)*", k)] == []


def test_a_failed_run_keeps_only_what_it_reached(tmp_path: Path) -> None:
    clients = [ClientOutcome(node_id=3, status="missing", reason="no reply before the timeout")]
    record = RunResults(
        status="failed",
        reason="only 0 valid payload(s); federation.min-clients is 1",
        config={"federation.min-clients": 1, "seed": 0},
        started_unix=1.5,
        clients=clients,
    )
    written = json.loads(results.write(record, tmp_path / "elsewhere.json").read_text())
    assert set(written) == {"status", "reason", "config", "started_unix", "clients"}
    assert results.read(tmp_path / "elsewhere.json") == record


def test_phases_come_in_the_order_they_run() -> None:
    seconds = Seconds(evaluation=4.0, classifier=3.0, synthesis=2.0, round=1.0, load_model=0.5)
    assert list(seconds.phases()) == [
        "load_model",
        "round",
        "synthesis",
        "classifier",
        "evaluation",
    ]


def test_an_inflated_evaluation_reply_weighs_as_one_institution(tmp_path: Path) -> None:
    """Issue 91: 100,000 of 100,000 correct is self-consistent and within
    federation.max-images-per-client, so it passes every check a reply is held to; weighted by its claimed test images it would
    outweigh every honest institution (the mean 0.9997). Each institution weighs one; one that
    did not score counts not at all."""
    honest = Scored(
        accuracy=0.5, num_examples=24, per_class_correct=[6, 6], per_class_total=[12, 12]
    )
    inflated = Scored(
        accuracy=1.0,
        num_examples=100_000,
        per_class_correct=[50_000, 50_000],
        per_class_total=[50_000, 50_000],
    )
    per_client = {
        "a": honest,
        "b": honest,
        "liar": inflated,
        "c": Unscored(reason="not connected under the node id it uploaded from"),
    }
    assert Evaluation.of("both", per_client).weighted_mean == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    nobody = Evaluation.of("clients", {"c": per_client["c"]})
    record = RunResults(status="completed", config={}, accuracy=Accuracy(), evaluation=nobody)
    assert math.isnan(results.read(results.write(record, tmp_path)).evaluation.weighted_mean)


def test_clients_json_holds_what_metrics_json_holds(tmp_path: Path) -> None:
    record = RunResults.model_validate(completed_metrics())
    path = results.write_clients(record.clients, tmp_path / "clients.json")
    assert results.read_clients(path) == record.clients
    assert json.loads(path.read_text()) == completed_metrics()["clients"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda m: m["seconds"].update({"load-model": 2.5}), "seconds.load-model"),
        (lambda m: m.update({"started-unix": 1.0}), "started-unix"),
        (lambda m: m.update(status="running"), "status"),
        (lambda m: m["accuracy"].update(mean="high"), "accuracy.mean"),
        (
            lambda m: m["evaluation"]["per_client"]["sketch-0"].pop("num_examples"),
            "per_client.sketch-0",
        ),
        (lambda m: m.pop("config"), "config"),
    ],
    ids=[
        "old phase spelling",
        "old key spelling",
        "unknown status",
        "wrong type",
        "missing score",
        "no config",
    ],
)
def test_a_malformed_file_is_refused_naming_it_and_the_key(
    tmp_path: Path, change, named: str
) -> None:
    metrics = completed_metrics()
    change(metrics)
    path = tmp_path / results.FILE_NAME
    path.write_text(json.dumps(metrics))
    with pytest.raises(ResultsError) as error:
        results.read(path)
    message = str(error.value)
    assert message.startswith(f"{path} does not hold a run's results: ") and named in message
    assert "\n" not in message

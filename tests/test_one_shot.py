"""One round, one message per client, and a client that raises does not sink the round.

Runs the real `flwr run` on a test app whose ServerApp is the project's own and whose
ClientApp wraps the project's: it records every message it receives and raises on partition 1.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from flwr.app import ArrayRecord, ConfigRecord

from fedbip_flwr.server import RunFolder
from fedbip_flwr.strategy import OneShotStrategy
from tests.helpers import (
    ROOT,
    SMALL,
    as_run_config,
    run_simulation,
    run_status,
    stop_local_superlink,
)

pytestmark = pytest.mark.long(minutes=1.1)

WRAPPER = """
import uuid
from pathlib import Path

from client_app.app import app as real_app, train as real_train
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg, context):
    out = Path(context.run_config["output-dir"])
    partition = int(context.node_config["partition-id"])
    (out / f"received-{partition}-{uuid.uuid4().hex}").touch()
    if partition == 1:
        raise RuntimeError("disk on fire at partition 1")
    return real_train(msg, context)
"""


def make_test_app(folder: Path) -> Path:
    folder.mkdir()
    pyproject = (ROOT / "pyproject.toml").read_text()
    pyproject = re.sub(r'clientapp = ".*"', 'clientapp = "failing_client:app"', pyproject)
    pyproject = pyproject.replace('name = "fedbip-flwr"', 'name = "fedbip-failing-client"')
    pyproject = pyproject.replace('readme = "README.md"\n', "")
    pyproject = re.sub(r"(?ms)^fab-include = \[.*?\]\n", "", pyproject)  # lists this tree's files
    (folder / "pyproject.toml").write_text(pyproject)
    (folder / "failing_client.py").write_text(WRAPPER)
    return folder


def test_failing_client_is_recorded_and_round_completes(tmp_path, tiny_model_dir):
    app = make_test_app(tmp_path / "app")
    out = tmp_path / "out"
    out.mkdir()
    home = tmp_path / "home"
    values = {
        **SMALL,
        "ldm.model": f'"{tiny_model_dir}"',
        "output-dir": f'"{out}"',
        "federation.min-clients": 2,
    }
    try:
        run_id, log = run_simulation(home, as_run_config(values), 3, timeout=900, app=app)
        status = run_status(home, run_id)
    finally:
        stop_local_superlink(home)
    assert status == "finished:completed", log[-4000:]
    received = sorted(p.name.split("-")[1] for p in out.glob("received-*"))
    assert received == ["0", "1", "2"], "each client gets exactly one message"
    metrics = json.loads((out / "e2e" / "metrics.json").read_text())
    by_status = {}
    for client in metrics["clients"]:
        by_status.setdefault(client["status"], []).append(client)
    assert len(by_status["accepted"]) == 2 and len(by_status["failed"]) == 1
    assert "disk on fire at partition 1" in by_status["failed"][0]["reason"]
    assert set(metrics["accuracy"]["per_domain"]) == {"sketch", "painting"}


def test_strategy_refuses_a_second_round(tmp_path):
    strategy = OneShotStrategy(None, 0, RunFolder(tmp_path), min_clients=1, wait_for_clients_s=1)
    with pytest.raises(ValueError, match="exactly one round"):
        strategy.start(grid=None, num_rounds=2)
    strategy.sent_to = [1]
    with pytest.raises(RuntimeError, match="one-shot"):
        strategy.start(grid=None, num_rounds=1)
    # the classifier goes back only to nodes that uploaded: none here
    assert list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), grid=None)) == []


def test_a_restart_trusts_only_uploaders_whose_payload_landed(tmp_path):
    """The strategy records a node just before writing its payload; a ServerApp killed in
    between leaves a node without a payload, which a restart must ask again."""
    from fedbip_flwr.server_run import read_uploaders

    folder = RunFolder(tmp_path)
    folder.payloads.mkdir(parents=True)
    folder.payload_path("sketch-a").write_bytes(b"kept")
    folder.uploaders.write_text(json.dumps({"11": "sketch-a", "12": "painting-b"}))
    assert read_uploaders(folder) == {11: "sketch-a"}

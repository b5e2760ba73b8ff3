"""FedAvg on Flower: the multi-round baseline FedBiP is compared against (paper Table 1).

Same classifier and training recipe as FedBiP's server (ResNet-18, SGD), but trained on the
clients' *real* images over many rounds of weight exchange instead of one upload. Runs the real
Flower simulation runtime in-process; each virtual SuperNode regenerates its own shard of the
built-in dataset from the seed, so no data crosses the process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

from fedbip_flwr import shapes
from fedbip_flwr.classifier import TrainSettings, build_classifier, train_classifier


@dataclass(frozen=True)
class FedAvgSettings:
    domains: tuple[str, ...]
    shots: int
    rounds: int
    local_epochs: int
    train: TrainSettings
    seed: int


def _client_app() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg = msg.content["config"]
        domains = str(cfg["domains"]).split(",")
        domain, index = shapes.partition(int(context.node_config["partition-id"]), domains)
        data = shapes.client_train_set(domain, int(cfg["shots"]), index, seed=int(cfg["seed"]))
        model = build_classifier(len(shapes.CLASSES), "random")
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        settings = TrainSettings(
            epochs=int(cfg["local-epochs"]),
            lr=float(cfg["lr"]),
            momentum=float(cfg["momentum"]),
            batch_size=int(cfg["batch-size"]),
            image_size=int(cfg["image-size"]),
        )
        seed = int(cfg["seed"]) * 1000 + int(cfg["server-round"]) * 10 + index
        train_classifier(model, data.images, data.labels, settings, seed=seed)
        content = RecordDict(
            {
                "arrays": ArrayRecord(model.state_dict()),
                "metrics": MetricRecord({"num-examples": len(data)}),
            }
        )
        return Message(content=content, reply_to=msg)

    return app


def _server_app(settings: FedAvgSettings, out: dict) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        n = len(settings.domains)
        torch.manual_seed(settings.seed)
        model = build_classifier(len(shapes.CLASSES), "random")
        strategy = FedAvg(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=n,
            min_available_nodes=n,
            min_evaluate_nodes=0,
        )
        t = settings.train
        config = ConfigRecord(
            {
                "domains": ",".join(settings.domains),
                "shots": settings.shots,
                "seed": settings.seed,
                "local-epochs": settings.local_epochs,
                "lr": t.lr,
                "momentum": t.momentum,
                "batch-size": t.batch_size,
                "image-size": t.image_size,
            }
        )
        result = strategy.start(
            grid, ArrayRecord(model.state_dict()), num_rounds=settings.rounds, train_config=config
        )
        if len(result.arrays) == 0:
            raise RuntimeError("FedAvg produced no global model: every client failed (see the log)")
        model.load_state_dict(result.arrays.to_torch_state_dict())
        out["model"] = model.eval()

    return app


def train_fedavg(settings: FedAvgSettings) -> torch.nn.Module:
    """Run FedAvg for ``settings.rounds`` rounds, one virtual SuperNode per domain; the global model."""
    out: dict = {}
    run_simulation(
        server_app=_server_app(settings, out),
        client_app=_client_app(),
        num_supernodes=len(settings.domains),
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    if "model" not in out:
        raise RuntimeError("the FedAvg simulation ended without a global model (see its log)")
    return out["model"]

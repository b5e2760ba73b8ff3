"""FedBiP ServerApp: one round of uploads, then synthesis, classifier training and metrics.

Thin over the library. A restart with the same ``run-name`` finds the round's payloads on disk
and resumes without contacting any client again.
"""

from __future__ import annotations

import json
import logging
import time

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedbip_flwr import dataset
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import load_for_run, select_device
from fedbip_flwr.logs import setup_logging
from fedbip_flwr.paths import resolve
from fedbip_flwr.server import (
    RunFolder,
    expectations,
    load_persisted,
    save_grid,
    synthesize_all,
    train_and_evaluate,
)
from fedbip_flwr.storage import remove_partial_writes, write_json
from server_app.strategy import FedBiPStrategy, NotEnoughClients, outcomes_json

log = logging.getLogger("fedbip_flwr.server_app")
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    setup_logging()
    cfg = FedBiPConfig.from_flat(context.run_config)
    folder = RunFolder(resolve(cfg.output_dir) / (cfg.run_name or f"run-{context.run_id}"))
    folder.root.mkdir(parents=True, exist_ok=True)
    log.info("run folder: %s", folder.root)
    for path in remove_partial_writes(folder.root):
        log.warning("removed %s, an unfinished write from an interrupted run", path)
    seconds: dict[str, float] = {}

    dataset.verify(cfg)
    started = time.perf_counter()
    ldm = load_for_run(cfg.model, cfg.device, cfg.half_precision, cfg.image_size)
    class_names = dataset.class_names(cfg)
    expect = expectations(cfg, ldm, class_names)
    seconds["load-model"] = time.perf_counter() - started

    started = time.perf_counter()
    if folder.clients.exists():
        payloads = load_persisted(folder, expect)
        clients = json.loads(folder.clients.read_text())
        log.info("resuming: %d payloads on disk, no client is contacted", len(payloads))
    else:
        earlier = load_persisted(folder, expect)
        strategy = FedBiPStrategy(
            expect,
            folder,
            min_clients=cfg.min_clients,
            wait_for_clients_s=cfg.wait_for_clients_s,
            already_accepted=earlier,
        )
        strategy.start(grid, num_rounds=1, timeout=cfg.reply_timeout_s)
        payloads = {**earlier, **strategy.accepted}
        clients = outcomes_json(strategy.outcomes)
        write_json(folder.clients, clients)
    seconds["round"] = time.perf_counter() - started

    metrics: dict = {"status": "running", "clients": clients, "config": cfg.to_flat()}
    if len(payloads) < cfg.min_clients:
        metrics["status"] = "failed"
        metrics["reason"] = (
            f"only {len(payloads)} valid payload(s); min-clients is {cfg.min_clients}"
        )
        write_json(folder.metrics, metrics)
        raise NotEnoughClients(metrics["reason"] + f" (see {folder.clients})")
    log.info("%d valid payloads: %s", len(payloads), ", ".join(sorted(payloads)))

    started = time.perf_counter()
    synthetic = synthesize_all(ldm, payloads, cfg, folder)
    seconds["synthesis"] = time.perf_counter() - started

    domains = sorted({p.meta.domain for p in payloads.values()})
    test_sets = dataset.load_test_sets(cfg, domains)
    for client_id, payload in payloads.items():
        real = test_sets[payload.meta.domain].images
        save_grid(folder, client_id, real, synthetic[client_id][0])

    started = time.perf_counter()
    accuracy = train_and_evaluate(
        cfg,
        synthetic,
        {d: (s.images, s.labels) for d, s in test_sets.items()},
        class_names,
        folder,
        select_device(cfg.device),
    )
    seconds["classifier"] = time.perf_counter() - started
    metrics.update(status="completed", accuracy=accuracy, seconds=seconds)
    write_json(folder.metrics, metrics)
    log.info(
        "done: mean accuracy %.3f over %s; results in %s",
        accuracy["mean"],
        ", ".join(f"{d} {a:.3f}" for d, a in accuracy["per_domain"].items()),
        folder.root,
    )

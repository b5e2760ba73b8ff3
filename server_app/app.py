"""FedBiP ServerApp: one round of uploads, then synthesis, classifier training and scoring.

Thin over the library. The classifier is scored where ``evaluation`` says: on the server's test
sets (simulations, paper presets) and/or by the institutions on their own held-out images,
which also keep the classifier. A restart with the same ``run-name`` finds the uploads on disk
and never asks a client that uploaded to upload again.
"""

from __future__ import annotations

import json
import logging
import time

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedbip_flwr import dataset
from fedbip_flwr.classifier import check_classifier_init, fit_to_classifier
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import load_for_run, select_device
from fedbip_flwr.logs import setup_logging
from fedbip_flwr.paths import resolve
from fedbip_flwr.report import write_report
from fedbip_flwr.server import (
    RunFolder,
    evaluate_on_server,
    expectations,
    first_images,
    load_persisted,
    save_grid,
    synthesize_all,
    train_global,
    weighted_mean,
)
from fedbip_flwr.storage import remove_partial_writes, write_json
from fedbip_flwr.wire import RUN_FOLDER
from server_app.strategy import FedBiPStrategy, NotEnoughClients, outcomes_json

log = logging.getLogger("fedbip_flwr.server_app")
app = ServerApp()
GRID_COLUMNS = 12  # images per row of grid-<client>.png


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
    check_classifier_init(cfg.classifier_init)  # an offline server fails now, not after synthesis
    started = time.perf_counter()
    ldm = load_for_run(cfg.model, cfg.device, cfg.half_precision, cfg.image_size)
    class_names = dataset.class_names(cfg)
    expect = expectations(cfg, ldm, class_names)
    seconds["load-model"] = time.perf_counter() - started

    started = time.perf_counter()
    payloads = load_persisted(folder, expect)
    strategy = FedBiPStrategy(
        expect,
        folder,
        min_clients=cfg.min_clients,
        wait_for_clients_s=cfg.wait_for_clients_s,
        already_accepted=payloads,
        uploaded_by_node=read_uploaders(folder),
    )
    if folder.clients.exists():
        clients = json.loads(folder.clients.read_text())
        log.info("resuming: %d payloads on disk, no client is asked to upload again", len(payloads))
    else:
        if payloads:
            log.info("restarting the round: %d upload(s) already on disk", len(payloads))
        strategy.start(grid, num_rounds=1, timeout=cfg.reply_timeout_s)
        payloads.update(strategy.accepted)
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
        write_report(folder.root)
        raise NotEnoughClients(metrics["reason"] + f" (see {folder.clients})")
    log.info("%d valid payloads: %s", len(payloads), ", ".join(sorted(payloads)))

    started = time.perf_counter()
    synthetic = synthesize_all(ldm, payloads, cfg, folder)
    seconds["synthesis"] = time.perf_counter() - started

    on_server = cfg.evaluation in ("server", "both")
    domains = sorted({p.meta.domain for p in payloads.values()})
    # Test sets are held at the classifier's input size, not the LDM's; the grids keep a row.
    tests, grid_rows = {}, {}
    for domain in domains if on_server else []:
        test = dataset.load_test_sets(cfg, [domain])[domain]
        grid_rows[domain] = test.images[:GRID_COLUMNS].clone()
        tests[domain] = (fit_to_classifier(test.images, cfg.classifier_image_size), test.labels)
        del test
    for client_id, payload in payloads.items():
        real = grid_rows.get(payload.meta.domain)
        save_grid(folder, client_id, real, first_images(synthetic[client_id], GRID_COLUMNS))

    started = time.perf_counter()
    device = select_device(cfg.device)
    model, facts = train_global(cfg, synthetic, class_names, folder, device)
    metrics["classifier"] = {"epoch_loss": facts["epoch_loss"]}
    metrics["accuracy"] = {k: facts[k] for k in ("num_synthetic_images", "classifier_seconds")}
    if on_server:
        metrics["accuracy"].update(
            evaluate_on_server(model, tests, cfg.classifier_image_size, device)
        )
    seconds["classifier"] = time.perf_counter() - started

    if cfg.evaluation in ("clients", "both"):
        started = time.perf_counter()
        per_client = strategy.evaluate_at_institutions(
            grid, folder.classifier.read_bytes(), {RUN_FOLDER: folder.root.name},
            timeout=cfg.reply_timeout_s,
        )  # fmt: skip
        metrics["evaluation"] = {
            "where": cfg.evaluation,
            "per_client": per_client,
            "weighted_mean": weighted_mean(per_client),
        }
        seconds["evaluation"] = time.perf_counter() - started
    metrics.update(status="completed", seconds=seconds)
    write_json(folder.metrics, metrics)
    write_report(folder.root)
    log.info("done: %s; results in %s", headline(metrics), folder.root)


def read_uploaders(folder: RunFolder) -> dict[int, str]:
    """Node id -> client id of every upload an earlier attempt of this run accepted."""
    if not folder.uploaders.exists():
        return {}
    return {int(node): client for node, client in json.loads(folder.uploaders.read_text()).items()}


def headline(metrics: dict) -> str:
    """One line of results: server-side per domain, institutions' own, or both."""
    parts = []
    accuracy = metrics["accuracy"]
    if "per_domain" in accuracy:
        domains = ", ".join(f"{d} {a:.3f}" for d, a in accuracy["per_domain"].items())
        parts.append(f"server-side mean accuracy {accuracy['mean']:.3f} over {domains}")
    if "evaluation" in metrics:
        per_client = metrics["evaluation"]["per_client"]
        scored = ", ".join(
            f"{c} {r['accuracy']:.3f}" if r["status"] == "ok" else f"{c} failed"
            for c, r in sorted(per_client.items())
        )
        parts.append(
            f"institutions' weighted mean {metrics['evaluation']['weighted_mean']:.3f} ({scored})"
        )
    return "; ".join(parts)

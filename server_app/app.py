"""ServerApp: one round of uploads, then the method's training set, the classifier and scores.

Thin over the library: the run config's ``method`` names what clients upload and what the
server makes of it (:mod:`fedbip_flwr.methods`; a multi-round method, FedAvg, runs its own Flower
strategy instead). The classifier is scored where ``evaluation`` says: on the server's test
sets (simulations, paper presets) and/or by the institutions on their own held-out images,
which also keep the classifier. A restart with the same ``run-name`` finds the uploads on disk
and never asks a client that uploaded to upload again. With ``synthesis = "external"`` the
training set is made by `fedbip synthesize` in other processes while this app waits
(:mod:`fedbip_flwr.distributed`).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedbip_flwr import dataset, methods
from fedbip_flwr.classifier import check_classifier_init, fit_to_classifier
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.distributed import RunSynthesis, SynthesisTimeout, wait_for_shards
from fedbip_flwr.ldm import LDM, load_for_run, select_device
from fedbip_flwr.logs import setup_logging
from fedbip_flwr.methods import MultiRound, ServerJob
from fedbip_flwr.paths import resolve
from fedbip_flwr.report import write_report
from fedbip_flwr.server import (
    RunFolder,
    evaluate_models,
    first_images,
    load_persisted,
    save_grid,
    train_global,
    weighted_mean,
)
from fedbip_flwr.storage import remove_partial_writes, write_json
from fedbip_flwr.wire import RUN_FOLDER
from server_app.strategy import NotEnoughClients, OneShotStrategy, outcomes_json

log = logging.getLogger("fedbip_flwr.server_app")
app = ServerApp()
GRID_COLUMNS = 12  # images per row of grid-<client>.png


@app.main()
def main(grid: Grid, context: Context) -> None:
    setup_logging()
    cfg = FedBiPConfig.from_flat(context.run_config)
    folder = RunFolder(resolve(cfg.output_dir) / (cfg.run_name or f"run-{context.run_id}"))
    folder.root.mkdir(parents=True, exist_ok=True)
    log.info("run folder: %s (method %s)", folder.root, cfg.method)
    for path in remove_partial_writes(folder.root):
        log.warning("removed %s, an unfinished write from an interrupted run", path)
    write_json(folder.config, cfg.to_flat())  # what `fedbip synthesize` works from
    dataset.verify(cfg)
    check_classifier_init(cfg.classifier_init, cfg.model)  # an offline server fails now, not after synthesis
    device = select_device(cfg.device)
    method = methods.create(cfg.method)
    if isinstance(method, MultiRound):
        _run_rounds(method, grid, cfg, folder, device)
        return
    seconds: dict[str, float] = {}
    job = ServerJob(cfg, dataset.class_names(cfg), _model_loader(cfg, seconds), device)

    started, started_unix = time.perf_counter(), time.time()
    accept = functools.partial(method.accept, server=job)
    uploads = load_persisted(folder, accept)
    strategy = OneShotStrategy(
        accept,
        job.max_bytes,
        folder,
        min_clients=cfg.min_clients,
        wait_for_clients_s=cfg.wait_for_clients_s,
        already_accepted=uploads,
        uploaded_by_node=read_uploaders(folder),
    )
    if folder.clients.exists():
        clients = json.loads(folder.clients.read_text())
        log.info("resuming: %d payloads on disk, no client is asked to upload again", len(uploads))
    else:
        if uploads:
            log.info("restarting the round: %d upload(s) already on disk", len(uploads))
        strategy.start(grid, num_rounds=1, timeout=cfg.reply_timeout_s)
        uploads.update(strategy.accepted)
        clients = outcomes_json(strategy.outcomes)
        write_json(folder.clients, clients)
    seconds["round"] = time.perf_counter() - started - seconds.get("load-model", 0.0)

    # started-unix: where the phases in `seconds` begin (round, synthesis, classifier,
    # evaluation, one after the other), so process samplers can place them in time
    metrics: dict = {"status": "running", "clients": clients, "config": cfg.to_flat(),
                     "started-unix": started_unix}  # fmt: skip
    if len(uploads) < cfg.min_clients:
        reason = f"only {len(uploads)} valid payload(s); min-clients is {cfg.min_clients}"
        _record_failure(folder, metrics, reason)
        raise NotEnoughClients(reason + f" (see {folder.clients})")
    log.info("%d valid payloads: %s", len(uploads), ", ".join(sorted(uploads)))

    started = time.perf_counter()
    if cfg.synthesis == "external":
        try:
            wait_for_shards(RunSynthesis(folder, method, job, uploads), cfg.synthesis_timeout_s)
        except SynthesisTimeout as err:
            _record_failure(folder, metrics, str(err))
            raise
    training_set = method.train_set(uploads, job, folder.shard_path)
    seconds["synthesis"] = time.perf_counter() - started
    write_json(folder.training_set, {c: [p.name for p in paths] for c, paths in training_set.items()})

    on_server = cfg.evaluation in ("server", "both")
    tests, grid_rows = _test_sets(cfg, sorted({u.domain for u in uploads.values()}) if on_server else [])
    for client_id, upload in sorted(uploads.items()):
        if training_set.get(client_id):
            real = grid_rows.get(upload.domain)
            save_grid(folder, client_id, real, first_images(training_set[client_id], GRID_COLUMNS))

    started = time.perf_counter()
    models = method.final_models(uploads, job)
    if models is None:
        model, facts = train_global(cfg, training_set, job.class_names, folder, device,
                                    method.teacher(uploads, job))  # fmt: skip
        models = {"global": model}
        metrics["classifier"] = {"epoch_loss": facts["epoch_loss"]}
        metrics["accuracy"] = {k: facts[k] for k in ("num_synthetic_images", "classifier_seconds")}
    else:
        metrics["accuracy"] = {"models": sorted(models)}
    if on_server:
        metrics["accuracy"].update(evaluate_models(models, tests, cfg.classifier_image_size, device))
    seconds["classifier"] = time.perf_counter() - started

    if cfg.evaluation in ("clients", "both") and folder.classifier.exists() and "global" in models:
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


def _record_failure(folder: RunFolder, metrics: dict, reason: str) -> None:
    """metrics.json and report.md of a run that stops here, with the reason."""
    metrics.update(status="failed", reason=reason)
    write_json(folder.metrics, metrics)
    write_report(folder.root)


def _run_rounds(method: MultiRound, grid: Grid, cfg: FedBiPConfig, folder: RunFolder, device) -> None:
    """A multi-round method's rounds on its Flower strategy, scored like every other method."""
    on_server = cfg.evaluation in ("server", "both")
    tests, _ = _test_sets(cfg, cfg.domain_list if on_server else [])
    metrics = method.run_server(
        grid, cfg, folder,
        lambda model: evaluate_models({"global": model}, tests, cfg.classifier_image_size, device)
        if on_server else {},
    )  # fmt: skip
    write_report(folder.root)
    log.info("done: %s; results in %s", headline(metrics), folder.root)


def _model_loader(cfg: FedBiPConfig, seconds: dict[str, float]) -> Callable[[], LDM]:
    """The frozen LDM, loaded on first use (Central and Local never need it), timed."""

    @functools.cache
    def load() -> LDM:
        started = time.perf_counter()
        ldm = load_for_run(cfg.model, cfg.device, cfg.half_precision, cfg.image_size,
                           channels_last=cfg.channels_last, compile_unet=cfg.compile_unet)
        seconds["load-model"] = time.perf_counter() - started
        return ldm

    return load


def _test_sets(cfg: FedBiPConfig, domains: list[str]) -> tuple[dict, dict]:
    """Test sets held at the classifier's input size, not the LDM's; and a row of real images
    per domain for the grids."""
    tests, grid_rows = {}, {}
    for domain in domains:
        test = dataset.load_test_sets(cfg, [domain])[domain]
        grid_rows[domain] = test.images[:GRID_COLUMNS].clone()
        tests[domain] = (fit_to_classifier(test.images, cfg.classifier_image_size), test.labels)
    return tests, grid_rows


def read_uploaders(folder: RunFolder) -> dict[int, str]:
    """Node id -> client id of every upload an earlier attempt of this run accepted and
    persisted (a node is recorded just before its payload is written)."""
    if not folder.uploaders.exists():
        return {}
    recorded = json.loads(folder.uploaders.read_text()).items()
    return {int(node): client for node, client in recorded if folder.payload_path(client).exists()}


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

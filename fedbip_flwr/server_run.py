"""The ServerApp's run for a one-shot method: one round of uploads, then the method's training
set, the classifier and its scores, each phase timed and recorded in the run folder.

The classifier is scored where ``federation.evaluation`` says: on the server's test sets
(simulations, paper presets) and/or by the institutions on their own held-out images, which also
keep the classifier. A restart with the same ``run-name`` finds the uploads on disk and never
asks a client that uploaded to upload again. With ``synthesis.where = "external"`` the training
set is made by `fedbip synthesize` in other processes while this waits
(:mod:`fedbip_flwr.distributed`).
A multi-round method (FedAvg) runs its own Flower strategy through :func:`run_rounds`, scored
the same way; :mod:`fedbip_flwr.apps` picks which.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from flwr.serverapp import Grid
from torch import nn

from . import dataset, results
from .classifier import fit_to_classifier, save_classifier
from .config import FedBiPConfig
from .distributed import RunSynthesis, SynthesisTimeout, wait_for_shards
from .ldm import LDM, load_for_run
from .methods import Method, MultiRound, ServerJob, Upload
from .paths import resolve
from .report import write_report
from .results import (
    Accuracy,
    ClassifierCurves,
    ClientOutcome,
    Evaluation,
    RunResults,
    Seconds,
)
from .server import (
    RunFolder,
    class_columns,
    evaluate_models,
    load_persisted,
    save_grid,
    synthetic_by_class,
    train_global,
)
from .storage import remove_partial_writes, write_json
from .strategy import NotEnoughClients, OneShotStrategy, ScoreBounds
from .wire import RUN_FOLDER

log = logging.getLogger("fedbip_flwr.server_app")  # what the ServerApp logs, under its name
GRID_PER_CLASS = 2  # images of each class per row of grid-<client>.png
GLOBAL = "global"  # the one classifier trained on the training set
TestSets = dict[str, tuple[torch.Tensor, torch.Tensor]]  # domain -> (images, labels)


def open_run_folder(cfg: FedBiPConfig, run_id: int) -> RunFolder:
    """The run's folder, rid of an interrupted attempt's unfinished writes, holding the run
    config that `fedbip synthesize` works from."""
    folder = RunFolder(resolve(cfg.output_dir) / (cfg.run_name or f"run-{run_id}"))
    folder.root.mkdir(parents=True, exist_ok=True)
    log.info("run folder: %s (method %s)", folder.root, cfg.method)
    for path in remove_partial_writes(folder.root):
        log.warning("removed %s, an unfinished write from an interrupted run", path)
    write_json(folder.config, cfg.to_flat())
    return folder


def run_rounds(
    method: MultiRound, grid: Grid, cfg: FedBiPConfig, folder: RunFolder, device: torch.device
) -> RunResults:
    """A multi-round method's rounds on its own Flower strategy, scored like every other method."""
    tests, _ = _test_sets(cfg, cfg.data.domain_list)
    return method.run_server(
        grid,
        cfg,
        folder,
        lambda model: Accuracy(**_server_scores({GLOBAL: model}, tests, cfg, device)),
    )


def run_one_shot(
    method: Method, grid: Grid, cfg: FedBiPConfig, folder: RunFolder, device: torch.device
) -> RunResults:
    """The one round, the training set, the classifier and its scores, each phase timed."""
    seconds = Seconds()
    job = ServerJob(
        cfg, dataset.class_names(cfg.data_description), _model_loader(cfg, seconds), device
    )
    started_unix = time.time()  # where `seconds` begin: process samplers place the phases by it
    strategy, uploads, clients = _round(method, grid, job, folder, seconds)
    # what metrics.json says if the run stops before it completes
    stopped = RunResults(
        status="failed", config=cfg.to_flat(), started_unix=started_unix, clients=clients
    )
    _require_enough(uploads, cfg, folder, stopped)
    training_set, uploads, clients = _training_set(method, job, uploads, folder, seconds, stopped)
    tests = _test_sets_and_grids(cfg, folder, uploads, training_set)
    models, accuracy, curves = _classifier(
        method, job, uploads, training_set, folder, tests, seconds
    )
    evaluation = _evaluate_at_institutions(method, strategy, grid, cfg, folder, models, seconds)
    completed = RunResults(
        status="completed",
        config=cfg.to_flat(),
        started_unix=started_unix,
        clients=clients,
        accuracy=accuracy,
        classifier=curves,
        evaluation=evaluation,
        seconds=seconds,
    )
    results.write(completed, folder.root)
    return completed


def _round(
    method: Method, grid: Grid, job: ServerJob, folder: RunFolder, seconds: Seconds
) -> tuple[OneShotStrategy, dict[str, Upload], list[ClientOutcome]]:
    """Every upload and the round's outcomes: from disk where an earlier attempt of this run
    finished the round, else from the one round, which never asks a client whose upload is
    on disk to upload again."""
    started = time.perf_counter()
    cfg = job.cfg
    accept = functools.partial(method.accept, server=job)
    uploads, refused = load_persisted(folder, accept)
    uploaders = read_uploaders(folder)
    strategy = OneShotStrategy(
        accept,
        job.max_bytes,
        folder,
        min_clients=cfg.federation.min_clients,
        wait_for_clients_s=cfg.federation.wait_for_clients_s,
        already_accepted=uploads,
        uploaded_by_node={node: c for node, c in uploaders.items() if c not in refused},
        owners=cfg.federation.client_node_map,
    )
    if folder.clients.exists():
        clients = results.read_clients(folder.clients)
        log.info("resuming: %d payloads on disk, no client is asked to upload again", len(uploads))
    else:
        if uploads:
            log.info("restarting the round: %d upload(s) already on disk", len(uploads))
        strategy.start(grid, num_rounds=1, timeout=cfg.federation.reply_timeout_s)
        uploads.update(strategy.accepted)
        clients = strategy.outcomes
    nodes = {client: node for node, client in uploaders.items()}
    clients = left_out(
        clients, {c: r for c, r in refused.items() if c not in uploads}, "rejected", nodes
    )
    results.write_clients(clients, folder.clients)
    seconds.round = _since(started) - (seconds.load_model or 0.0)
    return strategy, uploads, clients


def left_out(
    clients: list[ClientOutcome], reasons: Mapping[str, str], status: str, nodes: Mapping[str, int]
) -> list[ClientOutcome]:
    """The round's outcomes with each client of ``reasons`` recorded as ``status`` with its
    reason (added where the round has no outcome of it, under its node from ``nodes``)."""
    for client_id, reason in sorted(reasons.items()):
        log.warning("%s left out of the training set: %s", client_id, reason)
    out = [
        o.model_copy(update={"status": status, "reason": reasons[o.client_id]})
        if o.client_id in reasons and o.status in ("accepted", "kept")
        else o
        for o in clients
    ]
    recorded = {o.client_id for o in out if o.client_id in reasons}
    return out + [
        ClientOutcome(node_id=nodes.get(c, 0), status=status, client_id=c, reason=r)
        for c, r in sorted(reasons.items())
        if c not in recorded
    ]


def _require_enough(
    uploads: Mapping[str, Upload], cfg: FedBiPConfig, folder: RunFolder, stopped: RunResults
) -> None:
    """The run stops here, recorded, with fewer valid uploads than ``federation.min-clients``."""
    if len(uploads) < cfg.federation.min_clients:
        minimum = cfg.federation.min_clients
        reason = f"only {len(uploads)} valid payload(s); federation.min-clients is {minimum}"
        _stop(folder, stopped, reason)
        raise NotEnoughClients(f"{reason} (see {folder.clients})")
    log.info("%d valid payloads: %s", len(uploads), ", ".join(sorted(uploads)))


def _stop(folder: RunFolder, stopped: RunResults, reason: str) -> None:
    """metrics.json and report.md of a run that stops here, with the reason."""
    results.write(stopped.model_copy(update={"reason": reason}), folder.root)
    write_report(folder.root)


def _training_set(
    method: Method,
    job: ServerJob,
    uploads: Mapping[str, Upload],
    folder: RunFolder,
    seconds: Seconds,
    stopped: RunResults,
) -> tuple[dict[str, list[Path]], dict[str, Upload], list[ClientOutcome]]:
    """The classifier's training set as shards per client, made here or, with ``synthesis =
    "external"``, by `fedbip synthesize` in other processes while this waits (the run stops,
    recorded, when they take too long); and the uploads and outcomes it was made from.

    An accepted upload whose synthesis fails anyway (a check acceptance lacks) costs only its
    own client: each client's part is made alone to find which fail, they are recorded as
    failed with the error, and the set is made from the others (keyed shards already made are
    reused)."""
    started = time.perf_counter()
    if job.cfg.synthesis.where == "external":
        try:
            wait_for_shards(RunSynthesis(folder, method, job, uploads), job.cfg.synthesis.timeout_s)
        except SynthesisTimeout as err:
            _stop(folder, stopped, str(err))
            raise
    clients = list(stopped.clients or [])
    try:
        training_set = method.train_set(uploads, job, folder.shard_path)
    except Exception:  # noqa: BLE001 - whose upload it was is found next; a bug of ours re-raises
        log.exception("making the training set failed; making each client's part alone")
        failed = _failing_alone(method, job, uploads, folder)
        if not failed:
            raise
        uploads = {c: u for c, u in uploads.items() if c not in failed}
        clients = left_out(clients, failed, "failed", {o.client_id: o.node_id for o in clients})
        results.write_clients(clients, folder.clients)
        stopped = stopped.model_copy(update={"clients": clients})
        _require_enough(uploads, job.cfg, folder, stopped)
        training_set = method.train_set(uploads, job, folder.shard_path)
    seconds.synthesis = _since(started)
    folder.write_training_set(training_set)
    return training_set, dict(uploads), clients


def _failing_alone(
    method: Method, job: ServerJob, uploads: Mapping[str, Upload], folder: RunFolder
) -> dict[str, str]:
    """Client id -> the error of each upload whose part of the training set fails made alone."""
    failed = {}
    for client_id, upload in sorted(uploads.items()):
        try:
            method.train_set({client_id: upload}, job, folder.shard_path)
        except Exception as err:  # noqa: BLE001 - recorded as the client's failure
            failed[client_id] = (
                f"synthesis from its accepted upload failed: {type(err).__name__}: {err}"
            )
    return failed


def _test_sets_and_grids(
    cfg: FedBiPConfig,
    folder: RunFolder,
    uploads: Mapping[str, Upload],
    training_set: Mapping[str, list[Path]],
) -> TestSets | None:
    """The server's test sets of the uploads' domains (None where the run config scores only
    at the institutions), and a grid per client: real images of its domain, where the server
    holds them, above its synthetic ones, class for class."""
    tests, real_rows = _test_sets(cfg, sorted({u.domain for u in uploads.values()}))
    classes = len(cfg.data.class_list)
    for client_id, upload in sorted(uploads.items()):
        if training_set.get(client_id):
            synthetic = synthetic_by_class(training_set[client_id], classes, GRID_PER_CLASS)
            save_grid(folder, client_id, real_rows.get(upload.domain), synthetic)
    return tests


def _classifier(
    method: Method,
    job: ServerJob,
    uploads: Mapping[str, Upload],
    training_set: Mapping[str, list[Path]],
    folder: RunFolder,
    tests: TestSets | None,
    seconds: Seconds,
) -> tuple[dict[str, nn.Module], Accuracy, ClassifierCurves | None]:
    """The models to score (the method's own, else one classifier trained on the training
    set, with its curves), scored on the server's test sets where it holds them."""
    started = time.perf_counter()
    models = method.final_models(uploads, job)
    if models is None:
        model, facts = train_global(
            job.cfg, training_set, job.class_names, folder, job.device, method.teacher(uploads, job)
        )
        models, curves = {GLOBAL: model}, ClassifierCurves(epoch_loss=facts["epoch_loss"])
        accuracy = Accuracy(
            num_synthetic_images=facts["num_synthetic_images"],
            classifier_seconds=facts["classifier_seconds"],
            **_server_scores(models, tests, job.cfg, job.device),
        )
    else:
        curves = None
        if GLOBAL in models:  # one classifier of the method's own: the institutions score it too
            save_classifier(
                models[GLOBAL], folder.classifier, {"class_names": ",".join(job.class_names)}
            )
        scores = _server_scores(models, tests, job.cfg, job.device)
        accuracy = Accuracy(models=sorted(models), **scores)
    seconds.classifier = _since(started)
    return models, accuracy, curves


def _evaluate_at_institutions(
    method: Method,
    strategy: OneShotStrategy,
    grid: Grid,
    cfg: FedBiPConfig,
    folder: RunFolder,
    models: Mapping[str, nn.Module],
    seconds: Seconds,
) -> Evaluation | None:
    """The global classifier scored by the institutions that uploaded, where the run config
    asks for it; None where it does not or no global classifier was trained."""
    if (
        not cfg.federation.scored_at_institutions
        or GLOBAL not in models
        or not folder.classifier.exists()
    ):
        return None
    started = time.perf_counter()
    # a DP method's institutions send their accuracy alone
    bounds = ScoreBounds(
        len(dataset.class_names(cfg.data_description)),
        cfg.federation.max_images_per_client,
        method.settings.private,
    )
    per_client = strategy.evaluate_at_institutions(
        grid,
        folder.classifier.read_bytes(),
        {RUN_FOLDER: folder.root.name},
        timeout=cfg.federation.reply_timeout_s,
        bounds=bounds,
    )
    seconds.evaluation = _since(started)
    return Evaluation.of(cfg.federation.evaluation, per_client)


def _model_loader(cfg: FedBiPConfig, seconds: Seconds) -> Callable[[], LDM]:
    """The frozen LDM, loaded on first use (Central and Local never need it), timed."""

    @functools.cache
    def load() -> LDM:
        started = time.perf_counter()
        ldm = load_for_run(
            cfg.ldm.model,
            cfg.ldm.device,
            cfg.ldm.half_precision,
            cfg.data.image_size,
            channels_last=cfg.ldm.channels_last,
            compile_unet=cfg.ldm.compile_unet,
        )
        seconds.load_model = _since(started)
        return ldm

    return load


def _test_sets(
    cfg: FedBiPConfig, domains: list[str]
) -> tuple[TestSets | None, dict[str, torch.Tensor]]:
    """The server's test sets of ``domains`` at the classifier's input size, not the LDM's,
    and a row of real images per domain for the grids; (None, {}) where the run config
    scores only at the institutions."""
    if not cfg.federation.scored_on_server:
        return None, {}
    tests, grid_rows = {}, {}
    for domain in domains:
        test = dataset.load_test_sets(cfg.data_description, [domain])[domain]
        grid_rows[domain] = test.images[
            class_columns(test.labels, len(cfg.data.class_list), GRID_PER_CLASS)
        ].clone()
        tests[domain] = (fit_to_classifier(test.images, cfg.classifier.image_size), test.labels)
    return tests, grid_rows


def _server_scores(
    models: Mapping[str, nn.Module], tests: TestSets | None, cfg: FedBiPConfig, device: torch.device
) -> dict[str, Any]:
    """:class:`Accuracy`'s per_domain and mean (and per_model, for several models) on the
    server's test sets; nothing where it holds none."""
    if tests is None:
        return {}
    return evaluate_models(models, tests, cfg.classifier.image_size, device)


def _since(started: float) -> float:
    return time.perf_counter() - started


def read_uploaders(folder: RunFolder) -> dict[int, str]:
    """Node id -> client id of every upload an earlier attempt of this run accepted and
    persisted (a node is recorded just before its payload is written)."""
    if not folder.uploaders.exists():
        return {}
    recorded = json.loads(folder.uploaders.read_text()).items()
    return {int(node): client for node, client in recorded if folder.payload_path(client).exists()}

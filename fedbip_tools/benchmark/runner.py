"""Running the benchmark: each variant of a seed is one ``flwr run`` of the same clients on
Flower's simulation engine (:func:`run_variant`). A variant that differs only in what the server
does with the same uploads (FedLMG's distillation modes) starts from a copy of the other's run
folder, which the ServerApp resumes from as a restarted server does. Each row is measured
(:mod:`.measurements`) and cached per seed (``benchmarks/methods/seed-N.json``, with the settings
it was made with and its provenance: :mod:`fedbip_tools.provenance`), so an interrupted benchmark
resumes and seeds can run as separate processes (:func:`run_seed`, :func:`run`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedbip_flwr import dataset
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.paths import project_dir
from fedbip_flwr.results import read as read_results
from fedbip_flwr.server import RunFolder
from fedbip_flwr.storage import write_json

from .. import provenance
from ..judges import Judges, load_judges
from ..machine import this_machine
from ..simulation import SimulationError, run_simulation, run_status, stop_local_superlink
from .measurements import measure
from .settings import Bench, base_values
from .variants import NAMES_VERSION, Variant, available, named, variant

log = logging.getLogger(__name__)


# what a row records of its own run, kept when it is measured again from a folder
RUN_RECORD = frozenset({"server_seconds", "client_seconds", "upload_bytes", "fedavg_rounds"})


def copy_uploads(source: RunFolder, target: RunFolder) -> None:
    """Start ``target`` from ``source``'s round: its uploads and shards (hard links), never its
    results, so the ServerApp resumes after the round."""
    if target.root.exists():
        shutil.rmtree(target.root)
    target.root.mkdir(parents=True)
    for folder in (source.payloads, source.shards):
        if folder.exists():
            shutil.copytree(folder, target.root / folder.name, copy_function=os.link)
    for path in (source.clients, source.uploaders):
        if path.exists():
            shutil.copy2(path, target.root / path.name)


def variant_values(bench: Bench, v: Variant, seed: int) -> dict[str, Any]:
    """The run config of the variant's run for ``seed``."""
    images = bench.settings.run_config["data.shots-per-class"] * len(dataset_classes())
    return {**base_values(bench, seed), **v.run_values(bench.settings, images)}


def run_variant(bench: Bench, v: Variant, seed: int) -> RunFolder:
    """One ``flwr run`` of the variant; its run folder once the run completed."""
    seed_folder = bench.seed_folder(seed)
    folder = run_folder(bench, seed, v.name)
    if v.reuse:
        copy_uploads(run_folder(bench, seed, v.reuse), folder)
    elif folder.root.exists():
        shutil.rmtree(folder.root)
    values = {**variant_values(bench, v, seed), "run-name": folder.root.name}
    home = seed_folder / "flwr-home"
    threads = str(bench.threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    log.info("seed %d: %s", seed, v.name)
    try:
        run_id, output = run_simulation(
            home, values, len(bench.settings.domains), bench.timeout_s, project_dir(), env=env
        )
        status = run_status(home, run_id)
    finally:
        stop_local_superlink(home)
    if status != "finished:completed" or not folder.metrics.exists():
        raise SimulationError(f"{v.name}, seed {seed}: run {status}\n{output[-3000:]}")
    return folder


def dataset_classes() -> list[str]:
    return dataset.class_names(FedBiPConfig().data_description)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def run_folder(bench: Bench, seed: int, name: str) -> RunFolder:
    return RunFolder(bench.seed_folder(seed) / slug(name))


def run_seed(
    bench: Bench, seed: int, names: Sequence[str], judges: Judges, *, remeasure: bool = False
) -> dict[str, Any]:
    """Every named variant for one seed (reused ones after their source), cached as it goes;
    a cached row made on another model than the project's is made again on it.
    ``remeasure``: a cached row whose run folder is still here is measured again from it (new
    columns without a new run); a row whose folder is gone stays as cached."""
    cache = bench.cache(seed)
    stored = json.loads(cache.read_text()) if cache.exists() else {}
    if stored.get("settings") != bench.settings.digest():
        stored = {"settings": bench.settings.digest(), "names": NAMES_VERSION, "results": {}}
    results = named(stored)["results"]
    root = project_dir() or Path.cwd()
    model = provenance.model_digest(root / FedBiPConfig().ldm.model)  # the LDM every run loads
    for v in ordered(available(names)):
        if v.name in results and results[v.name].get("model") == model:
            if remeasure and (
                measured := measure_again(bench, seed, v.name, results[v.name], judges)
            ):
                results[v.name] = measured
                write_json(cache, stored)
            continue
        if v.name in results:
            log.info("seed %d: %s was made on model %s; remaking it on %s", seed, v.name,
                     results[v.name].get("model", provenance.UNRECORDED), model)  # fmt: skip
        made = provenance.record(root, bench.threads, [bench.results])
        started, load = time.perf_counter(), os.getloadavg()[0]
        folder = run_variant(bench, v, seed)
        results[v.name] = {
            **measure(folder, judges, bench.settings),
            "wall_seconds": time.perf_counter() - started,
            "load_average": (load + os.getloadavg()[0]) / 2,  # seconds mean little under load
            "provenance": made,  # as the run started: the code it ran
            "model": model,
        }
        write_json(cache, stored)
        log.info("seed %d: %s mean accuracy %.3f", seed, v.name, results[v.name]["mean"])
    return results


def measure_again(
    bench: Bench, seed: int, name: str, cached: dict[str, Any], judges: Judges
) -> dict[str, Any] | None:
    """The cached row with every measurement taken again from its run folder, or None where the
    folder is gone or holds another run (its accuracy is not the row's)."""
    folder = run_folder(bench, seed, name)
    if not folder.metrics.exists():
        log.info("seed %d: %s has no run folder here; kept as cached", seed, name)
        return None
    found = read_results(folder.metrics).accuracy.per_domain  # before the costly measurements
    if found != cached["per_domain"]:
        log.warning(
            "seed %d: %s's run folder holds another run (accuracy %s, cached %s); kept as cached",
            seed,
            name,
            found,
            cached["per_domain"],
        )
        return None
    measured = measure(folder, judges, bench.settings)
    log.info("seed %d: %s measured again from its run folder", seed, name)
    # the folder may hold a later run of the same settings (same accuracy): the seconds and
    # bytes stay those of the run the row records
    return {**cached, **{k: v for k, v in measured.items() if k not in RUN_RECORD}}


def ordered(chosen: Sequence[Variant]) -> list[Variant]:
    """Sources before the variants that reuse them (added if not chosen)."""
    out: list[Variant] = []
    for v in chosen:
        for needed in (variant(v.reuse),) if v.reuse else ():
            if needed not in out:
                out.append(needed)
        if v not in out:
            out.append(v)
    return out


def cached_seeds(bench: Bench) -> dict[int, dict[str, Any]]:
    """Every seed's cached results made with this benchmark's settings."""
    runs = {}
    for path in sorted((bench.results / "methods").glob("seed-*.json")):
        stored = json.loads(path.read_text())
        if stored.get("settings") == bench.settings.digest():
            runs[int(path.stem.removeprefix("seed-"))] = named(stored)["results"]
    return runs


def judges_record(bench: Bench) -> Path:
    """The judges' accuracy on held-out real images per machine kind, kept beside the results
    (the judges' weights, 90 MB, stay in the work folder: they are retrained in minutes from a
    fixed seed)."""
    return bench.results / "methods" / "judges.json"


def record_judges(bench: Bench, on_real: Mapping[str, float]) -> None:
    """Keep ``on_real`` as the latest judges of this machine's kind (each row records the judges
    that judged it: :data:`JUDGES`)."""
    path = judges_record(bench)
    kept = json.loads(path.read_text()) if path.exists() else {}
    write_json(path, {**kept, this_machine().kind: dict(on_real)})


def run(
    bench: Bench, seeds: Sequence[int], names: Sequence[str], *, remeasure: bool = False
) -> None:
    judges = load_judges(bench.work / "judges.safetensors")
    record_judges(bench, judges.accuracy_on_real)
    for seed in seeds:
        run_seed(bench, seed, names, judges, remeasure=remeasure)

"""A run's training set made outside the ServerApp: over processes, GPUs and machines.

With ``synthesis.where = "external"`` the ServerApp keeps everything a second process needs on disk
(``config.json``, ``payloads/``, ``clients.json``), logs the command and waits
(:func:`wait_for_shards`). `fedbip synthesize RUN_DIR`, run once or by ``accelerate launch`` on
many GPUs and machines over a shared run folder, makes the method's own work units
(:meth:`~fedbip_flwr.methods.base.Method.work_units`), each process its share balanced by image
count (:func:`synthesize_share`). Shards are keyed and written atomically, so a crash loses at
most the shards being written and a rerun makes only what is missing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list

from . import dataset
from .config import ConfigError, FedBiPConfig, LDMConfig
from .ldm import load_for_run, select_device
from .methods import Method, ServerJob, Upload, one_shot_for
from .progress import Progress
from .server import RunFolder, ShardMode, ShardPending, WorkUnit, load_persisted

log = logging.getLogger(__name__)
POLL_S = 2.0  # how often a waiting ServerApp looks for new shards
REPORT_EVERY_S = 60.0  # how often it logs how far synthesis is


class RunNotReady(RuntimeError):
    """The run folder lacks what synthesis needs (its config, or a finished round)."""


class SynthesisTimeout(RuntimeError):
    """synthesis.timeout-s passed before every shard was on disk."""


@dataclass(frozen=True)
class RunSynthesis:
    """A run's method, uploads and folder: its work units, and making or checking one."""

    folder: RunFolder
    method: Method
    job: ServerJob
    uploads: dict[str, Upload]

    def units(self) -> list[WorkUnit]:
        return self.method.work_units(self.uploads, self.job)

    def make(self, unit: WorkUnit, mode: ShardMode = ShardMode.MAKE) -> list[Path]:
        """``unit``'s shards, made where missing, or (CHECK) :class:`ShardPending` instead."""
        job = dataclasses.replace(self.job, shard_mode=mode)
        return self.method.make_unit(unit, self.uploads, job, self.folder.shard_path)

    def ready(self, unit: WorkUnit) -> bool:
        """Every shard of ``unit`` is on disk under its key: the method's own code checks."""
        try:
            self.make(unit, ShardMode.CHECK)
        except ShardPending:
            return False
        return True

    def pending(self, units: Sequence[WorkUnit]) -> list[WorkUnit]:
        return [unit for unit in units if not self.ready(unit)]


def read_run_config(folder: RunFolder) -> FedBiPConfig:
    """The config the ServerApp wrote at its start, once its round is over."""
    if not folder.config.exists():
        raise RunNotReady(
            f"{folder.config} does not exist: not a run folder, or written by a ServerApp "
            "older than `fedbip synthesize`"
        )
    if not folder.clients.exists():
        raise RunNotReady(
            f"the round of {folder.root} is not over ({folder.clients.name} is missing): run "
            "this once the ServerApp logs the command"
        )
    try:
        values = json.loads(folder.config.read_text())
    except ValueError as err:  # not JSON, or not UTF-8
        raise ConfigError(f"{folder.config} is not JSON: {err}") from err
    if not isinstance(values, dict):
        raise ConfigError(f"{folder.config} holds a {type(values).__name__}, not a run config")
    return FedBiPConfig.from_recorded(values)


def open_run(folder: RunFolder, cfg: FedBiPConfig, device: torch.device) -> RunSynthesis:
    """The run's uploads re-read and validated by its method, as a restarted ServerApp does,
    with the LDM (loaded on first use) on ``device``."""
    try:
        method = one_shot_for(cfg)
    except ValueError as err:  # a multi-round run has no uploads to synthesize from
        raise ConfigError(f"{folder.root}: {err}") from None
    loader = functools.cache(
        functools.partial(
            load_for_run,
            cfg.ldm.model,
            device,
            cfg.ldm.half_precision,
            cfg.data.image_size,
            channels_last=cfg.ldm.channels_last,
            compile_unet=cfg.ldm.compile_unet,
        )
    )
    job = ServerJob(cfg, dataset.class_names(cfg.data_description), loader, device)
    uploads, refused = load_persisted(folder, functools.partial(method.accept, server=job))
    for client_id, reason in sorted(refused.items()):  # the ServerApp records them
        log.warning("%s left out: %s", client_id, reason)
    return RunSynthesis(folder, method, job, uploads)


def process_state(ldm: LDMConfig) -> PartialState:
    """This process's place among those `accelerate launch` (or torchrun) started.

    On a machine without CUDA, or with ``ldm.device = "cpu"``, accelerate's CPU mode makes the
    processes one gloo group; otherwise each takes its own GPU (nccl).
    """
    return PartialState(cpu=select_device(ldm.device).type == "cpu")


def balanced_bins(units: Sequence[WorkUnit], count: int) -> list[list[WorkUnit]]:
    """``count`` bins of near-equal image totals (the largest unit first, into the lightest
    bin), each in the enumeration's order. The heaviest bin exceeds the lightest by at most one
    unit's images. Deterministic, so every process computes the same bins."""
    order = {unit: position for position, unit in enumerate(units)}
    bins: list[list[WorkUnit]] = [[] for _ in range(count)]
    loads = [0] * count
    for unit in sorted(units, key=lambda u: -u.images):  # stable: ties keep enumeration order
        lightest = loads.index(min(loads))
        bins[lightest].append(unit)
        loads[lightest] += unit.images
    return [sorted(b, key=order.__getitem__) for b in bins]


def my_share(units: Sequence[WorkUnit], state: PartialState) -> list[WorkUnit]:
    """This process's bin: one balanced bin per process, handed out by accelerate."""
    with state.split_between_processes(balanced_bins(units, state.num_processes)) as mine:
        return list(mine[0]) if mine else []


def synthesize_share(run: RunSynthesis, state: PartialState) -> list[WorkUnit]:
    """Make this process's share of what is still missing; return once every process is done.

    The main process decides what is missing and tells the others, so all split the same
    list (a shard another process finished meanwhile would otherwise change it), and a rerun
    after a crash balances only the remaining work. Returns the units this process made.
    """
    todo = [run.pending(run.units()) if state.is_main_process else None]
    broadcast_object_list(todo)
    mine = my_share(todo[0], state)
    what = f"synthesis (process {state.process_index + 1} of {state.num_processes})"
    progress = Progress(log, what, sum(u.images for u in mine), "images")
    for unit in mine:
        run.make(unit)
        progress.update(unit.images)
    progress.finish()
    state.wait_for_everyone()
    return mine


def external_command(folder: RunFolder) -> str:
    """What to run, on this machine or on any that sees the run folder."""
    where = shlex.quote(str(folder.root.resolve()))
    return (
        f"`fedbip synthesize {where}` (one process), or on N GPUs `accelerate launch "
        f"--num_processes N -m fedbip_tools.cli synthesize {where}` (docs/scale.md)"
    )


def wait_for_shards(
    run: RunSynthesis,
    timeout_s: float,
    poll_s: float = POLL_S,
    report_every_s: float = REPORT_EVERY_S,
) -> None:
    """Until every work unit's shards are on disk under their keys (made by `fedbip
    synthesize`), logging the command once and progress now and then;
    :class:`SynthesisTimeout` after ``timeout_s``."""
    units = run.units()
    pending = run.pending(units)
    if not pending:
        return
    total = sum(u.images for u in units)
    log.info(
        "waiting for external synthesis of %d image(s) in %d unit(s): run %s",
        total,
        len(units),
        external_command(run.folder),
    )
    started = reported = time.monotonic()
    while pending:
        if time.monotonic() - started > timeout_s:
            first = pending[0]
            raise SynthesisTimeout(
                f"synthesis.timeout-s ({timeout_s:g} s) passed with {len(pending)} of "
                f"{len(units)} unit(s) not on disk (first: {first.client_id} #{first.index}); "
                f"run {external_command(run.folder)} and restart the ServerApp with the same "
                "run-name: finished shards are kept"
            )
        time.sleep(poll_s)
        pending = run.pending(pending)
        if time.monotonic() - reported >= report_every_s:
            reported = time.monotonic()
            done = total - sum(u.images for u in pending)
            log.info("external synthesis: %d of %d image(s) on disk", done, total)
    log.info("external synthesis: all %d unit(s) on disk", len(units))

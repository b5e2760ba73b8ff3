"""What an upload poisoned within the server's bounds does to the other institutions (issue 91).

The server's plausibility bounds (docs/payload.md, "Plausibility") refuse what no honest client
could send, not what an honest client might: two poisons that today's validation accepts.

* ``mixture-shift``: one client's fedbip-mixture upload with every component mean of every
  class moved by one uniform shift, ``--shift-fraction`` of the room the per-image mean bound
  leaves (``a L + k b / sqrt(D)`` less the largest component average already there and a
  margin for the server's draws: :func:`mean_room`).
* ``espresso-flip``: one client's Espresso upload with its conditions rolled by one class
  (class k's images are drawn toward class k - 1's conditions; mixture and counts untouched).

Each attack is two real ``flwr run`` simulations of the same seed and run config: the honest
one, then the same run resumed from the honest uploads (its run folder's payloads, shards and
round record, hard-linked) with the poisoned client's upload replaced by its poisoned version;
the ServerApp checks every stored upload again on resume, so a poison the server refuses is
recorded as refused, and the run is made only when it is accepted. The measure is the
server-side accuracy on each domain (``evaluation = "server"``), above all on the other
clients' domains. One JSON record with provenance:

    OMP_NUM_THREADS=2 python scripts/poisoning.py --out benchmarks/poisoning_seed0.json --seed 0
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.common.config import parse_config_args

from fedbip_flwr import dataset, results
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.expectations import expectations
from fedbip_flwr.ldm import LDM, load_for_run
from fedbip_flwr.methods import ServerJob, create_one_shot, one_shot_for
from fedbip_flwr.methods.base import decode_upload, encode_upload
from fedbip_flwr.methods.espresso import CONDITIONS
from fedbip_flwr.mixture import MIXTURE_MEANS, MIXTURE_VARIANCES, MIXTURE_WEIGHTS
from fedbip_flwr.paths import resolve
from fedbip_flwr.payload import latent_bounds
from fedbip_flwr.server import RunFolder
from fedbip_flwr.storage import atomic_write
from fedbip_flwr.upload import PayloadError, read_header, upload_method
from fedbip_tools import provenance
from fedbip_tools.benchmark import copy_uploads
from fedbip_tools.cli import project_run_config
from fedbip_tools.simulation import (
    SimulationError,
    run_simulation,
    run_status,
    stop_local_superlink,
)

ROOT = Path(__file__).resolve().parents[1]
ATTACKS = {"mixture-shift": "fedbip-mixture", "espresso-flip": "espresso"}
SHIFT_FRACTION = 0.9  # of the room the mean bound leaves (mean_room)
# sds of a draw's mean left between the shifted means and the bound: the server checks 64 draws
# a class, and at 5 sds one of a few hundred leaves it with probability about 2e-4
DRAW_SIGMAS = 5.0


def reencoded(blob: bytes, change: Callable[[dict[str, torch.Tensor]], None]) -> bytes:
    """An upload re-encoded after ``change`` of its tensors (in place), metadata as it was."""
    method = create_one_shot(upload_method(blob, len(blob)))
    upload = decode_upload(blob, method.meta_model, tuple(read_header(blob)[0]), len(blob))
    tensors = dict(upload.tensors)
    change(tensors)
    return encode_upload(upload.meta, tensors)


def shift_means(blob: bytes, shift: float) -> bytes:
    """A mixture upload with every component mean moved by ``shift`` on every coordinate."""

    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[MIXTURE_MEANS] = tensors[MIXTURE_MEANS] + shift

    return reencoded(blob, change)


def flip_conditions(blob: bytes) -> bytes:
    """An Espresso upload whose class k holds class k - 1's conditions (k = 0: the last's)."""

    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[CONDITIONS] = tensors[CONDITIONS].roll(1, dims=0)

    return reencoded(blob, change)


def mean_room(blob: bytes, cfg: FedBiPConfig, ldm: LDM) -> tuple[float, float]:
    """(room, bound): how far every mean of a mixture upload can move together before the
    server's checks see it, and the per-image mean bound. A used component's average must stay
    within the bound, and so must the mean of every draw the server checks, which is that
    average plus noise of sd sqrt(average variance / D): DRAW_SIGMAS of it are left as margin."""
    method = create_one_shot(upload_method(blob, len(blob)))
    upload = decode_upload(blob, method.meta_model, tuple(read_header(blob)[0]), len(blob))
    own = cfg.settings_of(method.name)
    plaus = expectations(cfg, ldm, dataset.class_names(cfg.data_description), own).plausibility
    means = upload.tensors[MIXTURE_MEANS].double()
    dim = means.shape[-1]
    bound = latent_bounds(plaus.alpha_bar, dim, plaus.latent_rms, plaus.sigmas)
    used = upload.tensors[MIXTURE_WEIGHTS] > 0
    averages = means.mean(-1)[used]
    draw_sd = (upload.tensors[MIXTURE_VARIANCES].double().mean(-1)[used] / dim).sqrt()
    room = bound.abs_mean - float(averages.max()) - DRAW_SIGMAS * float(draw_sd.max())
    return room, bound.abs_mean


def accepted(blob: bytes, cfg: FedBiPConfig, ldm: LDM) -> str:
    """'' where the run's server accepts the upload, else its reason."""
    job = ServerJob(cfg, dataset.class_names(cfg.data_description), lambda: ldm)
    try:
        one_shot_for(cfg).accept(blob, job)
    except PayloadError as err:
        return err.reason
    return ""


def simulate(home: Path, values: dict[str, Any], clients: int, threads: int) -> RunFolder:
    """One ``flwr run`` of ``values``; its run folder once completed."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    try:
        run_id, output = run_simulation(home, values, clients, 6 * 3600, ROOT, env=env)
        status = run_status(home, run_id)
    finally:
        stop_local_superlink(home)
    folder = RunFolder(resolve(values["output-dir"]) / values["run-name"])
    if status != "finished:completed" or not folder.metrics.exists():
        raise SimulationError(f"{values['run-name']}: run {status}\n{output[-3000:]}")
    return folder


def scores(folder: RunFolder) -> dict[str, Any]:
    accuracy = results.read(folder.root).accuracy
    return {"per_domain": accuracy.per_domain, "mean": accuracy.mean}


def attack(
    name: str, args: argparse.Namespace, base: dict[str, Any], ldm: Callable[[], LDM]
) -> dict[str, Any]:
    """The honest run, the poison, and (where the server accepts it) the poisoned run."""
    values = {**base, "method": ATTACKS[name], "run-name": f"{name}-honest"}
    cfg = FedBiPConfig.from_flat({**project_run_config(), **values})
    home = args.work / "flwr-home"
    started = time.perf_counter()
    honest = simulate(home, values, len(cfg.data.domain_list), args.threads)
    blob = honest.payload_path(args.client).read_bytes()
    entry: dict[str, Any] = {"method": ATTACKS[name], "client": args.client}
    if name == "mixture-shift":
        room, bound = mean_room(blob, cfg, ldm())
        shift = args.shift_fraction * room
        poisoned_blob = shift_means(blob, shift)
        entry["poison"] = {"shift": shift, "mean_bound": bound, "room": room}
    else:
        poisoned_blob = flip_conditions(blob)
        entry["poison"] = {"conditions": "class k's rows are class k - 1's"}
    entry["refused"] = accepted(poisoned_blob, cfg, ldm())
    entry["honest"] = scores(honest)
    if not entry["refused"]:
        poisoned = RunFolder(honest.root.with_name(f"{name}-poisoned"))
        copy_uploads(honest, poisoned)
        atomic_write(poisoned.payload_path(args.client), poisoned_blob)
        simulate(
            home,
            {**values, "run-name": poisoned.root.name},
            len(cfg.data.domain_list),
            args.threads,
        )
        entry["poisoned"] = scores(poisoned)
        own = args.client.rsplit("-", 1)[0]
        entry["change_on_others"] = {
            domain: entry["poisoned"]["per_domain"][domain] - accuracy
            for domain, accuracy in entry["honest"]["per_domain"].items()
            if domain != own
        }
        entry["change_on_own"] = (
            entry["poisoned"]["per_domain"][own] - entry["honest"]["per_domain"][own]
        )
    entry["seconds"] = round(time.perf_counter() - started, 1)
    return entry


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "poisoning.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedbip-poisoning"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attacks", nargs="+", choices=sorted(ATTACKS), default=sorted(ATTACKS))
    parser.add_argument("--client", default="sketch-0", help="whose upload is poisoned")
    parser.add_argument("--shift-fraction", type=float, default=SHIFT_FRACTION)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--run-config",
        action="append",
        help="run config over the project's defaults ('k=v ...', as flwr run takes it)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    base = {
        **parse_config_args(args.run_config),
        "seed": args.seed,
        # every domain's accuracy, the poisoned client's and the others'
        "federation.evaluation": "server",
        # the honest clients' uploads, remade alike by any rerun
        "federation.replayable-client-noise": True,
        "output-dir": str(args.work / f"seed-{args.seed}"),
    }
    cfg = FedBiPConfig.from_flat({**project_run_config(), **base})
    loaded: list[LDM] = []

    def ldm() -> LDM:  # the server's model, for the poison's size and its verdict, loaded once
        if not loaded:
            loaded.append(load_for_run(cfg.ldm.model, "cpu", False, cfg.data.image_size))
        return loaded[0]

    command = shlex.join(
        ["python", "scripts/poisoning.py", *(sys.argv[1:] if argv is None else argv)]
    )
    out = {
        "what": "issue 91: poisons within the server's bounds, and what they do to the other "
        "institutions' domains (scripts/poisoning.py's docstring)",
        "command": command,
        "seed": args.seed,
        "run_config": base,
        "attacks": {name: attack(name, args, base, ldm) for name in args.attacks},
        "provenance": provenance.record(
            ROOT, args.threads, [args.out], model=resolve(cfg.ldm.model)
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

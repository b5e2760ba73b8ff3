"""The ``fedbip`` command: small tools around a FedBiP run.

Subcommands register themselves in :func:`build_parser`; each sets ``func`` to a handler that
takes the parsed arguments and returns the exit status. ``fedbip inspect`` lets anyone audit
exactly what a client uploads (or what a server stored) before trusting it.

Handlers import what they use when they run: the models, data and synthesis modules take
seconds to import, which ``fedbip --help`` and ``fedbip inspect`` should not pay.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedbip_flwr import shapes
from fedbip_flwr.upload import (
    DEFAULT_MAX_BYTES,
    PayloadError,
    PayloadTooLarge,
    dtype_name,
    printable,
    read_capped,
)

if TYPE_CHECKING:
    from pydantic import BaseModel

_TABLE_COLUMNS = ("name", "shape", "dtype", "mean", "std")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; add a subcommand by adding one ``_add_*`` call here."""
    parser = argparse.ArgumentParser(prog="fedbip", description="Tools around a FedBiP run.")
    subcommands = parser.add_subparsers(dest="command", required=True)
    _add_inspect(subcommands)
    _add_report(subcommands)
    _add_export_concepts(subcommands)
    _add_shapes_folder(subcommands)
    _add_personalize(subcommands)
    _add_benchmark(subcommands)
    _add_world_check(subcommands)
    subcommands.add_parser(
        "speed",
        add_help=False,
        help="speed against the stock diffusers pipeline and the textual-inversion recipe "
        "(fedbip speed --help)",
    )
    _add_synthesize(subcommands)
    return parser


def _add_inspect(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inspect = subcommands.add_parser(
        "inspect",
        help="validate a client payload and show its metadata and tensors",
        description="Validate a FedBiP payload (.safetensors) and print what it contains. "
        "Exit status 0: valid; 1: invalid or unreadable.",
    )
    inspect.add_argument("payload", type=Path, help="payload file (.safetensors)")
    inspect.add_argument(
        "--max-mb",
        type=_positive_float,
        default=DEFAULT_MAX_BYTES / 2**20,
        help="refuse files larger than this many MiB (default: %(default)g, as the server)",
    )
    inspect.add_argument(
        "--run-config",
        action="append",
        help="the federation's run config (TOML file or 'k=v ...', over this project's defaults): "
        "check the upload as that run's server does, against its base model, plausibility "
        "included; without it only the upload's structure is checked",
    )
    inspect.set_defaults(func=_run_inspect)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _run_inspect(args: argparse.Namespace) -> int:
    """Print metadata, a tensor table and what an institution records of it (digest, kinds,
    guarantee, the measured membership figure) for a valid upload (any method); one line on
    stderr otherwise."""
    from fedbip_flwr.methods import audit_upload
    from fedbip_flwr.upload_record import describe, record_lines  # what an institution records

    try:
        blob = read_capped(args.payload, int(args.max_mb * 2**20))
        upload = audit_upload(blob, int(args.max_mb * 2**20))
    except PayloadTooLarge as err:
        print(
            f"invalid payload: payload is {err.amount}, above --max-mb {args.max_mb:g} "
            f"({err.limit} bytes)",
            file=sys.stderr,
        )
        return 1
    except PayloadError as err:
        print(f"invalid payload: {err.reason}", file=sys.stderr)
        return 1
    except OSError as err:
        print(
            f"fedbip inspect: cannot read '{args.payload}': {err.strerror or err}", file=sys.stderr
        )
        return 1
    print(f"file: {args.payload}")
    print(f"bytes: {len(blob)}")
    for line in _meta_lines(upload.meta):
        print(line)
    print()
    print(_format_table([tensor_summary(name, t) for name, t in upload.tensors.items()]))
    print()
    for line in record_lines(describe(blob)):
        print(line)
    print()
    return _server_verdict(blob, args.run_config)


def _server_verdict(blob: bytes, run_config: list[str] | None) -> int:
    """What the run's server would say of the upload: its method's ``accept`` with the run's
    base model (0: it would be accepted; 1: refused, with the server's reason)."""
    if not run_config:
        print(
            "verdict: structure valid; not checked against a run's base model and plausibility "
            "bounds (give the federation's --run-config for the server's verdict)"
        )
        return 0
    import click
    from flwr.common.config import parse_config_args

    from fedbip_flwr import dataset, methods
    from fedbip_flwr.config import ConfigError, FedBiPConfig
    from fedbip_flwr.ldm import ModelLoadError, load_for_run

    try:
        cfg = FedBiPConfig.from_flat({**project_run_config(), **parse_config_args(run_config)})
        loader = functools.cache(
            functools.partial(load_for_run, cfg.ldm.model, "cpu", False, cfg.data.image_size)
        )
        job = methods.ServerJob(cfg, dataset.class_names(cfg.data_description), loader)
        methods.one_shot_for(cfg).accept(blob, job)
    except PayloadError as err:
        print(f"verdict: the run's server refuses it: {err.reason}")
        return 1
    except (ConfigError, ModelLoadError, OSError, ValueError) as err:
        print(f"fedbip inspect: --run-config: {printable(err)}", file=sys.stderr)
        return 1
    except click.ClickException as err:
        print(f"fedbip inspect: --run-config: {err.format_message()}", file=sys.stderr)
        return 1
    print(f"verdict: the run's server ({cfg.method}, {cfg.ldm.model}) accepts it")
    return 0


def _meta_lines(meta: BaseModel) -> list[str]:
    """``key: value`` per metadata field: strings bare, everything else as JSON."""
    return [
        f"{key}: {printable(value) if isinstance(value, str) else json.dumps(value)}"
        for key, value in meta.model_dump().items()
    ]


def tensor_summary(name: str, tensor: torch.Tensor) -> dict[str, Any]:
    """Name, shape, dtype, mean and std: enough to eyeball an upload (z(T) ~ N(0, I))."""
    values = tensor.detach().to("cpu", torch.float64)
    return {
        "name": name,
        "shape": list(tensor.shape),
        "dtype": dtype_name(tensor.dtype),
        "mean": float(values.mean()),
        "std": float(values.std(correction=0)),  # population std: defined for one element
    }


def _format_table(rows: list[dict[str, Any]]) -> str:
    """Left-aligned plain-text columns; stays readable in logs and pipes."""
    cells = [list(_TABLE_COLUMNS)] + [[_cell(row[col]) for col in _TABLE_COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_TABLE_COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in cells
    )


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _add_report(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    report = subcommands.add_parser(
        "report",
        help="rebuild a run folder's report.md from its metrics.json and PNGs",
        description="Write RUN_DIR/report.md and its curve PNGs from RUN_DIR/metrics.json, "
        "linking the grids already there. Exit status 0: written; 1: no readable metrics.json.",
    )
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run folder (outputs/...)")
    report.add_argument(
        "--judges",
        type=Path,
        metavar="PATH",
        help="first judge the run's synthetic images with the shapes world's fidelity judges "
        "saved at PATH (trained and saved there on first use, minutes on a CPU): class and "
        "domain fidelity per domain go to RUN_DIR/fidelity.json and beside the accuracy",
    )
    report.set_defaults(func=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from fedbip_flwr.report import write_report
    from fedbip_flwr.server import RunFolder
    from fedbip_tools.judges import judge_run, load_judges, write_fidelity

    try:
        if args.judges is not None:
            folder = RunFolder(args.run_dir)
            judged = judge_run(folder, load_judges(args.judges), args.judges)
            print(f"wrote {write_fidelity(judged, args.run_dir)}")
        path = write_report(args.run_dir)
    except (OSError, ValueError) as err:
        print(f"fedbip report: no report for '{args.run_dir}': {err}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


def _add_export_concepts(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = subcommands.add_parser(
        "export-concepts",
        help="write a payload's concepts S and V as textual-inversion embeddings for diffusers",
        description="Write each concept of a token-space payload as a diffusers textual-inversion "
        "file (pipe.load_textual_inversion(FILE) on a pipeline of the same base model) and an "
        "index, concepts.json. Exit status 0: written; 1: invalid payload or hidden-space "
        "concepts.",
    )
    export.add_argument("payload", type=Path, help="payload file (.safetensors)")
    export.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="folder to write into")
    export.set_defaults(func=_run_export_concepts)


def _run_export_concepts(args: argparse.Namespace) -> int:
    """One line per token written, then a prompt that uses them."""
    from fedbip_flwr.payload import load_payload
    from fedbip_tools.textual_inversion import ExportError, example_prompt, export_concepts

    try:
        payload = load_payload(args.payload)
        exported = export_concepts(payload, args.out_dir)
    except (PayloadError, ExportError, OSError) as err:
        print(f"fedbip export-concepts: {err}", file=sys.stderr)
        return 1
    print(f"base model: {payload.meta.base_model}")
    width = max(len(concept.token) for concept in exported)
    for concept in exported:
        vectors = f"{concept.vectors} vector{'s' if concept.vectors > 1 else ''}"
        where = args.out_dir / concept.file
        print(f"{concept.token:<{width}}  {concept.kind} '{concept.name}', {vectors}: {where}")
    print(f"example prompt: {example_prompt(payload)}")
    return 0


def _add_shapes_folder(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    folder = subcommands.add_parser(
        "shapes-folder",
        help="write one client's images of the built-in world as an institution's image folder",
        description="Write OUT/train/<class>/*.png (one client's k shots of DOMAIN) and "
        "OUT/test/<class>/*.png (held-out images): an institution's folder for dataset "
        "imagefolder, made from the built-in shapes world for demos and tests.",
    )
    folder.add_argument("domain", choices=shapes.DOMAINS, help="visual domain")
    folder.add_argument("out", type=Path, metavar="OUT", help="folder to write into")
    folder.add_argument(
        "--shots", type=_int_from(1), default=16, help="training images per class (%(default)s)"
    )
    folder.add_argument(
        "--test-per-class",
        type=_int_from(1),
        default=50,
        help="held-out images per class (%(default)s)",
    )
    folder.add_argument(
        "--client-index",
        type=_int_from(0),
        default=0,
        help="which client of the domain (%(default)s)",
    )
    folder.add_argument("--seed", type=_int_from(0), default=0, help="world seed (%(default)s)")
    folder.add_argument(
        "--size",
        type=_int_from(16),
        default=64,
        help="image side in pixels, 16 or more (%(default)s)",
    )
    folder.set_defaults(func=_run_shapes_folder)


def _int_from(low: int):
    """An argparse type: an integer >= ``low``, refused with the flag's name otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def _run_shapes_folder(args: argparse.Namespace) -> int:
    try:
        root = shapes.write_image_folder(
            args.out,
            args.domain,
            args.shots,
            args.test_per_class,
            args.client_index,
            args.seed,
            args.size,
        )
    except OSError as err:
        print(
            f"fedbip shapes-folder: cannot write '{args.out}': {err.strerror or err}",
            file=sys.stderr,
        )
        return 1
    print(f"wrote {root}/train and {root}/test; classes: {','.join(shapes.CLASSES)}")
    return 0


def _add_personalize(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    personalize = subcommands.add_parser(
        "personalize",
        help="compute an institution's upload offline from its own image folder",
        description="Run exactly what this institution's ClientApp would run on the one train "
        "message, without any network: read DATA_ROOT (<class>/<image>, or train/ and test/ "
        "above them), personalize the run's base model, and write the payload to --out for "
        "`fedbip inspect`. The run config must be the federation's: this project's "
        "[tool.flwr.app.config] defaults, overridden by --run-config (a TOML file or "
        "'key=value ...', as `flwr run` takes it).",
    )
    personalize.add_argument(
        "data_root", type=Path, metavar="DATA_ROOT", help="the institution's image folder"
    )
    personalize.add_argument(
        "--domain", required=True, help="the words S starts from, e.g. 'dermatoscopic image'"
    )
    personalize.add_argument(
        "--client-id", required=True, help="the name the institution uploads under"
    )
    personalize.add_argument(
        "--out", type=Path, required=True, help="payload file to write (.safetensors)"
    )
    personalize.add_argument(
        "--run-config", action="append", help="the federation's run config (TOML file or 'k=v ...')"
    )
    personalize.add_argument(
        "--seed", type=int, help="this institution's own seed (default: OS entropy)"
    )
    personalize.add_argument("--model", help="this institution's copy of the base model")
    personalize.add_argument("--device", choices=("auto", "cpu", "cuda"), help="where to run")
    personalize.add_argument(
        "--bad-images",
        choices=("fail", "skip"),
        help="an unreadable image file fails the job, naming every one (fail, the default), or "
        "is left out and listed in a warning (skip); node config bad-images",
    )
    personalize.set_defaults(func=_run_personalize)


def _run_personalize(args: argparse.Namespace) -> int:
    """Write the payload and say how to audit it; one line on stderr for a bad config or folder."""
    import click
    from flwr.common.config import parse_config_args

    from fedbip_flwr.config import ConfigError, FedBiPConfig, NodeConfig
    from fedbip_flwr.ldm import ModelLoadError, load_for_run, select_device
    from fedbip_flwr.methods import institution_upload
    from fedbip_flwr.partitions import DataError
    from fedbip_flwr.results import SENT_IMAGES, SENT_SKIPPED
    from fedbip_flwr.storage import atomic_write

    node_values = {
        "data-root": str(args.data_root.resolve()),
        "domain": args.domain,
        "client-id": args.client_id,
        "seed": args.seed,
        "model": args.model,
        "device": args.device,
        "bad-images": args.bad_images,
    }
    try:
        node = NodeConfig.from_flat({k: v for k, v in node_values.items() if v is not None})
        run = {**project_run_config(), **parse_config_args(args.run_config)}
        cfg = FedBiPConfig.from_flat({**run, **node.run_overrides()})
        ldm = functools.partial(
            load_for_run, cfg.ldm.model, cfg.ldm.device, cfg.ldm.half_precision, cfg.data.image_size
        )
        blob, metrics = institution_upload(cfg, node, ldm, select_device(cfg.ldm.device))
        atomic_write(args.out, blob)
    except (ConfigError, DataError, ModelLoadError, OSError, ValueError) as err:
        print(f"fedbip personalize: {err}", file=sys.stderr)
        return 1
    except click.ClickException as err:  # Flower's parser of --run-config 'k=v ...'
        print(f"fedbip personalize: --run-config: {err.format_message()}", file=sys.stderr)
        return 1
    skipped = metrics[SENT_SKIPPED]
    left_out = f" ({skipped} unreadable files left out)" if skipped else ""
    print(
        f"wrote {args.out}: {len(blob)} bytes, {metrics[SENT_IMAGES]} images of "
        f"'{args.client_id}'{left_out}; audit it with: fedbip inspect {args.out}"
    )
    return 0


def _add_benchmark(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = subcommands.add_parser(
        "benchmark",
        help="every method side by side through flwr run (accuracy, bytes, time, fidelity)",
        description="Run each method variant as a real flwr simulation on the shapes world "
        "for each seed, with one classifier budget for all; cache results per seed under "
        "OUT/methods/, then write OUT/methods.json, the methods section of docs/benchmarks/methods.md and pictures. "
        "Seeds can run as separate processes; --report-only rebuilds the tables. Relative "
        "--work and --out are under the project checkout (next to docs/), wherever "
        "the command is run from.",
    )
    bench.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    bench.add_argument(
        "--variants", default="", help="comma-separated rows by name (default: the headline rows)"
    )
    bench.add_argument("--steps", type=int, default=300, help="SGD steps of every classifier")
    bench.add_argument("--threads", type=int, default=2, help="torch threads per process")
    bench.add_argument(
        "--work",
        type=Path,
        default=Path("outputs/benchmark"),
        help="run folders (large: synthetic shards)",
    )
    bench.add_argument(
        "--out", type=Path, default=Path("benchmarks"), help="methods.json and pictures"
    )
    bench.add_argument("--report-only", action="store_true")
    bench.add_argument(
        "--mix-machine-kinds",
        action="store_true",
        help="average a row over seeds of different machine kinds (the table says so)",
    )
    bench.add_argument(
        "--remeasure",
        action="store_true",
        help="measure cached rows again from their run folders (new columns, no new run)",
    )
    bench.set_defaults(func=_run_benchmark)


def _run_benchmark(args: argparse.Namespace) -> int:
    from fedbip_flwr.logs import setup_logging
    from fedbip_flwr.paths import project_dir
    from fedbip_tools import benchmark, provenance

    setup_logging()
    root = project_dir() or Path.cwd()
    bench = benchmark.Bench(
        benchmark.Settings(classifier_steps=args.steps),
        work=(root / args.work).resolve(),
        results=(root / args.out).resolve(),
        threads=args.threads,
    )
    names = [n.strip() for n in args.variants.split(",") if n.strip()] or list(benchmark.HEADLINE)
    if not args.report_only:
        benchmark.run(bench, args.seeds, names, remeasure=args.remeasure)
    command = shlex.join(["fedbip", "benchmark", *sys.argv[2:]])  # quoted: row names have spaces
    try:
        summary = benchmark.report(
            bench,
            command.replace(" --report-only", ""),
            root / "docs" / "benchmarks" / "methods.md",
            mix_machine_kinds=args.mix_machine_kinds,
        )
    except provenance.MixedMachineKinds as err:
        print(f"fedbip benchmark: {err}", file=sys.stderr)
        return 1
    for line in benchmark.console_lines(summary):
        print(line)
    return 0


def _add_world_check(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    world = subcommands.add_parser(
        "world-check",
        help="does the shapes world separate the methods as DomainNet does? (its contract)",
        description="Measure the miniature world's contract (fedbip_tools/world.py: headroom, "
        "the gap hurting a source-only classifier, text not drawing the rare domains, learned "
        "concepts drawing them, every domain learnable) at the methods benchmark's budget, "
        "both classifier starts, and write OUT. Central's and Prompts-only's rows come from "
        "the benchmark's cache (made where missing). Exit status 0 only if every clause holds.",
    )
    world.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    world.add_argument("--threads", type=int, default=2, help="torch threads per process")
    world.add_argument("--work", type=Path, default=Path("outputs/benchmark"))
    world.add_argument("--results", type=Path, default=Path("benchmarks"))
    world.add_argument("--out", type=Path, default=Path("benchmarks/world.json"))
    world.add_argument(
        "--page",
        type=Path,
        default=Path("docs/benchmarks/world.md"),
        help="the page whose world section gets the contract's table",
    )
    world.set_defaults(func=_run_world_check)


def _run_world_check(args: argparse.Namespace) -> int:
    from fedbip_flwr.logs import setup_logging
    from fedbip_flwr.paths import project_dir
    from fedbip_tools import benchmark, world
    from fedbip_tools.judges import load_judges

    setup_logging()
    torch.set_num_threads(args.threads)
    root = project_dir() or Path.cwd()
    bench = benchmark.Bench(
        benchmark.Settings(),
        work=(root / args.work).resolve(),
        results=(root / args.results).resolve(),
        threads=args.threads,
    )
    judges = load_judges(bench.work / "judges.safetensors")
    command = shlex.join(["fedbip", "world-check", *sys.argv[2:]])
    out = (root / args.out).resolve()
    found, record = world.check(bench, args.seeds, out, command, judges)
    benchmark.write_section((root / args.page).resolve(), world.markdown(record), world.MARKER)
    for line in world.lines(found):
        print(line)
    return 0 if all(c.holds for c in found) else 1


def _add_synthesize(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    synthesize = subcommands.add_parser(
        "synthesize",
        help="make a run's training set (its shards) for a ServerApp run with synthesis external",
        description="Make the training-set shards of RUN_DIR from its config.json and persisted "
        "uploads (validated as the server does), as the ServerApp would. Launched by "
        "`accelerate launch --num_processes N -m fedbip_tools.cli synthesize RUN_DIR`, the N "
        "processes (on one machine or several over a shared RUN_DIR) split the work balanced "
        "by image count, each on its own GPU. Shards already there are kept, so a rerun after "
        "a crash makes only what is missing (docs/scale.md). Exit status 0: every shard is on "
        "disk; 1: not a finished round, no accepted upload, or a bad config or upload.",
    )
    synthesize.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="the ServerApp's run folder"
    )
    synthesize.set_defaults(func=_run_synthesize)


def _run_synthesize(args: argparse.Namespace) -> int:
    """This process's share of the run's work units; the main process reports the whole."""
    from fedbip_flwr import distributed
    from fedbip_flwr.config import ConfigError
    from fedbip_flwr.ldm import ModelLoadError
    from fedbip_flwr.logs import setup_logging
    from fedbip_flwr.server import RunFolder

    setup_logging()
    folder = RunFolder(args.run_dir)
    try:
        cfg = distributed.read_run_config(folder)
        state = distributed.process_state(cfg.ldm)
        run = distributed.open_run(folder, cfg, state.device)
        if not run.uploads:
            raise distributed.RunNotReady(
                f"{folder.root} holds no accepted upload: nothing to synthesize"
            )
        distributed.synthesize_share(run, state)
        if not state.is_main_process:
            return 0
        units = run.units()
        missing = run.pending(units)
    except (ConfigError, PayloadError, ModelLoadError, distributed.RunNotReady, OSError) as err:
        print(f"fedbip synthesize: {err}", file=sys.stderr)
        return 1
    if missing:
        print(
            f"fedbip synthesize: {len(missing)} of {len(units)} unit(s) still missing in "
            f"{folder.shards}",
            file=sys.stderr,
        )
        return 1
    print(
        f"{len(units)} unit(s), {sum(u.images for u in units)} image(s): every shard of "
        f"{folder.root} is on disk ({state.num_processes} process(es))"
    )
    return 0


def project_run_config() -> dict[str, Any]:
    """This project's run-config defaults ([tool.flwr.app.config] of its pyproject.toml), its
    tables as Flower hands them over (dotted keys)."""
    from flwr.common.config import flatten_dict, get_project_config

    from fedbip_flwr.paths import project_dir

    folder = project_dir() or Path.cwd()
    return flatten_dict(get_project_config(folder)["tool"]["flwr"]["app"]["config"])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedbip`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["speed"]:  # its own parser: it also parses its child processes' arguments
        from fedbip_tools import speed

        speed.main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())

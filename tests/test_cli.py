"""``fedbip inspect``: audit output for a valid payload, one clean line and exit 1 otherwise.

The real command runs in subprocesses (as a user would run it); they are started together
because each one pays the torch import on its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch

from fedbip_flwr import shapes
from fedbip_flwr.payload import encode_payload
from fedbip_tools.cli import main, project_run_config
from tests.helpers import (
    ACCEPTED,
    ROOT,
    N,
    completed_metrics,
    make_meta,
    make_payload,
    meta_strings,
    raw_blob,
    run_folder,
    save_payload,
    with_header,
)

REPO = Path(__file__).resolve().parents[1]


def _truncated() -> bytes:
    blob = encode_payload(make_payload())
    return blob[: len(blob) // 2]


# name -> (bytes to write, or None for a missing file; text expected on stderr)
INVALID: dict[str, tuple[Callable[[], bytes] | None, str]] = {
    "truncated": (_truncated, "invalid payload: tensor data ends"),
    "garbage": (
        lambda: b"\x89PNG\r\n\x1a\n" + bytes(range(256)),
        "invalid payload: declared header",
    ),
    "missing file": (None, "No such file or directory"),
}
# Checked in-process through main(): same handler, without paying a torch import per case.
INVALID_IN_PROCESS: dict[str, tuple[Callable[[], bytes], str]] = {
    "nan latents": (
        lambda: raw_blob(latents=torch.full((N, 4, 8, 8), float("nan"))),
        "invalid payload: latents contain NaN or Inf",
    ),
    "header is a list": (lambda: with_header([1, 2]), "invalid payload: header is a JSON array"),
    "wrong schema version": (
        lambda: raw_blob(meta_strings(schema_version=2)),
        "invalid payload: schema version 2",
    ),
    "empty": (lambda: b"", "invalid payload: only 0 bytes"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Run ``python -m fedbip_tools.cli inspect`` once per case, all processes concurrently."""
    folder = tmp_path_factory.mktemp("cli")
    paths = {"valid": save_payload(make_payload(), folder / "valid.safetensors")}
    for name, (build, _) in INVALID.items():
        paths[name] = folder / f"{name.replace(' ', '-')}.safetensors"
        if build is not None:
            paths[name].write_bytes(build())
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "fedbip_tools.cli", "inspect", str(path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, path in paths.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def test_inspect_valid_payload_prints_metadata_and_tensors(
    runs: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    result = runs["valid"]
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "client_id: partition-0" in lines
    assert "domain: sketch" in lines
    assert "timestep: 981" in lines
    assert 'class_names: ["cat", "dog", "fish"]' in lines
    assert "latent_shape: [4, 8, 8]" in lines
    head = next(
        i
        for i, line in enumerate(lines)
        if line.split() == ["name", "shape", "dtype", "mean", "std"]
    )
    table = {line.split()[0]: line for line in lines[head + 1 : head + 5]}
    record = lines[head + 6 : head + 13]  # what an institution records of it (upload_record)
    assert record[0].startswith("upload: fedbip from partition-0, ")
    assert record[1:] == [
        "kinds: concepts, counts, latents",
        "DP guarantee: none",
        "the server's membership test, as measured (4x8x8; AUC 0.5 = chance):",
        "  concepts: no record at this latent size and guarantee",
        "  counts: no record at this latent size and guarantee",
        "  latents: no record at this latent size and guarantee",
    ]
    assert lines[head + 13 :] == [
        "",
        "verdict: structure valid; not checked against a run's base model and "
        "plausibility bounds (give the federation's --run-config for the server's verdict)",
    ]
    assert list(table) == ["latents", "labels", "domain_concept", "class_concepts"]
    assert "[6, 4, 8, 8]" in table["latents"] and "float32" in table["latents"]
    assert "int64" in table["labels"]


@pytest.mark.parametrize("case", INVALID, ids=list(INVALID))
def test_inspect_invalid_input_exits_1_without_traceback(
    runs: dict[str, subprocess.CompletedProcess[str]], case: str
) -> None:
    result = runs[case]
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert INVALID[case][1] in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


@pytest.mark.parametrize("case", INVALID_IN_PROCESS, ids=list(INVALID_IN_PROCESS))
def test_inspect_reports_reason_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    build, reason = INVALID_IN_PROCESS[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(build())
    assert main(["inspect", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [captured.err.strip()]
    assert captured.err.startswith(reason)


def test_inspect_in_process_respects_max_mb(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = save_payload(make_payload(latent_dtype="float16"), tmp_path / "p.safetensors")
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "latent_dtype: float16" in out
    assert "n_s: 1" in out.splitlines()
    assert main(["inspect", str(path), "--max-mb", "0.001"]) == 1
    assert capsys.readouterr().err.endswith("above --max-mb 0.001 (1048 bytes)\n")  # the CLI's knob


# Seconds each to import: what only personalizing, synthesis, training or reports use.
SLOW_IMPORTS = (
    "diffusers",
    "transformers",
    "torchvision",
    "sklearn",
    "dp_accounting",
    "accelerate",
    "matplotlib",
)
IMPORT_AUDIT = """
import contextlib, io, json, sys
loaded = lambda: sorted(set(sys.argv[2:]) & set(sys.modules))
import fedbip_tools.cli as cli
found = {"import": loaded()}
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    cli.main(["--help"])
found["--help"] = loaded()
with contextlib.redirect_stdout(io.StringIO()):
    found["status"] = cli.main(["inspect", sys.argv[1]])
found["inspect"] = loaded()
print(json.dumps(found))
"""


def test_help_and_inspect_import_no_model_library(tmp_path: Path) -> None:
    """``fedbip --help`` and ``fedbip inspect`` answer in about torch's import time: neither
    they nor importing the CLI load the LDM's libraries or another slow one (a fresh process,
    as a user runs them)."""
    path = save_payload(make_payload(), tmp_path / "p.safetensors")
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_AUDIT, str(path), *SLOW_IMPORTS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"import": [], "--help": [], "status": 0, "inspect": []}


def test_cli_requires_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "inspect" in capsys.readouterr().err


def test_report_rebuilds_report_md(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = run_folder(tmp_path / "run-1", completed_metrics(), grids=list(ACCEPTED))
    assert main(["report", str(folder)]) == 0
    assert capsys.readouterr().out == f"wrote {folder / 'report.md'}\n"
    report = (folder / "report.md").read_text()
    assert all(f"grid-{client_id}.png" in report.replace("%20", " ") for client_id in ACCEPTED)


def test_report_without_metrics_exits_1_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"fedbip report: no report for '{tmp_path}': ")
    assert "metrics.json" in captured.err
    assert len(captured.err.splitlines()) == 1


def test_export_concepts_writes_one_diffusers_file_per_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    payload = make_payload()  # n_s = 1, n_v = 2, classes cat, dog, fish
    path = save_payload(payload, tmp_path / "p.safetensors")
    out = tmp_path / "concepts"
    assert main(["export-concepts", str(path), str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"base model: {payload.meta.base_model}"
    assert lines[1] == f"<sketch>  domain 'sketch', 1 vector: {out / 'domain-sketch.safetensors'}"
    assert lines[3] == f"<dog>     class 'dog', 2 vectors: {out / 'class-dog.safetensors'}"
    assert lines[-1] == "example prompt: a <sketch> style of a <cat>"

    expected = {"domain-sketch": ("<sketch>", payload.domain_concept)}
    for i, name in enumerate(["cat", "dog", "fish"]):
        expected[f"class-{name}"] = (f"<{name}>", payload.class_concepts[i])
    for name, (token, vectors) in expected.items():
        tensors = safetensors.torch.load_file(str(out / f"{name}.safetensors"))
        assert list(tensors) == [token]
        assert torch.equal(tensors[token], vectors)
    index = json.loads((out / "concepts.json").read_text())
    assert [c["token"] for c in index["concepts"]] == ["<sketch>", "<cat>", "<dog>", "<fish>"]
    assert index["base_model"] == payload.meta.base_model


def test_export_concepts_refuses_hidden_space_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hidden = dataclasses.replace(make_payload(), meta=make_meta(concept_space="hidden"))
    path = save_payload(hidden, tmp_path / "hidden.safetensors")
    assert main(["export-concepts", str(path), str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert 'concept-space = "token"' in captured.err
    assert len(captured.err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_personalize_writes_what_inspect_and_the_server_accept(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """An institution computes and audits its upload offline, through the ClientApp's own path."""
    from fedbip_flwr import shapes
    from fedbip_flwr.config import FedBiPConfig
    from fedbip_flwr.expectations import expectations
    from fedbip_flwr.ldm import load_ldm
    from fedbip_flwr.payload import decode_payload

    data = shapes.write_image_folder(tmp_path / "data", "quickdraw", 2, 1, size=32)
    run_config = (
        f'data.dataset="imagefolder" data.classes="{",".join(shapes.CLASSES)}" '
        f'ldm.model="{tiny_model_dir}" data.image-size=32 fedbip.concept-epochs=1 '
        "synthesis.num-inference-steps=4"
    )
    out = tmp_path / "upload.safetensors"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedbip_tools.cli",
            "personalize",
            str(data),
            "--domain",
            "quickdraw",
            "--client-id",
            "lab-b",
            "--out",
            str(out),
            "--run-config",
            run_config,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    assert f"fedbip inspect {out}" in made.stdout
    inspected = subprocess.run(
        [sys.executable, "-m", "fedbip_tools.cli", "inspect", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert inspected.returncode == 0 and "client_id: lab-b" in inspected.stdout
    cfg = FedBiPConfig.from_flat(
        {
            **project_run_config(),
            "data.dataset": "imagefolder",
            "data.classes": ",".join(shapes.CLASSES),
            "ldm.model": str(tiny_model_dir),
            "data.image-size": 32,
            "fedbip.concept-epochs": 1,
            "synthesis.num-inference-steps": 4,
        }
    )
    ldm, fedbip = load_ldm(tiny_model_dir), cfg.settings_of("fedbip")
    payload = decode_payload(out.read_bytes(), expectations(cfg, ldm, cfg.data.class_list, fedbip))
    # 12 images, each as the federation's latents-per-image independent z(T) (default 2)
    assert (payload.meta.domain, payload.meta.num_examples) == (
        "quickdraw",
        12 * fedbip.latents_per_image,
    )
    assert fedbip.latents_per_image == 2


def test_personalize_with_a_bad_folder_says_why_in_one_line(tmp_path: Path) -> None:
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedbip_tools.cli",
            "personalize",
            str(tmp_path / "missing"),
            "--domain",
            "sketch",
            "--client-id",
            "lab",
            "--out",
            str(tmp_path / "x.safetensors"),
            "--run-config",
            'data.dataset="imagefolder" data.classes="a,b"',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert made.returncode == 1
    last = made.stderr.strip().splitlines()[-1]
    assert last.startswith("fedbip personalize: ") and "is not a folder" in last
    assert not (tmp_path / "x.safetensors").exists()


def test_inspect_stops_reading_a_stream_once_it_passes_the_cap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pipe (or device) has no size to check first: the reader must stop at the cap, not
    hold everything the other end sends."""
    fifo = tmp_path / "upload.safetensors"
    os.mkfifo(fifo)
    sent: list[int] = []

    def send_64_mb() -> None:
        try:
            with open(fifo, "wb") as stream:
                for _ in range(64):
                    stream.write(bytes(2**20))
                    sent.append(1)
        except BrokenPipeError:
            pass

    writer = threading.Thread(target=send_64_mb)
    writer.start()
    assert main(["inspect", str(fifo), "--max-mb", "1"]) == 1
    writer.join(timeout=60)
    assert not writer.is_alive() and len(sent) < 64
    assert capsys.readouterr().err == (
        "invalid payload: payload is more than 1048576 bytes, above --max-mb 1 (1048576 bytes)\n"
    )


def _one_line_error(capsys: pytest.CaptureFixture[str], prefix: str) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.startswith(prefix) and len(captured.err.splitlines()) == 1, captured.err
    return captured.err


@pytest.mark.parametrize(
    ("config", "reason"),
    [("{bad", "is not JSON"), ("[1, 2]", "holds a list, not a run config")],
    ids=["not json", "a list"],
)
def test_synthesize_refuses_a_broken_config_json_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str, reason: str
) -> None:
    (tmp_path / "config.json").write_text(config)
    (tmp_path / "clients.json").write_text("{}")
    assert main(["synthesize", str(tmp_path)]) == 1
    assert reason in _one_line_error(capsys, "fedbip synthesize: ")


@pytest.mark.parametrize("metrics", [{"accuracy": 0.5}, {"clients": [1]}, {"seconds": [1]}])
def test_report_refuses_metrics_of_another_shape_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], metrics: dict
) -> None:
    folder = run_folder(tmp_path / "run", metrics, grids=[])
    assert main(["report", str(folder)]) == 1
    error = _one_line_error(capsys, f"fedbip report: no report for '{folder}'")
    assert f"{folder / 'metrics.json'} does not hold a run's results: " in error


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--shots", "0"),
        ("--test-per-class", "-2"),
        ("--client-index", "-1"),
        ("--seed", "x"),
        ("--size", "0"),
    ],
)
def test_shapes_folder_names_the_bad_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["shapes-folder", "sketch", str(tmp_path / "out"), flag, value])
    assert info.value.code == 2
    assert f"argument {flag}: must be an integer >= " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_shapes_folder_into_a_file_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "taken").write_text("")
    assert (
        main(
            [
                "shapes-folder",
                "sketch",
                str(tmp_path / "taken"),
                "--shots",
                "1",
                "--test-per-class",
                "1",
                "--size",
                "16",
            ]
        )
        == 1
    )
    assert "Not a directory" in _one_line_error(capsys, "fedbip shapes-folder: cannot write ")


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (
            ["--run-config", "data.dataset=imagefolder"],
            "--run-config: The provided configuration string",
        ),
        (["--model", "/nonexistent/model"], "does not exist"),
    ],
    ids=["unquoted run config", "missing model"],
)
def test_personalize_refuses_a_bad_run_config_or_model_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], reason: str
) -> None:
    data = shapes.write_image_folder(tmp_path / "lab", "sketch", 1, 1, size=16)
    classes = ",".join(shapes.CLASSES)
    command = [
        "personalize",
        str(data),
        "--domain",
        "sketch",
        "--client-id",
        "lab",
        "--out",
        str(tmp_path / "x.safetensors"),
        "--run-config",
        f'data.dataset="imagefolder" data.classes="{classes}"',
        *extra,
    ]
    assert main(command) == 1
    assert reason in _one_line_error(capsys, "fedbip personalize: ")
    assert not (tmp_path / "x.safetensors").exists()


def test_synthesize_with_no_accepted_upload_says_there_is_nothing_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A round whose every upload was refused is not 'every shard on disk'."""
    from fedbip_flwr.config import FedBiPConfig

    (tmp_path / "config.json").write_text(
        json.dumps(FedBiPConfig.from_flat(project_run_config()).to_flat())
    )
    (tmp_path / "clients.json").write_text("{}")
    assert main(["synthesize", str(tmp_path)]) == 1
    assert "holds no accepted upload" in _one_line_error(capsys, "fedbip synthesize: ")

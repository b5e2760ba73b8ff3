"""scripts/gpu_check.sh and its summary, without a GPU: the stage selection and time budget,
and summary.md read from real results (the H200 and H100 runs' records and a CPU speed run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from fedbip_tools import speed
from tests.helpers import script

ROOT = Path(__file__).resolve().parents[1]
gpu_summary = script("gpu_summary")


def test_only_the_named_stages_run_and_a_summary_is_written(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_ONLY": "no-such-stage",
        "GPU_CHECK_BUDGET_S": "60",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = (out / "gpu_check.log").read_text()
    assert "== done in" in log and "== cuda-tests" not in log and "== sd-proof" not in log
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# GPU check") and "- none ran" in summary


def test_a_stage_past_the_budget_is_skipped_with_a_line(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_ONLY": "build-sd",
        "GPU_CHECK_BUDGET_S": "10",
    }
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "== build-sd: skipped" in (out / "gpu_check.log").read_text()


def test_the_summary_shows_the_tests_the_federation_and_the_speed_tables(tmp_path, tiny_model_dir):
    (tmp_path / "gpu_check.log").write_text(
        "NVIDIA H200, 143771 MiB, 580.159.04\n== cuda-tests: exit 0 after 40s\n"
        "7 passed in 23.86s\n== sd-proof: exit 0 after 92s\n"
    )
    shutil.copy(ROOT / "benchmarks" / "sd_gpu_proof.json", tmp_path / "sd_gpu_proof.json")
    shutil.copy(
        ROOT / "benchmarks" / "sd_gpu_simulation_h100.json", tmp_path / "sd_gpu_simulation.json"
    )
    args = speed.parse(
        [f"--model={tiny_model_dir}", "--cases=matmul", "--repeats=1", "--threads=1"]
    )
    (tmp_path / "speed_float32.json").write_text(json.dumps(speed.measure(args), default=str))
    text = gpu_summary.summary(tmp_path)
    assert "CUDA tests (`pytest -m cuda tests/test_cuda.py`): 7 passed." in text
    assert "- cuda-tests: exit 0 after 40s" in text and "- sd-proof: exit 0 after 92s" in text
    assert "Status `finished:completed` in 79.0 s" in text
    assert "| server: synthesis | 5.4 |" in text and "latents [12, 4, 64, 64]" in text
    assert "peaked at 8,899 MB over the run" in text
    simulated = text.split("in Flower's simulation", 1)[1]  # the Ray run: phases as recorded
    assert (
        "Status `finished:completed` in 103.0 s" in simulated
        and "| server: synthesis | 17.1 | |" in simulated
    )
    assert (
        "| sketch-0: whole client step | 12.7 | |" in simulated
        and "peaked at 39,966 MB" in simulated
    )
    assert "## Speed (speed_float32)" in text and "Matmul peak here (2048 x 2048)" in text

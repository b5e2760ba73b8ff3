"""The benchmark's own arithmetic: distances, mean +- std over seeds, the BENCHMARKS.md section."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark_miniature.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_miniature", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmark_miniature"] = module
    spec.loader.exec_module(module)
    return module


def test_nearest_real_distance_is_rms_to_the_closest_image(bench):
    real = torch.stack([torch.zeros(3, 4, 4), torch.ones(3, 4, 4)])
    assert bench.nearest_real_distance(real.clone(), real) == pytest.approx(0.0, abs=1e-6)
    # 0.25 everywhere is closest to the zero image, at RMS 0.25; 0.9 is 0.1 from the ones image
    synthetic = torch.stack([torch.full((3, 4, 4), 0.25), torch.full((3, 4, 4), 0.9)])
    assert bench.nearest_real_distance(synthetic, real) == pytest.approx((0.25 + 0.1) / 2, abs=1e-5)


def test_summary_is_mean_and_sample_std_over_seeds(bench):
    runs = {
        0: {"A": {"per_domain": {"x": 0.5, "y": 0.7}, "mia_gap": {"loss": 0.2, "entropy": 0.1}}},
        1: {"A": {"per_domain": {"x": 0.7, "y": 0.9}, "mia_gap": {"loss": 0.4, "entropy": 0.3}}},
        2: {"B": {"per_domain": {"x": 0.1, "y": 0.3}}},
    }
    summary = bench.summarize(runs)["methods"]
    a = summary["A"]
    assert a["seeds"] == [0, 1]
    assert a["per_domain"] == pytest.approx({"x": 0.6, "y": 0.8})
    assert a["mean"] == pytest.approx(0.7)
    assert a["std"] == pytest.approx(math.sqrt(((0.6 - 0.7) ** 2 + (0.8 - 0.7) ** 2) / 1))
    assert a["mia_gap"] == pytest.approx({"loss": 0.3, "entropy": 0.2})
    assert a["mia_gap_std"] == pytest.approx({"loss": math.sqrt(0.02), "entropy": math.sqrt(0.02)})
    assert summary["B"]["std"] == 0.0 and summary["B"]["seeds"] == [2]


def test_report_section_replaced_in_place(bench, tmp_path):
    report = tmp_path / "BENCHMARKS.md"
    report.write_text("# Benchmarks\n\nother section\n")
    bench.write_section(report, "first\n")
    bench.write_section(report, "second\n")
    text = report.read_text()
    assert "other section" in text and "second" in text and "first" not in text
    assert text.count("<!-- miniature:start -->") == 1


def test_membership_sets_are_class_balanced(bench):
    # class-sorted like the shapes splits: taking the first n would compare 2 classes against 6
    labels = torch.arange(6).repeat_interleave(50)
    picked = labels[bench.balanced(labels, 96)]
    assert len(picked) == 96
    assert torch.bincount(picked, minlength=6).tolist() == [16] * 6


def test_cache_refuses_results_made_with_other_settings(bench, tmp_path):
    path = tmp_path / "seed-0.json"
    path.write_text('{"settings": {"min_steps": 150}, "results": {"Central": {}}}')
    assert bench.load_cache(path, {"min_steps": 150}) == {"Central": {}}
    with pytest.raises(bench.SettingsMismatch, match="other settings"):
        bench.load_cache(path, {"min_steps": 300})
    assert bench.load_cache(tmp_path / "missing.json", {}) == {}

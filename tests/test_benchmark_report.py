"""The benchmark's own arithmetic: distances, mean +- std over seeds, the BENCHMARKS.md section."""

from __future__ import annotations

import dataclasses
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


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 10, 16])
def test_sgd_steps_counts_the_optimizer_steps_training_makes(bench, n):
    from fedbip_flwr.classifier import TrainSettings, train_classifier

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 6))
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    settings = TrainSettings(3, 0.01, 0.9, batch_size=8, image_size=8, augment=False)
    images, labels = torch.rand(n, 3, 8, 8), torch.arange(n) % 6
    train_classifier(model, images, labels, settings, seed=0)
    assert len(calls) == bench.sgd_steps(settings, n)


def _seed_run(bench, cache: Path):
    from fedbip_flwr.config import FedBiPConfig

    cfg = FedBiPConfig(model="unused", domains="sketch,painting", test_per_class=2)
    settings = bench.Bench(cfg, (0,), 150, 10, 2, (801,), 96)
    return bench.SeedRun(settings, None, 0, cache)


def test_two_processes_share_a_seed_cache_without_losing_results(bench, tmp_path):
    cache = tmp_path / "runs" / "seed-0.json"
    first, second = _seed_run(bench, cache), _seed_run(bench, cache)
    first.record("A", lambda: {"per_domain": {"sketch": 0.1}})
    second.record("B", lambda: {"per_domain": {"sketch": 0.2}})
    second.record("A", lambda: pytest.fail("A was cached by the other process"))
    first.record("C", lambda: {"per_domain": {"sketch": 0.3}})
    on_disk = bench.load_cache(cache, first.bench.settings())
    assert set(on_disk) == {"A", "B", "C"} and on_disk["B"]["per_domain"] == {"sketch": 0.2}


def test_equal_step_baselines_match_fedbip_l(bench, tmp_path):
    run = _seed_run(bench, tmp_path / "seed-0.json")
    n = 10 * sum(len(s.labels) for s in run.clients.values())  # FedBiP-L's synthetic set
    assert run.fedbip_l_steps() == bench.sgd_steps(bench.train_settings(run.bench, n), n)
    per_round = len(run.clients) * 2 * math.ceil(16 * 6 / 64)  # clients x local epochs x batches
    rounds = run.fedavg_equal_rounds()
    assert (rounds - 1) * per_round < run.fedbip_l_steps() <= rounds * per_round


def test_only_runs_the_selected_methods(bench, tmp_path):
    run = _seed_run(bench, tmp_path / "seed-0.json")
    run.only = frozenset({"B"})
    run.record("A", lambda: pytest.fail("A was not selected"))
    run.record("B", lambda: {"per_domain": {"sketch": 0.2}})
    assert set(bench.load_cache(run.cache, run.bench.settings())) == {"B"}


def test_privacy_table_lists_baselines_then_fedbip_then_t_from_late_to_early(bench):
    methods = {
        "FedBiP-S T<=601": {"T": 601},
        "FedBiP-L": {"T": 961},
        "FedBiP-S T<=801": {"T": 801},
        bench.FEDAVG_EQUAL: {},
        "Prompts-only": {},
        "FedAvg": {},
        "Local": {},
    }
    assert bench.privacy_rows(methods) == [
        "FedAvg",
        bench.FEDAVG_EQUAL,
        "Prompts-only",
        "FedBiP-L",
        "FedBiP-S T<=801",
        "FedBiP-S T<=601",
    ]


def test_real_data_baselines_survive_a_change_of_generative_settings(bench, tmp_path):
    cache = tmp_path / "runs" / "seed-0.json"
    run = _seed_run(bench, cache)
    run.record("Central", lambda: {"per_domain": {"sketch": 0.9}})
    run.record("Prompts-only", lambda: {"per_domain": {"sketch": 0.4}})
    assert set(bench.cached_runs(tmp_path, run.bench)[0]) == {"Central", "Prompts-only"}

    cfg = run.bench.cfg.model_copy(update={"prompt_template": "{S} {V}"})
    other_prompt = dataclasses.replace(run.bench, cfg=cfg)
    with pytest.raises(bench.SettingsMismatch, match="seed-0.json"):  # never mixed silently
        bench.SeedRun(other_prompt, None, 0, cache)
    cache.unlink()  # start the synthesizing methods over; the real-data file stays
    rerun = bench.SeedRun(other_prompt, None, 0, cache)
    assert not rerun.wanted("Central") and rerun.wanted("Prompts-only")
    assert set(bench.cached_runs(tmp_path, other_prompt)[0]) == {"Central"}

    more_steps = dataclasses.replace(run.bench, min_steps=300)  # the baselines read this one
    with pytest.raises(bench.SettingsMismatch, match="seed-0-real.json"):
        bench.SeedRun(more_steps, None, 0, cache)


def test_concept_only_starts_every_image_from_its_own_noise(bench, tmp_path):
    from test_payload import make_payload

    run = _seed_run(bench, tmp_path / "seed-0.json")
    uploaded = make_payload(seed=7)  # not the noise seed: its draws would equal the fresh ones
    run.__dict__["payloads"] = {"sketch-0": uploaded, "painting-0": make_payload(seed=1)}
    fresh = run.fresh_noise()["sketch-0"]
    m = run.bench.cfg.multiplier
    assert fresh.labels.tolist() == uploaded.labels.repeat(m).tolist()
    assert fresh.latents.shape == (m * len(uploaded.labels), *uploaded.latents.shape[1:])
    flat = fresh.latents.flatten(1)
    assert len(torch.unique(flat, dim=0)) == len(flat)  # no start shared by two images
    assert not torch.equal(fresh.latents[: len(uploaded.labels)], uploaded.latents)
    assert torch.equal(fresh.domain_concept, uploaded.domain_concept)
    assert abs(float(flat.std()) - 1.0) < 0.1


def test_judges_are_trained_once_then_loaded_and_judge_by_argmax(bench, tmp_path):
    path = tmp_path / "judges.safetensors"
    trained = bench.load_judges(path, size=16, per_class=1, epochs=1)
    loaded = bench.load_judges(path, size=16, per_class=1, epochs=1)
    for a, b in ((trained.classes, loaded.classes), (trained.domains, loaded.domains)):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(x, y), name
    sketches = bench.shapes.test_set("sketch", 2, seed=5, size=16)
    score = loaded.fidelity(sketches.images, sketches.labels, "sketch")
    with torch.no_grad():
        classes = loaded.classes(sketches.images).argmax(-1)
        domains = loaded.domains(sketches.images).argmax(-1)
    assert score["class"] == pytest.approx(float((classes == sketches.labels).float().mean()))
    sketch = bench.shapes.DOMAINS.index("sketch")
    assert score["domain"] == pytest.approx(float((domains == sketch).float().mean()))


def test_fidelity_is_averaged_over_seeds_and_tabulated(bench):
    def result(c: float, d: float) -> dict:
        return {"per_domain": {"sketch": 0.5}, "fidelity": {"class": {"sketch": c}, "domain": {"sketch": d}}}

    runs = {0: {"instance-only": result(0.8, 0.2)}, 1: {"instance-only": result(0.9, 0.4)}}
    summary = bench.summarize(runs)
    fid = summary["methods"]["instance-only"]["fidelity"]
    assert fid["class"]["sketch"] == pytest.approx(0.85) and fid["domain"]["sketch"] == pytest.approx(0.3)
    summary["judges_on_real"] = {"class": 0.99, "domain": 1.0}
    table = bench.fidelity_table(summary)
    assert "| instance-only | 85 / 30 |" in table and "99.0% (class)" in table

"""The methods benchmark (fedbip_tools/benchmark/): its budget rules, its summary and report,
and one seed of two variants through the real `flwr run`, the second resuming from the first's
uploads as a restarted server would."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
from datetime import datetime
from importlib import metadata

import pytest
import torch

from fedbip_flwr.classifier import batches_per_epoch
from fedbip_flwr.config import FedBiPConfig, earlier_layout
from fedbip_flwr.paths import project_dir
from fedbip_flwr.server import RunFolder
from fedbip_flwr.storage import write_json
from fedbip_tools import benchmark, provenance
from fedbip_tools.benchmark import Bench, Settings, runner
from fedbip_tools.judges import load_judges
from fedbip_tools.machine import this_machine

pytestmark = pytest.mark.long(minutes=1.6)


def test_every_budget_rule_meets_the_global_classifier_budget():
    settings = Settings(classifier_steps=300)
    n = 96  # one client's images: 16 shots x 6 classes
    local = benchmark.local_budget(settings, n)["local.epochs"]
    assert benchmark.fedlmg_budget(settings, n) == {"fedlmg.local-epochs": local}
    assert local * batches_per_epoch(n, 64) >= 300 > (local - 1) * batches_per_epoch(n, 64)
    fedavg = benchmark.fedavg_budget(settings, n)
    per_round = 3 * fedavg["fedavg.local-epochs"] * batches_per_epoch(n, 64)
    assert fedavg["fedavg.rounds"] * per_round >= 300 > (fedavg["fedavg.rounds"] - 1) * per_round


def test_variants_that_reuse_uploads_run_after_their_source():
    chosen = [
        benchmark.variant("FedLMG-SD"),
        benchmark.variant("Central"),
        benchmark.variant("FedLMG-FT"),
    ]
    names = [v.name for v in benchmark.ordered(chosen)]
    assert names == ["FedLMG-FT", "FedLMG-SD", "Central"]
    with pytest.raises(ValueError, match="unknown variant"):
        benchmark.variant("nope")


# Settings().digest() on main before the run config had tables: the key of every cached row
# (benchmarks/methods/seed-0.json), so the move into tables may not change it.
DIGEST_BEFORE_THE_TABLES = "0d8674fbb14b52a3"


def test_the_run_config_in_tables_keeps_the_cached_rows_key():
    assert Settings().digest() == DIGEST_BEFORE_THE_TABLES
    recorded = {
        **dataclasses.asdict(Settings()),
        "run_config": earlier_layout(Settings().run_config),
    }
    assert Settings.recorded(recorded) == Settings()


def test_every_variant_runs_the_config_its_cached_rows_were_made_with(tmp_path):
    """Each variant's run config, written in the flat layout of the cached rows' runs, reads as
    the same config: the tables changed the keys, not what a row runs."""
    bench = Bench(Settings(), work=tmp_path, results=tmp_path)
    for v in benchmark.VARIANTS:
        values = runner.variant_values(bench, v, 0)
        cfg = FedBiPConfig.from_flat(values)
        assert FedBiPConfig.from_recorded(earlier_layout(values)) == cfg, v.name


def test_summary_is_mean_and_sample_std_over_seeds():
    runs = {
        seed: {
            "Central": {
                "per_domain": {"a": acc, "b": 1 - acc},
                "mean": 0.5,
                "upload_bytes": {"x": 10 * seed},
                "mia_gap": {"loss": acc, "entropy": 0.0},
            }
        }
        for seed, acc in ((0, 0.2), (1, 0.4), (2, 0.9))
    }
    entry = benchmark.summarize(runs)["Central"]
    assert entry["seeds"] == [0, 1, 2]
    assert entry["per_domain"]["a"] == pytest.approx(0.5)
    assert entry["per_domain_std"]["a"] == pytest.approx(statistics.stdev([0.2, 0.4, 0.9]))
    assert entry["std"] == 0.0 and entry["upload_bytes"]["x"] == pytest.approx(10.0)
    assert entry["mia_gap_std"]["loss"] == pytest.approx(statistics.stdev([0.2, 0.4, 0.9]))


def test_summary_leaves_out_what_some_seed_did_not_measure():
    """A column measured on one seed of three is a dash, not that seed's value as the row's."""
    score = {"psnr": 12.0, "baseline_psnr": 11.0, "ssim": 0.3, "baseline_ssim": 0.2}
    runs = {
        seed: {"X": {"per_domain": {"a": 0.5}, "mean": 0.5, "upload_bytes": {"c": 1}}}
        for seed in range(3)
    }
    runs[0]["X"]["mia"] = {"auc": 0.6}
    for seed in range(3):
        runs[seed]["X"]["reconstruction"] = {"a": dict(score)}
    runs[2]["X"]["reconstruction"]["a"].update(averaged_psnr=13.0, images_averaged=2)
    entry = benchmark.summarize({s: {"FedBiP-S": r["X"]} for s, r in runs.items()})["FedBiP-S"]
    assert entry["mia"] is None and "mia_auc_std" not in entry
    assert entry["reconstruction"] == {"a": pytest.approx(score)}, (
        "the averaged keys of one seed are left out"
    )
    assert benchmark.reconstruction_cells(entry["reconstruction"])[2] == "–"
    assert entry["upload_bytes"] == {"c": 1.0}


def test_dcr_cells_give_the_difference_from_the_no_data_control_on_the_same_seeds():
    def entry(seeds, pixel, feature, domias=None):
        dcr = {"pixel_auc": pixel, "feature_auc": feature, "pixel_share": 0.01}
        return {"seeds": seeds, "dcr": {"a": dcr | ({"domias_auc": domias} if domias else {})}}

    control = entry([0, 1, 2], 0.54, 0.50, 0.51)
    assert benchmark.dcr_cells(entry([0, 1, 2], 0.56, 0.49, 0.60), control) == [
        "0.560 (+0.020)",
        "0.490 (-0.010)",
        "0.010",
        "0.600 (+0.090)",
    ]
    assert benchmark.dcr_cells(entry([0], 0.56, 0.49), control) == [
        "0.560",
        "0.490",
        "0.010",
        "–",
    ], "other seeds; a row measured before DOMIAS"
    assert benchmark.dcr_cells({"seeds": [0], "dcr": None}, control) == ["–"] * 4


def made(kind, commit="c1", date="2026-11-25T10:00:00+00:00"):
    """A row's provenance as :func:`provenance.record` writes it."""
    machine = {"cpu": "CPU X", "kind": kind, "threads": 2}
    versions = {"torch": "2.1", "diffusers": "0.4", "flwr": "1.4"}
    return {"commit": commit, "machine": machine, **versions, "date": date}


def row(mean, made_with=None):
    out = {"per_domain": {"a": mean}, "mean": mean}
    return {**out, "provenance": made_with} if made_with else out


def test_a_new_row_carries_its_provenance(tmp_path, monkeypatch):
    """The row run_seed caches: commit, machine kind and CPU, threads, versions, date."""
    bench = Bench(Settings(), work=tmp_path / "work", results=tmp_path / "results", threads=3)
    monkeypatch.setattr(runner, "run_variant", lambda *_: None)
    monkeypatch.setattr(runner, "measure", lambda *_: row(0.5))
    made_with = benchmark.run_seed(bench, 0, ["Central"], judges=None)["Central"]["provenance"]
    assert json.loads(bench.cache(0).read_text())["results"]["Central"]["provenance"] == made_with
    machine = this_machine()
    assert made_with["machine"] == {**machine.model_dump(), "threads": 3, "kind": machine.kind}
    assert {p: made_with[p] for p in ("torch", "diffusers", "flwr")} == {
        p: metadata.version(p) for p in ("torch", "diffusers", "flwr")
    }
    assert made_with["commit"] == provenance.commit(project_dir(), [bench.results])
    assert datetime.fromisoformat(made_with["date"]).tzinfo is not None
    model = json.loads(bench.cache(0).read_text())["results"]["Central"]["model"]
    assert model == provenance.model_digest(project_dir() / "models" / "miniature-ldm")


def test_a_row_cached_on_another_model_is_made_again_and_one_on_this_model_is_kept(
    tmp_path, monkeypatch
):
    bench = Bench(Settings(), work=tmp_path / "work", results=tmp_path / "results", threads=1)
    ran: list[str] = []
    monkeypatch.setattr(runner, "run_variant", lambda _b, v, _s: ran.append(v.name))
    monkeypatch.setattr(runner, "measure", lambda *_: row(0.5))
    benchmark.run_seed(bench, 0, ["Central", "Prompts-only"], judges=None)
    assert ran == ["Central", "Prompts-only"]
    stored = json.loads(bench.cache(0).read_text())
    stored["results"]["Central"]["model"] = "another"
    bench.cache(0).write_text(json.dumps(stored))
    results = benchmark.run_seed(bench, 0, ["Central", "Prompts-only"], judges=None)
    assert ran == ["Central", "Prompts-only", "Central"]
    assert results["Central"]["model"] == results["Prompts-only"]["model"] != "another"


def test_the_model_digest_changes_with_any_weight_and_only_with_the_model(tiny_model_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    before = provenance.model_digest(copy)
    (copy / "README.md").write_text("a card")
    assert provenance.model_digest(copy) == before, "the card is not the model"
    weights = next((copy / "unet").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert provenance.model_digest(copy) != before


def test_seeds_of_different_models_are_never_averaged():
    runs = {
        s: {"Central": {**row(0.9, made("AVX2")), "model": m}} for s, m in ((0, "m1"), (1, "m2"))
    }
    for flag in (False, True):
        with pytest.raises(ValueError, match="Central: m1, m2"):
            benchmark.summarize(runs, mix_machine_kinds=flag)
    one = benchmark.summarize({0: runs[0]})
    assert (
        benchmark.accuracy_table(one, ["Central"])
        .splitlines()[2]
        .endswith("| AVX2, model m1, 1 commit, 2026-11-25 |")
    )


def test_the_commit_is_head_dirty_where_tracked_code_changed_and_unknown_outside_git(tmp_path):
    root, outputs = tmp_path / "repo", tmp_path / "repo" / "results"
    outputs.mkdir(parents=True)
    (root / "code.py").write_text("a = 1\n")
    (outputs / "seed-0.json").write_text("{}\n")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"]):
        subprocess.run([*git, *args], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    head = head.stdout.strip()
    assert provenance.commit(root, [outputs]) == head
    (outputs / "seed-0.json").write_text('{"new": 1}\n')
    (root / "untracked.txt").write_text("x")
    assert provenance.commit(root, [outputs]) == head, "the benchmark's own outputs do not count"
    assert provenance.commit(root) == head + "-dirty"
    (root / "code.py").write_text("a = 2\n")
    assert provenance.commit(root, [outputs]) == head + "-dirty"
    (tmp_path / "plain").mkdir()
    assert provenance.commit(tmp_path / "plain") == "unknown"


def test_the_summary_refuses_to_average_machine_kinds_unless_asked():
    later = made("AVX2", "c2", "2026-11-26T10:00:00+00:00")
    runs = {
        0: {"FedBiP-S": row(0.8, made("AVX2")), "Central": row(0.9, made("AVX2"))},
        1: {"FedBiP-S": row(0.7, made("AVX2")), "Central": row(0.9, later)},
        2: {"FedBiP-S": row(0.9, made("AVX512+bf16"))},
    }
    with pytest.raises(provenance.MixedMachineKinds) as refused:
        benchmark.summarize(runs)
    message = str(refused.value)
    assert "FedBiP-S: AVX2: 2 seeds (0, 1); AVX512+bf16: 1 seed (2)" in message
    assert "--mix-machine-kinds" in message and "Central" not in message
    summary = benchmark.summarize(runs, mix_machine_kinds=True)
    assert summary["FedBiP-S"]["mean"] == pytest.approx(0.8)
    table = benchmark.accuracy_table(summary, ["FedBiP-S", "Central"]).splitlines()
    mixed = "| mixed kinds, AVX2: 2 seeds (0, 1); AVX512+bf16: 1 seed (2), 1 commit, 2026-11-25 |"
    assert table[2].endswith(mixed)
    assert table[3].endswith("| AVX2, 2 commits, 2026-11-25 to 2026-11-26 |"), "commits: counted"
    assert table[0].endswith("| seeds | made with |")
    assert table[1].count("---") == table[0].count("|") - 1


def test_rows_cached_without_provenance_are_unrecorded_and_never_merged():
    old = {seed: {"Central": row(0.9)} for seed in (0, 1)}
    assert provenance.kind(old[0]["Central"]) == provenance.UNRECORDED
    assert (
        benchmark.accuracy_table(benchmark.summarize(old), ["Central"])
        .splitlines()[2]
        .endswith("| unrecorded |")
    )
    with pytest.raises(provenance.MixedMachineKinds, match=r"unrecorded: 2 seeds \(0, 1\)"):
        benchmark.summarize({**old, 2: {"Central": row(0.9, made("AVX2"))}})


def test_the_printed_summary_carries_the_provenance_columns():
    runs = {0: {"Central": row(0.9, made("AVX2", "abc-dirty"))}}
    (line,) = benchmark.console_lines(benchmark.summarize(runs))
    assert line.startswith("Central") and "90.0 ±  0.0  (1 seeds)" in line
    software = "torch 2.1, diffusers 0.4, flwr 1.4"
    assert line.endswith(f"AVX2, 1 commit, 2026-11-25; CPU X; {software}; abc-dirty")


def test_a_paired_difference_is_the_mean_with_a_95_percent_t_interval():
    mean, half = benchmark.t_interval([1.0, 2.0, 3.0])
    # t(0.975, 2) = 4.303 times the std (1) over sqrt(3)
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3), abs=1e-3)
    a = "FedBiP-S"  # the first comparisons: against the floor and the ceiling
    runs = {
        s: {a: row(0.5 + d), "Prompts-only": row(0.5), "Central": row(0.61)}
        for s, d in enumerate([0.10, 0.11, 0.12])
    }
    # a seed whose two rows are of other machine kinds is not paired
    runs[3] = {a: row(0.9), "Prompts-only": row(0.1, made("AVX2"))}
    # nor one whose two rows ran different models
    runs[4] = {a: {**row(0.9), "model": "a"}, "Prompts-only": {**row(0.1), "model": "b"}}
    found = benchmark.differences(runs)
    assert [(d.a, d.b) for d in found] == [(a, "Prompts-only"), (a, "Central")]
    apart, close = found
    assert apart.per_seed == pytest.approx({0: 0.10, 1: 0.11, 2: 0.12})
    assert (apart.mean, apart.half_width) == pytest.approx((0.11, 0.02484), abs=1e-5)
    assert apart.distinguishable and close.mean == pytest.approx(0.0) and not close.distinguishable
    lines = benchmark.differences_table(found).splitlines()
    assert lines[2].endswith(f"| +11.0 | [+8.5, +13.5] | {a} higher |")
    assert lines[3].endswith(f"| [-2.5, +2.5] | {benchmark.NOT_DISTINGUISHABLE} |")
    one = benchmark.paired_difference({0: runs[0]}, a, "Prompts-only")
    assert one.half_width is None and not one.distinguishable, "one seed gives no interval"


def test_the_accuracy_heading_states_the_pinned_sampler_steps_and_t(tmp_path):
    bench = Bench(Settings(), work=tmp_path, results=tmp_path)
    sampled = benchmark.sampling(bench)
    assert sampled == benchmark.Sampling("unipc", 5, "trailing", 999)
    assert benchmark.accuracy_heading(sampled) == (
        "### Accuracy (%): sampler `unipc` (trailing spacing), 5 steps, T = 999\n"
    )


def test_each_row_takes_the_stand_in_of_its_own_upload_kind(tmp_path):
    """K z(T) per image as the row uploads them (the paper's FedBiP-S: passes of one), the mixture
    kinds by their statistic, a DP row its method's class statistics at its epsilon; nothing
    for uploads that are no latent."""
    bench = Bench(Settings(), work=tmp_path, results=tmp_path)

    def setting(name, size=256):
        return benchmark.stand_in_setting(bench, benchmark.variant(name), 999, size)

    assert setting("FedBiP-S") == ("256px/T=999/K=2", "rows/likelihood-ratio")
    assert setting("FedBiP-S", 64) == ("64px/T=999/K=2", "rows/likelihood-ratio")
    assert setting("FedBiP-L") == ("256px/T=999/K=10", "rows/likelihood-ratio")
    assert setting("FedBiP-S, 2 passes of one z(T)") == ("256px/T=999/K=1", "rows/likelihood-ratio")
    assert setting("FedLD") == ("256px/T=999/K=2", "fedld/mean-filter")
    assert setting("Espresso") == ("256px/T=999/K=2", "espresso/mean-filter")
    assert setting("FedBiP-mixture")[1] == "fedbip-mixture/mean-filter"
    assert setting("FedLD-DP eps 4") == (
        "256px/T=999/fedld-dp/epsilon=4",
        "fedld-dp/mean-filter",
    )
    assert setting("FedBiP-mixture-DP eps 16", 64) == (
        "64px/T=999/fedbip-mixture-dp-stats/epsilon=16",
        "fedbip-mixture-dp-stats/mean-filter",
    )
    assert setting("OSCAR", 64) == ("64px/oscar", "oscar/class-mean")
    # a client's own classifier by its start and the benchmark's local budget (300 steps)
    for name in ("Local", "FedLMG-FT", "FedLMG-SD"):
        assert setting(name, 64) == ("64px/classifier/init=pretrained/epochs=150", "fedlmg/loss")
    # FedAvg's replies by what travels, from where, and the benchmark's 25 rounds of 2 epochs
    assert setting("FedAvg", 64) == (
        "64px/fedavg/part=all/init=pretrained/rounds=25/local-epochs=2",
        "fedavg/loss-last",
    )
    assert setting("FedAvg-head", 64) == (
        "64px/fedavg/part=head/init=pretrained/rounds=25/local-epochs=2",
        "fedavg-head/loss-last",
    )
    for name in ("Central", "FedPFT", "OSCAR", "FedLMG-FT", "Local", "FedAvg", "FedAvg-head"):
        assert setting(name) is None, name


def attack_record(
    seed, per_domain_auc, key="256px/T=961/K=2", attack="rows/likelihood-ratio", model="abc"
):
    return {
        "command": f"python scripts/server_attacks.py --large-size 256 --seed {seed}",
        "provenance": {"model": model},
        "results": {
            d: {key: {"attacks": {attack: {"auc": a, "auc_stderr": 0.01, "tpr_at_max_fpr": a / 4}}}}
            for d, a in per_domain_auc.items()
        },
    }


def test_the_stand_in_columns_are_their_kinds_records_over_their_seeds(tmp_path):
    bench = Bench(Settings(), work=tmp_path, results=tmp_path)
    write_json(tmp_path / "server_attacks_latents_seed0.json", attack_record(0, {"sketch": 0.9}))
    write_json(tmp_path / "server_attacks_latents_seed1.json", attack_record(1, {"sketch": 0.8}))
    # another model's world (or a record without a digest): other members, never a stand-in
    other = attack_record(2, {"sketch": 0.1}, model="old")
    write_json(tmp_path / "server_attacks_latents_seed2.json", other)
    small = attack_record(2, {"sketch": 0.6}, key="64px/T=961/K=2")
    write_json(tmp_path / "server_attacks_t961_seed2.json", small)
    names = ["FedBiP-S", "FedBiP-S, 2 passes of one z(T)", "FedLD"]
    models = dict.fromkeys(names, "abc")
    large = benchmark.stand_in_attacks(bench, 961, 256, models)
    assert list(large) == ["FedBiP-S"], "no record of K = 1 or of FedLD"
    found = large["FedBiP-S"]
    assert found["seeds"] == [0, 1]
    sketch = found["per_domain"]["sketch"]
    assert sketch["auc"] == pytest.approx(0.85) and sketch["auc_std"] == pytest.approx(0.0707, 1e-3)
    assert benchmark.stand_in_attacks(bench, 961, 256, {"FedBiP-S": "old"})["FedBiP-S"][
        "seeds"
    ] == [2]
    assert not benchmark.stand_in_attacks(bench, 961, 256, {"FedBiP-S": "new"})
    stand_in = benchmark.stand_in_attacks(bench, 961, 64, models)["FedBiP-S"]
    assert stand_in["seeds"] == [2]
    entry = {
        "seeds": [0, 1, 2],
        benchmark.SERVER_ATTACK_LARGE: found,
        benchmark.SERVER_ATTACK_STAND_IN: stand_in,
    }
    table = benchmark.server_attack_table({"FedBiP-S": entry}, ["sketch"])
    assert "| z(T) likelihood ratio | 0.600 / 0.15 | records 2 | 0.850 ± 0.071 / 0.21 | 0, 1 |" in (
        table
    )
    # the run's own uploads, where its run folders were measured on as many seeds, come first
    own = benchmark.server_attack_summary(
        {0: {"sketch": dict(auc=0.7, auc_stderr=0.04, tpr_at_low_fpr=0.1)}}
    )
    table = benchmark.server_attack_table(
        {"FedBiP-S": {**entry, benchmark.SERVER_ATTACK: own}}, ["sketch"]
    )
    assert "| 0.700 / 0.10 | run folders 0 (3) |" in table
    # FedAvg's replies are tested in records only (no run folder keeps them); class counts never
    table = benchmark.server_attack_table(
        {"FedAvg": {"seeds": [0], benchmark.SERVER_ATTACK_STAND_IN: stand_in}, "Prompts-only": {}},
        ["sketch"],
    )
    assert "| FedAvg | last round's reply loss | 0.600 / 0.15 | records 2 |" in table
    assert "No test (class counts only): Prompts-only." in table


def conditioning_record(seed, per_key_auc, *, large_model=None, device="cpu", model="m1"):
    made = {
        "machine": {"kind": "AVX2"},
        "model": model,
        **({"large_model": large_model} if large_model else {}),
    }
    return {
        **attack_record(seed, {}),
        "device": device,
        "provenance": made,
        "results": {
            "sketch": {
                key: {"attacks": {"concepts/loss-ratio": {"auc": a, "tpr_at_max_fpr": a / 4}}}
                for key, a in per_key_auc.items()
            }
        },
    }


def test_the_conditioning_table_takes_sd_size_only_from_the_unet_trained_there(tmp_path):
    """A 4x64x64 cell counts only from a record made on the UNet continued at 256 px (the
    shipped one fails the test's control there); a seed's first record holds its cell; seeds
    give mean ± std, a domain no record holds a dash."""
    bench = Bench(Settings(), work=tmp_path, results=tmp_path)
    default, large = "64px/concepts/shots=16/epochs=10", "256px/concepts/shots=16/epochs=10"
    names = benchmark.CONDITIONING_RECORDS
    shipped_unet = conditioning_record(0, {default: 0.6, large: 0.5}, device="NVIDIA H200")
    write_json(tmp_path / names[0], shipped_unet)
    write_json(tmp_path / names[1], conditioning_record(1, {default: 0.7}))
    continued = conditioning_record(0, {default: 0.9, large: 0.8}, large_model="abc")
    write_json(tmp_path / names[4], continued)
    found = benchmark.conditioning_attacks(bench, large_model="abc")
    run_budget = benchmark.ConditioningSetting("concepts", 16, 10, 64)
    assert found[run_budget]["sketch"].auc == {0: 0.6, 1: 0.7}
    cell = found[run_budget._replace(px=256)]["sketch"]
    assert cell.auc == {0: 0.8} and cell.kinds == {"AVX2"}
    # the UNet continued at 256 px names the model of a 4x64x64 cell, the record's any other
    assert cell.models == {"abc"} and found[run_budget]["sketch"].models == {"m1"}
    assert found[run_budget]["sketch"].text() == "0.650 ± 0.071 / 0.16 (0, 1)"
    assert run_budget._replace(px=256) not in benchmark.conditioning_attacks(bench, "other")
    table = benchmark.conditioning_table(bench, ["painting", "sketch"])
    assert "| FedBiP's concepts | 16 shots, 10 epochs | 4x16x16 | – | 0.650 ± 0.071" in table
    assert " (0, 1) | m1 | AVX2, NVIDIA H200 |" in table


def test_the_conditioning_table_reads_the_dp_concepts_among_a_dp_uploads_tests(tmp_path):
    """A DP upload's record keys it by epsilon and holds the mixture's tests beside the
    concepts': the row takes the concepts' test only, on the mixture mode's budget."""
    bench = Bench(Settings(), work=tmp_path, results=tmp_path)
    attacks = {"fedbip-mixture-dp/concepts/loss-ratio": 0.48, "fedbip-mixture-dp/mean-filter": 0.9}
    entry = {
        "epsilon": 4.0,
        "attacks": {name: {"auc": a, "tpr_at_max_fpr": 0.01} for name, a in attacks.items()},
    }
    record = {
        **conditioning_record(2, {}),
        "results": {"sketch": {"64px/fedbip-mixture-dp/epsilon=4": entry}},
    }
    write_json(tmp_path / "server_attacks_dp_seed2.json", record)
    cfg = bench.settings.run_config
    setting = benchmark.ConditioningSetting(
        "fedbip-mixture-dp",
        cfg["data.shots-per-class"],
        cfg["fedbip.concept-epochs"],  # the mixture runs fedbip's client step
        64,
        4.0,
    )
    cell = benchmark.conditioning_attacks(bench, large_model="abc")[setting]["sketch"]
    assert cell.auc == {2: 0.48}
    table = benchmark.conditioning_table(bench, ["sketch"])
    assert (
        "| fedbip-mixture-DP's concepts | 16 shots, 10 epochs, DP-SGD, upload epsilon 4 | 4x16x16 | 0.480 / 0.01 (2) |"
        in table
    )


def test_the_shipped_records_fill_the_headline_rows_at_three_seeds():
    """The server's test on each headline row's upload kind from the shipped model's records
    at T = 999 (the benchmark's sampler): at the run's size the latent rows FedBiP-S, -L, the
    mixture mode and FedLD, and the class means of FedPFT and OSCAR, at SD's latent size the
    latent rows; each from three seeds of the clients' randomness (the DP mixture, Espresso,
    FedLMG-FT: their run folders only). Without DP the server's test finds members (AUC above
    0.55 at the run's size, 0.75 at SD's); OSCAR's caption states carry the class only."""
    bench = Bench(Settings(), work=project_dir(), results=project_dir() / "benchmarks")
    shipped = provenance.model_digest(project_dir() / "models" / "miniature-ldm")
    models = dict.fromkeys(benchmark.HEADLINE, shipped)
    latent = {"FedBiP-S", "FedBiP-L", "FedBiP-mixture", "FedLD"}
    expected = {
        64: latent | {"OSCAR", "FedPFT"},
        256: latent,
    }
    for size, floor in ((64, 0.55), (256, 0.75)):
        found = benchmark.stand_in_attacks(bench, 999, size, models)
        assert set(found) == expected[size], (size, sorted(found))
        for name, row in found.items():
            assert row["seeds"] == [0, 1, 2], (name, size)
            aucs = [a["auc"] for a in row["per_domain"].values()]
            assert len(aucs) == 3, (name, size)
            if name == "OSCAR":
                assert all(abs(a - 0.5) < 0.1 for a in aucs), (name, size, aucs)
            else:
                assert all(a > floor for a in aucs), (name, size, aucs)


def test_report_section_is_replaced_in_place(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\nbefore\n")
    benchmark.write_section(path, "one\n")
    benchmark.write_section(path, "two\n")
    text = path.read_text()
    assert text.count("<!-- methods:start -->") == 1 and "two" in text and "one" not in text
    assert text.startswith("# Benchmarks\n\nbefore\n")


def test_nearest_real_distance_is_rms_to_the_closest_image():
    real = torch.stack([torch.zeros(3, 4, 4), torch.ones(3, 4, 4)])
    synthetic = torch.full((1, 3, 4, 4), 0.9)
    assert benchmark.nearest_real_distance(synthetic, real) == pytest.approx(0.1, abs=1e-6)
    as_bytes = ((synthetic + 1) * 127.5).round().to(torch.uint8)
    assert benchmark.nearest_real_distance(as_bytes, real) == pytest.approx(0.1, abs=0.01)


def test_membership_sets_are_class_balanced():
    labels = torch.tensor([0] * 10 + [1] * 3 + [2] * 7)
    picked = labels[benchmark.balanced(labels, 6)]
    assert torch.bincount(picked).tolist() == [2, 2, 2]


@pytest.fixture(scope="module")
def one_seed(tmp_path_factory, tiny_model_dir):
    """FedBiP-S and FedLMG-SD requested: FedLMG-FT runs before SD, which starts from its
    uploads; two clients."""
    root = tmp_path_factory.mktemp("bench")
    settings = Settings(
        domains=("sketch", "quickdraw"),
        classifier_steps=3,
        mia_per_domain=6,
        run_config={
            "ldm.model": str(tiny_model_dir),
            "data.image-size": 32,
            "classifier.image-size": 32,
            "data.shots-per-class": 2,
            "data.test-per-class": 2,
            "synthesis.num-inference-steps": 4,
            "synthesis.guidance-scale": 2.0,
            "fedbip.concept-epochs": 1,
            "classifier.init": "random",
            "synthesis.batch-size": 16,
        },
    )
    bench = Bench(settings, work=root / "work", results=root / "results", threads=1, timeout_s=900)
    judges = load_judges(root / "judges.safetensors", size=32, per_class=2, epochs=1)
    results = benchmark.run_seed(bench, 0, ["FedLMG-SD", "FedBiP-S"], judges)
    return bench, results


def test_a_seed_runs_its_variants_through_flwr_and_measures_them(one_seed):
    bench, results = one_seed
    assert list(results) == ["FedLMG-FT", "FedLMG-SD", "FedBiP-S"]
    small = results["FedBiP-S"]
    n = 2 * 6 * 2  # shots x classes x clients
    assert small["num_images"] == 2 * n, "2 z(T) per private image, each denoised once"
    assert set(small["per_domain"]) == {"sketch", "quickdraw"}
    assert small["mean"] == pytest.approx(statistics.fmean(small["per_domain"].values()))
    assert results["FedLMG-SD"]["upload_bytes"] == results["FedLMG-FT"]["upload_bytes"]
    assert set(small["fidelity"]) == {"sketch", "quickdraw"}
    assert all(0 <= f["class"] <= 1 and 0 <= f["domain"] <= 1 for f in small["fidelity"].values())
    assert math.isfinite(small["mia_gap"]["loss"]) and small["sgd_steps"] == 3
    # the tiny model ships a (random) backbone: membership by distance in pixels and in its features
    keys = {"pixel_auc", "pixel_share", "feature_auc", "feature_share", "domias_auc", "domias_tpr"}
    assert all(
        set(d) == keys and 0 <= d["pixel_auc"] <= 1 and 0 <= d["feature_auc"] <= 1
        for d in small["dcr"].values()
    )
    # the pooled loss attack: 6 class-balanced members per client (mia_per_domain) against as
    # many unseen test images of its domain, both clients in one set
    attack = small["mia"]
    assert (attack["members"], attack["non_members"], attack["low_fpr"]) == (12, 12, 0.01)
    assert (
        0 <= attack["auc"] <= 1 and 0 <= attack["tpr_at_low_fpr"] <= 1 and attack["auc_stderr"] > 0
    )
    # FedBiP's rows are the server's reconstructions of each private image, scored per client
    assert set(small["reconstruction"]) == {"sketch", "quickdraw"}
    for score in small["reconstruction"].values():
        one = {"psnr", "ssim", "baseline_psnr", "baseline_ssim"}
        assert set(score) == one | {f"averaged_{k}" for k in one} | {"images_averaged"}
        assert all(math.isfinite(v) for v in score.values())
        assert score["images_averaged"] == 2, "two z(T) of each private image"
    # the server's own test on each accepted upload, read back from the run folder: members
    # are the client's 12 images, one test per domain
    attacked = small[benchmark.SERVER_ATTACK]
    assert set(attacked) == {"sketch", "quickdraw"}
    assert all(0 <= a["auc"] <= 1 and a["members"] == 12 for a in attacked.values())
    cached = json.loads(bench.cache(0).read_text())
    assert cached["settings"] == bench.settings.digest() and set(cached["results"]) == set(results)


def test_a_reusing_variant_resumes_from_its_sources_shards(one_seed):
    bench, _ = one_seed
    large = RunFolder(bench.seed_folder(0) / "fedlmg-ft")
    small = RunFolder(bench.seed_folder(0) / "fedlmg-sd")
    used = json.loads(small.training_set.read_text())
    assert used and all(names for names in used.values())
    for names in used.values():
        for name in names:
            assert os.stat(small.shards / name).st_ino == os.stat(large.shards / name).st_ino, (
                "the shard was reused (same file), not synthesized again"
            )
    assert not small.payloads.joinpath("x").exists() and sorted(
        p.name for p in small.payloads.iterdir()
    ) == sorted(p.name for p in large.payloads.iterdir())


def test_remeasure_fills_a_cached_row_from_its_run_folder_and_leaves_another_runs_row(one_seed):
    """New columns without new runs: a row whose folder is here is measured again; a row whose
    accuracy its folder does not reproduce (another run's folder) stays as cached."""
    bench, results = one_seed
    judges = load_judges(bench.work.parent / "judges.safetensors", size=32, per_class=2, epochs=1)
    stored = json.loads(bench.cache(0).read_text())
    small = stored["results"]["FedBiP-S"]
    stripped = {k: v for k, v in small.items() if k not in ("mia", "reconstruction")}
    other = {**stored["results"]["FedLMG-FT"], "per_domain": {"sketch": 0.0, "quickdraw": 0.0}}
    stored["results"].update({"FedBiP-S": stripped, "FedLMG-FT": other})
    write_json(bench.cache(0), stored)
    try:
        again = benchmark.run_seed(bench, 0, ["FedBiP-S", "FedLMG-FT"], judges, remeasure=True)
        assert (
            again["FedBiP-S"]["mia"] == small["mia"]
            and again["FedBiP-S"]["reconstruction"] == small["reconstruction"]
        )
        assert again["FedBiP-S"]["wall_seconds"] == small["wall_seconds"], (
            "the run's own record stays"
        )
        assert again["FedLMG-FT"] == other, "not this folder's run: kept as cached"
    finally:
        stored["results"].update(results)
        write_json(bench.cache(0), stored)


def test_each_machine_kind_keeps_its_judges_figures(tmp_path):
    """Judges trained on another kind are other weights: the record keeps each kind's figures
    beside this one's, and the report names every kind."""
    bench = Bench(Settings(), work=tmp_path / "work", results=tmp_path / "results")
    other = {"class": 0.988, "domain": 0.998}
    write_json(benchmark.judges_record(bench), {"other-kind": other})
    benchmark.record_judges(bench, {"class": 0.5, "domain": 0.75})
    kept = json.loads(benchmark.judges_record(bench).read_text())
    assert kept == {"other-kind": other, this_machine().kind: {"class": 0.5, "domain": 0.75}}
    text = benchmark.judges_text(kept)
    assert "98.8% (class) and 99.8% (domain) on the other-kind kind" in text
    assert f"50.0% (class) and 75.0% (domain) on the {this_machine().kind} kind" in text
    by_seed = {
        "0": None,
        "1": {"class": 0.893, "domain": 0.998},
        "2": {"class": 0.893, "domain": 0.998},
    }
    assert benchmark.judges_cell(by_seed) == "– (seed 0); 89.3 / 99.8 (seeds 1, 2)"
    assert benchmark.judges_cell({"0": other, "1": other}) == "98.8 / 99.8"


def fidelity_order(summary):
    """The domains in the accuracy table's order: its first row's."""
    return next(iter(summary.values()))["per_domain"]


def test_the_report_tabulates_cached_seeds(one_seed, tmp_path):
    bench, _ = one_seed
    benchmark.record_judges(bench, {"class": 0.5, "domain": 0.25})
    md = tmp_path / "BENCHMARKS.md"
    summary = benchmark.report(bench, "fedbip benchmark --seeds 0", md)
    text = md.read_text()
    assert "| FedBiP-S |" in text and "| FedLMG-SD |" in text
    assert (
        "| MIA AUC, pooled | TPR at 1% FPR |" in text
        and "reconstruction PSNR (dB), own / same-class" in text
    )
    assert "### Accuracy (%): sampler `pndm` (leading spacing), 4 steps, T = " in text
    fidelity, domains = summary["FedBiP-S"]["fidelity"], list(fidelity_order(summary))
    judged = " / ".join(f"{100 * fidelity[d]['domain']:.0f}" for d in domains)
    header = f"| domain fidelity (%), {' / '.join(domains)} |"
    assert header in text and f"** | {judged} |" in text
    kind = this_machine().kind
    assert f"50.0% (class) and 25.0% (domain) on the {kind} kind" in text, "this kind's judges"
    judged = summary["FedBiP-S"][benchmark.JUDGES]["0"]
    assert set(judged) == {"class", "domain"}, "the row names the judges that judged it"
    assert f" | {benchmark.judges_cell({'0': judged})} |" in text
    model = provenance.model_digest(project_dir() / "models" / "miniature-ldm")
    assert f"| 1 | {this_machine().kind}, model {model}, 1 commit, " in text, "the made-with column"
    assert "### Paired differences in mean accuracy (points)" in text
    assert f"{100 * summary['FedBiP-S']['mean']:.1f}" in text
    auc = summary["FedBiP-S"][benchmark.SERVER_ATTACK]["per_domain"]["sketch"]["auc"]
    assert "| FedBiP-S | z(T) likelihood ratio | " in text and f"| {auc:.3f} / " in text
    assert (bench.results / "pictures" / "methods-sketch.png").exists()
    saved = json.loads((bench.results / "methods.json").read_text())
    assert set(saved["methods"]) == {"FedBiP-S", "FedLMG-FT", "FedLMG-SD"}


def test_the_report_keeps_pictures_whose_run_folders_are_gone(one_seed, tmp_path):
    """Cached results outlive run folders (another machine, a cleaned work folder): redrawing
    then would silently drop those methods' rows from the pictures."""
    bench, _ = one_seed
    benchmark.record_judges(bench, {"class": 0.5, "domain": 0.5})
    picture = bench.results / "pictures" / "methods-sketch.png"
    benchmark.report(bench, "fedbip benchmark --seeds 0", tmp_path / "a.md")
    drawn = picture.read_bytes()
    small = bench.seed_folder(0) / "fedbip-s"
    small.rename(small.with_name("moved"))
    try:
        picture.write_bytes(b"kept")
        benchmark.report(bench, "fedbip benchmark --seeds 0", tmp_path / "b.md")
        assert picture.read_bytes() == b"kept", "redrawn without FedBiP-S's row"
    finally:
        small.with_name("moved").rename(small)
    benchmark.report(bench, "fedbip benchmark --seeds 0", tmp_path / "c.md")
    assert picture.read_bytes() == drawn

"""FedBiP learns: with the shipped miniature LDM it beats text prompts alone on the rare domains.

The premise of the paper at CPU scale. The miniature model never saw sketch or quickdraw named
in a caption, so "a sketch of a star" draws a photo- or clipart-like star; a classifier trained on
such images does poorly on real sketches. FedBiP's uploads (z(T) of the client's own images and
its learned concepts) bring the domain back. A reduced configuration (8 shots, 10 denoising
steps, one pass, a short classifier schedule), averaged over two seeds, each redoing
personalization, synthesis and training. It runs the benchmark script's own functions.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import load_ldm

ROOT = Path(__file__).resolve().parents[1]
MARGIN = 0.10  # accuracy points FedBiP must gain over prompts-only, on average over rare domains


def _benchmark_module():
    spec = importlib.util.spec_from_file_location(
        "benchmark_miniature", ROOT / "scripts" / "benchmark_miniature.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmark_miniature"] = module
    spec.loader.exec_module(module)
    return module


def test_fedbip_beats_prompts_only_on_rare_domains():
    b = _benchmark_module()
    cfg = FedBiPConfig(
        domains="sketch,quickdraw",
        shots_per_class=8,
        test_per_class=20,
        num_inference_steps=10,
        guidance_scale=4.0,
        concept_epochs=2,
        multiplier=1,
        classifier_init="random",
        classifier_epochs=1,
    )
    bench = b.Bench(
        cfg,
        seeds=(0, 1),
        min_steps=120,
        fedavg_rounds=0,
        fedavg_local_epochs=0,
        timesteps=(),
        mia_per_domain=0,
    )
    ldm = load_ldm(ROOT / "models" / "miniature-ldm")
    scores: dict[str, list[float]] = {"FedBiP": [], "Prompts-only": []}
    for seed in bench.seeds:
        clients, tests = b.client_sets(cfg, seed), b.test_sets(cfg, seed)
        made = {
            "FedBiP": b.synthesize(ldm, b.personalize_all(ldm, clients, cfg, seed), cfg, seed),
            "Prompts-only": b.prompts_only(ldm, clients, cfg, seed),
        }
        for name, sets in made.items():
            model = b.fit(bench, *b.pooled(sets), seed)
            per_domain = b.accuracy(model, tests, cfg.classifier_image_size)
            print(f"seed {seed} {name}: {per_domain}")
            scores[name].append(statistics.fmean(per_domain.values()))
    fedbip, prompts = statistics.fmean(scores["FedBiP"]), statistics.fmean(scores["Prompts-only"])
    print(f"rare-domain accuracy: FedBiP {fedbip:.3f}, prompts-only {prompts:.3f}")
    assert fedbip - prompts >= MARGIN, scores

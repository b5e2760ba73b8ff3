"""FedBiP learns: with the shipped miniature LDM it beats text prompts alone on the rare domains.

The premise of the paper at CPU scale. The miniature model never saw sketch or quickdraw named
in a caption, so "a sketch of a star" draws a photo- or clipart-like star; a classifier trained on
such images does poorly on real sketches. FedBiP's uploads (z(T) of the client's own images and
its learned concepts) bring the domain back. A reduced configuration (8 shots, 10 denoising
steps, one pass, the same short classifier schedule from the public start for both), averaged
over two seeds, each redoing personalization, synthesis and training through the methods
registry: the code `flwr run` runs, called directly.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from fedbip_flwr import dataset
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import load_ldm
from fedbip_flwr.methods import ClientJob, ServerJob, create_for
from fedbip_flwr.server import RunFolder, evaluate_models, train_global

pytestmark = pytest.mark.long(minutes=2.5)

ROOT = Path(__file__).resolve().parents[1]
MARGIN = 0.10  # accuracy points FedBiP must gain over prompts-only, on average over rare domains
# The classifier is most of this test's time. From the shipped public start (the benchmark's and
# the default run's) 40 steps of batch 32 tell the methods apart further than 120 from a random
# start, in half the time (model 56ea4b09e7eb, seeds 0 and 1, one thread, AVX512+bf16+AMX Xeon,
# 2026-12-06: FedBiP 0.531 vs prompts-only 0.229, 0.30, 93 CPU-s for the four runs; random
# start, 120 steps: 0.398 vs 0.171, 0.23, 190 CPU-s).
CLASSIFIER = {"classifier.init": "pretrained", "classifier.steps": 40, "classifier.batch-size": 32}


def rare_domain_accuracy(method: str, seed: int, ldm, out: Path) -> float:
    # one synthetic image per private image for both (FedBiP: 1 z(T), 1 pass)
    own = {"fedbip.concept-epochs": 2, "fedbip.multiplier": 1, "prompts-only.images-per-image": 1}
    cfg = FedBiPConfig.from_flat(
        {
            "method": method,
            "data.domains": "sketch,quickdraw",
            "data.shots-per-class": 8,
            "data.test-per-class": 20,
            "synthesis.num-inference-steps": 10,
            "synthesis.guidance-scale": 4.0,
            **CLASSIFIER,
            "seed": seed,
            "federation.replayable-client-noise": True,
            **own,
        }
    )
    server = ServerJob(cfg, dataset.class_names(cfg.data_description), lambda: ldm)
    uploads = {}
    for partition in range(2):
        data = dataset.load_client_data(cfg.data_description, partition)
        job = ClientJob(
            cfg, data, torch.Generator().manual_seed(seed * 10 + partition), lambda: ldm
        )
        upload = create_for(cfg).accept(create_for(cfg).upload(job)[0], server)
        uploads[upload.client_id] = upload
    folder = RunFolder(out / f"{method}-{seed}")
    shards = create_for(cfg).train_set(uploads, server, folder.shard_path)
    model, _ = train_global(cfg, shards, server.class_names, folder, "cpu")
    tests = {
        d: (s.images, s.labels)
        for d, s in dataset.load_test_sets(cfg.data_description, cfg.data.domain_list).items()
    }
    scores = evaluate_models({"global": model}, tests, cfg.classifier.image_size, "cpu")
    print(f"seed {seed} {method}: {scores['per_domain']}")
    return scores["mean"]


@pytest.mark.parametrize("seeds", [(0, 1)])
def test_fedbip_beats_prompts_only_on_rare_domains(seeds, tmp_path):
    ldm = load_ldm(ROOT / "models" / "miniature-ldm")
    fedbip = statistics.fmean(rare_domain_accuracy("fedbip", s, ldm, tmp_path) for s in seeds)
    prompts = statistics.fmean(
        rare_domain_accuracy("prompts-only", s, ldm, tmp_path) for s in seeds
    )
    print(f"rare-domain accuracy: FedBiP {fedbip:.3f}, prompts-only {prompts:.3f}")
    assert fedbip - prompts >= MARGIN, (fedbip, prompts)

"""Stable Diffusion v1-4's architecture from the committed configs (models/sd-v1-4-architecture/).

The cheap test builds every part on the meta device (no weight is allocated, a few seconds) and
checks it has SD v1-4's published parameter counts and shapes, so CI checks the configs. The
``sd_scale`` test runs the real 512-px federation on the CPU; it is opt-in (`-m sd_scale`) and
does not fit CI (see tests/conftest.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from accelerate import init_empty_weights

from fedbip_flwr.results import RunResults
from fedbip_tools.sd_architecture import PUBLISHED_PARAMETERS, build_modules, parameter_counts
from tests.helpers import script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def meta_sd():
    with init_empty_weights():
        unet, vae, text, scheduler = build_modules()
    return unet, vae, text, scheduler


def test_committed_configs_have_sd_v1_4_parameter_counts(meta_sd):
    unet, vae, text, _ = meta_sd
    assert next(unet.parameters()).device.type == "meta"  # nothing was allocated
    assert parameter_counts(unet, vae, text) == PUBLISHED_PARAMETERS
    # 859.52 M / 83.65 M / 123.06 M: the rounded figures SD v1-4's model card family quotes
    assert round(PUBLISHED_PARAMETERS["unet"] / 1e6) == 860
    assert round(PUBLISHED_PARAMETERS["vae"] / 1e6) == 84
    assert round(PUBLISHED_PARAMETERS["text_encoder"] / 1e6) == 123


def test_committed_configs_have_sd_v1_4_shapes(meta_sd):
    unet, vae, text, scheduler = meta_sd
    # 512 px -> 4 x 64 x 64 latents; concepts 768 wide; 77 token positions, CLIP's vocabulary
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    assert (vae.config.latent_channels, vae.config.sample_size // factor) == (4, 64)
    assert vae.config.scaling_factor == pytest.approx(0.18215)
    assert unet.config.sample_size == 64 and unet.config.in_channels == 4
    assert unet.config.cross_attention_dim == text.config.hidden_size == 768
    assert text.config.max_position_embeddings == 77 and text.config.vocab_size == 49408
    assert scheduler.config.prediction_type == "epsilon"
    scheduler.set_timesteps(50)
    assert int(scheduler.timesteps[0]) == 981  # T of the paper's 50 PNDM steps
    with torch.device("meta"):
        out = unet(
            torch.empty(1, 4, 64, 64),
            torch.tensor([981]),
            encoder_hidden_states=torch.empty(1, 77, 768),
        ).sample
    assert tuple(out.shape) == (1, 4, 64, 64)


def test_the_proof_places_each_phase_where_it_ran(monkeypatch):
    """Server phases from the ServerApp's own clock in the order they ran, whatever order the
    record lists them in; a client's phases end with its train process, not its later evaluate
    one."""
    sd_proof = script("sd_proof")

    mb = 2**20
    samples = [
        {
            "t": float(t),
            "load1": 1.0,
            "procs": {
                "serverapp": (t * mb, 4),
                **({"clientapp-sketch": (t * mb, 4)} if 3 <= t <= 9 or t in (15, 16) else {}),
            },
        }
        for t in range(21)
    ]
    record = RunResults.model_validate(
        {
            "status": "completed",
            "config": {},
            "started_unix": 1002.0,  # the sampler started at 1000: the ServerApp's zero is t = 2
            "seconds": {
                "classifier": 2.0,
                "evaluation": 3.0,
                "load_model": 1.0,
                "round": 5.0,
                "synthesis": 4.0,
            },
            "clients": [
                {
                    "node_id": 1,
                    "status": "accepted",
                    "client_id": "sketch-0",
                    "domain": "sketch",
                    "metrics": {
                        "seconds-total": 4.0,
                        "seconds-instance": 1.0,
                        "seconds-concept": 2.0,
                    },
                }
            ],
        }
    )
    found = sd_proof.phases(samples, record, sampler_started=1000.0)
    # round (the model loads inside it) 2-8, synthesis 8-12, classifier 12-14, evaluation 14-17
    assert {k: v["peak_rss_mb"] for k, v in found.items() if k.startswith("server")} == {
        "server: round": 8,
        "server: synthesis": 12,
        "server: classifier": 14,
        "server: evaluation": 17,
    }
    assert found["sketch-0: concept learning"]["peak_rss_mb"] == 9  # 7-9, the train process's end
    assert found["sketch-0: start, data, model load"]["seconds"] == 3.0  # 3-6


@pytest.mark.sd_scale
def test_sd_v1_4_architecture_federation_at_512px_on_cpu(tmp_path, monkeypatch):
    """scripts/sd_proof.py end to end: two SuperNodes, flwr run, payload shapes.

    The model folder is FEDBIP_SD_MODEL (default /tmp/sd-v1-4-random), built first if missing.
    """
    sd_proof = script("sd_proof")

    model = Path(os.environ.get("FEDBIP_SD_MODEL", "/tmp/sd-v1-4-random"))
    monkeypatch.setenv("FEDBIP_ALLOW_SD_ON_CPU", "1")
    assert sd_proof.main([str(tmp_path), "--model", str(model)]) == 0
    proof = json.loads((tmp_path / "proof.json").read_text())
    assert proof["status"] == "finished:completed"
    assert proof["metrics"]["status"] == "completed"
    shapes = proof["payload_shapes"]
    assert sorted(shapes) == ["clipart-0", "quickdraw-0"]
    for client, tensors in shapes.items():
        assert tensors["latents"][1:] == [4, 64, 64], (client, tensors)  # z(T) of 512-px images
        assert tensors["latents"][0] == tensors["labels"][0] == 6  # 3 shots x 2 classes, m = 1
        assert tensors["domain_concept"][-1] == tensors["class_concepts"][-1] == 768
        assert tensors["class_concepts"][:2] == [2, 1]  # airplane, clock: one CLIP token each
    # S starts from the whole phrase: CLIP splits both domains into two tokens
    assert shapes["quickdraw-0"]["domain_concept"] == [2, 768]  # quick draw
    assert shapes["clipart-0"]["domain_concept"] == [2, 768]  # cli part

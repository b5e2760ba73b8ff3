"""The CUDA path on a GPU (opt-in: ``-m cuda``; ``scripts/gpu_check.sh`` runs it).

Without a GPU the CUDA path is checked for shapes and dtypes only: fp16 models on the CPU
(test_speed, test_precision), autocast and GradScaler on the CPU's autocast (test_memory_flat).
Here the same code runs where it is meant to: every one-shot method's upload, the server's
training set and the global classifier on the GPU, the frozen LDM in fp16 as
``half-precision = true`` puts it and the classifier under fp16 autocast
(``classifier.precision = "auto"``), against the same run on the CPU in float32.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fedbip_flwr.ldm import load_for_run, release_cached_memory
from fedbip_flwr.methods import create
from fedbip_flwr.server import RunFolder, train_global
from fedbip_flwr.storage import read_tensors
from fedbip_tools.build_ldm import TINY, build_ldm
from tests.helpers import (
    ONE_SHOT,
    WORDS,
    client_job,
    method_config,
    relative_error,
    s_gradient,
    server_job,
)

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def gpu() -> None:
    if not torch.cuda.is_available():
        pytest.fail("a test marked cuda was selected, but no CUDA device is visible", pytrace=False)


def one_shot(method: str, model_dir: Path, device: torch.device, out: Path) -> dict:
    """Two clients' uploads, the server's training set and classifier, all on ``device``."""
    cfg = method_config(method, **{"ldm.device": device.type, "classifier.precision": "auto"})
    ldm = load_for_run(str(model_dir), device, cfg.ldm.half_precision, cfg.data.image_size)
    server = replace(server_job(cfg, ldm), device=device)
    uploads = {}
    for partition in range(2):
        job = replace(client_job(cfg, ldm, partition), device=device)
        upload = create(method).accept(create(method).upload(job)[0], server)
        uploads[upload.client_id] = upload
    m, folder = create(method), RunFolder(out / device.type)
    models, shards = m.final_models(uploads, server), {}
    if models is None:
        shards = m.train_set(uploads, server, folder.shard_path)
        models = {
            "global": train_global(
                cfg, shards, server.class_names, folder, device, m.teacher(uploads, server)
            )[0]
        }
    images = {
        c: torch.cat([read_tensors(p)["images"] for p in paths]) for c, paths in shards.items()
    }
    return {
        "ldm_dtype": ldm.dtype,
        "uploads": {c: u.tensors for c, u in uploads.items()},
        "images": images,
        "models": models,
    }


@pytest.mark.parametrize("method", ["fedbip", *ONE_SHOT])
def test_each_method_runs_on_the_gpu_as_on_the_cpu(method, tiny_model_dir, tmp_path):
    gpu = one_shot(method, tiny_model_dir, torch.device("cuda"), tmp_path)
    cpu = one_shot(method, tiny_model_dir, torch.device("cpu"), tmp_path)
    assert gpu["ldm_dtype"] == torch.float16 and cpu["ldm_dtype"] == torch.float32
    assert gpu["uploads"].keys() == cpu["uploads"].keys()
    for client, tensors in gpu["uploads"].items():
        expected = cpu["uploads"][client]
        assert tensors.keys() == expected.keys(), client
        for name, tensor in tensors.items():
            assert tensor.device.type == "cpu", (client, name)  # uploads leave the GPU
            assert (tensor.shape, tensor.dtype) == (expected[name].shape, expected[name].dtype), (
                client,
                name,
            )
            if tensor.is_floating_point():
                assert torch.isfinite(tensor).all(), (client, name)
    if method == "fedbip":  # the same client randomness: z(T) differ only by the fp16 encode
        for client, tensors in gpu["uploads"].items():
            error = relative_error(
                tensors["latents"].float(), cpu["uploads"][client]["latents"].float()
            )
            print(f"{client}: z(T) relative error GPU fp16 vs CPU float32 {error:.2e}")
            assert error < 0.02, (client, error)
    for client, images in gpu["images"].items():
        assert images.dtype == torch.uint8 and images.shape == cpu["images"][client].shape
        assert images.float().std() > 1, "synthetic images are not constant"
        if method in ("fedbip", "prompts-only"):  # no guidance gradient to amplify fp16 rounding
            levels = (images.float() - cpu["images"][client].float()).abs().mean()
            print(f"{client}: mean |GPU - CPU| {levels:.2f} of 255")
            assert levels < 4, (client, float(levels))
    for name, model in gpu["models"].items():
        assert all(torch.isfinite(p).all() for p in model.parameters()), name
        assert all(p.dtype == torch.float32 for p in model.parameters()), name


def test_fp16_concept_gradients_on_the_gpu_match_fp32():
    """Loss scaling on a real GPU: without it fp16 underflows (test_precision on the CPU)."""
    torch.backends.cudnn.allow_tf32 = False  # a float32 reference, not TF32's 10-bit mantissa
    torch.backends.cuda.matmul.allow_tf32 = False
    ldm = build_ldm(TINY, WORDS, seed=0)
    exact = s_gradient(ldm, torch.float32, scaled=True, device="cuda")
    raw = s_gradient(ldm, torch.float16, scaled=False, device="cuda")
    scaled = s_gradient(ldm, torch.float16, scaled=True, device="cuda")
    bf16 = s_gradient(ldm, torch.bfloat16, scaled=True, device="cuda")
    errors = {
        name: relative_error(g, exact)
        for name, g in (("raw", raw), ("scaled", scaled), ("bf16", bf16))
    }
    print(f"S gradient relative error on the GPU: {errors}")
    assert errors["scaled"] < 0.01 and errors["bf16"] < 0.05
    assert errors["raw"] > 3 * errors["scaled"]


def test_releasing_the_cache_returns_unused_blocks_and_keeps_live_tensors():
    """What a client's actor gives back after its step (client_app.train): the caching
    allocator's free blocks, never a tensor still referenced (its frozen LDM)."""
    device = torch.device("cuda")
    kept = torch.ones(64, 2**20, device=device)  # 256 MiB still referenced
    scratch = torch.ones(128, 2**20, device=device)  # 512 MiB freed, still cached
    del scratch
    before, after = release_cached_memory(device)
    assert before - after >= 512 * 2**20, (before, after)
    assert after >= kept.numel() * kept.element_size() and bool(kept.eq(1).all())

"""The speed benchmark's cases (fedbip_tools/speed.py) on a tiny model: the project's sampling
loop and the stock StableDiffusionPipeline do the same work, the CUDA path's fp16 dtype and
shapes hold on the CPU, and the concept-step and classifier cases measure what they say."""

from __future__ import annotations

import pytest
import torch

from fedbip_flwr.ldm import load_ldm
from fedbip_tools import speed

pytestmark = pytest.mark.long(minutes=0.8)


@pytest.fixture()
def args(tiny_model_dir):
    return speed.parse(
        [
            f"--model={tiny_model_dir}",
            "--image-size=32",
            "--batch=2",
            "--steps=3",
            "--threads=1",
            "--concept-images=8",
            "--classifier-images=16",
            "--classifier-steps=2",
        ]
    )


def test_the_project_loop_draws_the_stock_pipelines_images(args):
    check = speed.case_synth_check(args, "synth-check")
    assert check["max_abs_difference_stock_vs_project"] < 1e-5, "same z(T), embeddings, steps"
    assert check["pixels_in_0_1"] and check["gflop_per_image"] > 0


def test_the_cuda_paths_fp16_model_keeps_shapes_and_dtypes_on_the_cpu(args, tiny_model_dir):
    ldm = load_ldm(tiny_model_dir).to("cpu", torch.float16)  # what half-precision does on CUDA
    latents, cond, uncond = speed.synthesis_inputs(args, ldm)
    assert latents.dtype == torch.float16 and cond.dtype == torch.float16
    images = speed.project_images(args, ldm, latents, cond, uncond)
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert torch.isfinite(images).all()
    # embeddings made by a float32 model (the same-images check) reach the fp16 UNet too: on
    # an H200 this raised "expected mat1 and mat2 to have the same dtype" before denoise cast them
    mixed = speed.project_images(args, ldm, latents, cond.float(), uncond.float())
    assert (mixed - images).abs().max() == 0


def test_synthesis_cases_report_throughput(args):
    for name in ("synth-stock", "synth-project-half-cl"):
        result = speed.case_synthesis(args, name)
        assert result["images"] == 2 and result["images_per_s"] > 0


def test_concept_cases_learn_as_many_vectors_each(args):
    ours = speed.case_concept_project(args, "concept-project")
    recipe = speed.case_concept_recipe(args, "concept-recipe")
    assert ours["vectors"] == recipe["vectors"] == 1 + 6, "S and one V per class"
    assert ours["steps"] == recipe["steps"] == 1
    assert recipe["table_rows"] > recipe["vectors"], "the recipe steps the whole embedding table"
    assert ours["seconds_per_step"] > 0 and recipe["seconds_per_step"] > 0


def test_classifier_case_splits_data_preparation_from_training(args):
    result = speed.case_classifier(args, "classifier-bf16")
    assert result["steps"] == 2 and 0 < result["data_seconds"] < result["seconds"]
    assert result["forward_backward_seconds"] == pytest.approx(
        result["seconds"] - result["data_seconds"]
    )


def test_the_compiled_unet_draws_the_eager_loops_images(args, tiny_model_dir):
    """ldm.compile-unet (torch.compile of the UNet) changes speed, not images."""
    from fedbip_flwr.ldm import load_for_run

    images = {}
    for compiled in (False, True):
        ldm = load_for_run(str(tiny_model_dir), "cpu", False, 32, compile_unet=compiled)
        latents, cond, uncond = speed.synthesis_inputs(args, ldm)
        images[compiled] = speed.project_images(args, ldm, latents, cond, uncond)
    assert images[True].shape == images[False].shape == (2, 3, 32, 32)
    assert (images[True] - images[False]).abs().max() < 1e-3


def test_matmul_times_bfloat16_only_where_the_cpu_has_it(args):
    """Emulated bf16 (AVX2) takes minutes per product and would measure nothing."""
    from fedbip_flwr.ldm import cpu_has_bf16

    peak = speed.case_matmul(args, "matmul")
    assert peak["float32"] > 0
    assert (peak["bfloat16"] is not None) == cpu_has_bf16()


def test_the_default_cases_leave_out_the_bf16_classifier_only_on_an_emulating_cpu(args):
    from fedbip_flwr.ldm import cpu_has_bf16

    args.device = "cpu"
    assert ("classifier-bf16" in speed.default_cases(args)) == cpu_has_bf16()
    assert set(speed.CASES) - set(speed.default_cases(args)) <= {"classifier-bf16"}

"""Concept gradients through a half-precision LDM (CUDA runs the frozen LDM in fp16).

At SD's latent size (4 x 64 x 64) the mean loss's gradients are ~1e-6 per element and part of
them underflow fp16; loss scaling (what learn_concepts does in fp16) and bf16 keep S's gradient
close to fp32's. CPU runs fp16 and bf16 too, so the path is exercised here without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from fedbip_flwr.concepts import (
    initial_concepts,
    learn_concepts,
    loss_scaler,
    prompt_layout,
)
from fedbip_flwr.ldm import LDM
from fedbip_tools.build_ldm import TINY, build_ldm
from tests.helpers import PRECISION_CLASSES, WORDS, relative_error, s_gradient


@pytest.fixture(scope="module")
def ldm() -> LDM:
    return build_ldm(TINY, WORDS, seed=0)


def test_half_precision_gradients_match_fp32(ldm):
    exact = s_gradient(ldm, torch.float32, scaled=True)
    assert not loss_scaler(ldm).is_enabled()  # fp32 needs no scaling
    fp16_raw = s_gradient(ldm, torch.float16, scaled=False)
    fp16 = s_gradient(ldm, torch.float16, scaled=True)
    bf16 = s_gradient(ldm, torch.bfloat16, scaled=True)
    ldm.to("cpu", torch.float32)
    # The defect: subnormal underflow in the unscaled fp16 backward (0.041 here), which loss
    # scaling removes (0.001 here): the scaled gradient is an order of magnitude closer.
    assert relative_error(fp16_raw, exact) > 10 * relative_error(fp16, exact)
    assert relative_error(fp16, exact) < 0.003  # loss scaling
    assert relative_error(bf16, exact) < 0.05  # bf16: fp32's exponent range
    assert torch.nn.functional.cosine_similarity(bf16.flatten(), exact.flatten(), 0) > 0.999


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_learning_in_half_precision_gives_float32_concepts(ldm, dtype):
    ldm.to("cpu", dtype)
    try:
        layout = prompt_layout(
            ldm.tokenizer, "a {S} style of a {V}", 1, 1, "sketch", PRECISION_CLASSES
        )
        s0, v0 = initial_concepts(ldm, layout, "token")
        z0 = torch.randn(6, *ldm.latent_shape(), generator=torch.Generator().manual_seed(0))
        result = learn_concepts(
            ldm,
            layout,
            "token",
            z0,
            torch.tensor([0, 0, 1, 1, 2, 2]),
            981,
            epochs=2,
            batch_size=3,
            lr=0.1,
            generator=torch.Generator().manual_seed(1),
        )
    finally:
        ldm.to("cpu", torch.float32)
    assert loss_scaler(ldm).is_enabled() is False
    for learned, start in ((result.domain, s0), (result.classes, v0)):
        assert learned.dtype == torch.float32 and learned.shape == start.shape
        assert torch.isfinite(learned).all() and not torch.equal(learned, start)
    assert all(torch.isfinite(torch.tensor(result.losses)))

"""Memory flat in the synthetic set's size: shards written batch by batch, read a batch at a time.

Synthesis streams each pass into its uint8 shard; the classifier reads rows of the shards
through a Dataset and a DataLoader, augments a whole batch in one gather, and is deterministic
given its seed whatever the data source. The CUDA path (channels_last, autocast, GradScaler)
runs here on the CPU for shapes and dtypes.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save

from fedbip_flwr import ldm as ldm_module
from fedbip_flwr.classifier import (
    Precision,
    ShardImages,
    TensorImages,
    TrainSettings,
    _augment,
    _train_step,
    build_classifier,
    cpu_bf16_trains_soundly,
    evaluate,
    fit_to_classifier,
    shrink,
    train_classifier,
)
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.ldm import load_ldm
from fedbip_flwr.methods.fedbip import personalize, synthesize_all
from fedbip_flwr.seeds import client_seed
from fedbip_flwr.server import RunFolder, synthetic_by_class, synthetic_dataset, train_settings
from fedbip_flwr.storage import read_tensors, write_tensors
from fedbip_flwr.synthesis import SynthesisSettings, draw_etas
from fedbip_flwr.viz import quantize
from fedbip_tools.sampling import synthesize_pass

CLASSES = ["circle", "square", "star"]
CFG = FedBiPConfig.from_flat(
    {
        "fedbip.concept-epochs": 0,
        "synthesis.num-inference-steps": 4,
        "data.image-size": 32,
        "fedbip.multiplier": 2,
        "synthesis.batch-size": 4,
        "ldm.vae-batch-size": 3,
        "classifier.image-size": 16,
    }
)


def make_payload(ldm, client_id: str, n_per_class: int = 3):
    generator = torch.Generator().manual_seed(len(client_id))
    images = torch.rand(3 * n_per_class, 3, 32, 32, generator=generator) * 2 - 1
    labels = torch.arange(3).repeat_interleave(n_per_class)
    domain = client_id.split("-")[0]
    payload, _ = personalize(
        ldm, images, labels, CLASSES, domain, client_id, CFG, torch.Generator().manual_seed(0)
    )
    return payload


@pytest.fixture(scope="module")
def synthesized(tiny_model_dir, tmp_path_factory):
    torch.manual_seed(0)
    ldm = load_ldm(tiny_model_dir)
    payloads = {c: make_payload(ldm, c) for c in ("sketch-0", "painting-0")}
    folder = RunFolder(tmp_path_factory.mktemp("flat"))
    return ldm, payloads, folder, synthesize_all(ldm, payloads, CFG, folder.shard_path)


def test_streamed_shard_is_the_whole_pass_saved_at_once(synthesized):
    """Batch-by-batch writing (batches of 4, 9 images) gives safetensors' own bytes."""
    ldm, payloads, folder, shards = synthesized
    payload = payloads["sketch-0"]
    settings = SynthesisSettings.from_config(CFG)
    own = CFG.settings_of("fedbip")
    eta = draw_etas(
        payload.concepts, own.multiplier, own.eta_std, client_seed(CFG.seed, "sketch-0")
    )[1]
    whole = quantize(synthesize_pass(ldm, payload, settings, eta))
    stored = shards["sketch-0"][1].read_bytes()
    meta = read_tensors(shards["sketch-0"][1])
    assert torch.equal(meta["images"], whole) and torch.equal(meta["labels"], payload.labels)
    from safetensors import safe_open

    with safe_open(str(shards["sketch-0"][1]), framework="pt") as handle:
        metadata = handle.metadata()
    assert stored == save({"images": whole, "labels": payload.labels}, metadata=metadata)


@pytest.mark.parametrize("size", [16, 32])
def test_dataset_returns_exactly_the_images_synthesis_wrote(synthesized, size):
    _, payloads, _, shards = synthesized
    written = [read_tensors(p) for c in sorted(shards) for p in shards[c]]
    images = torch.cat([shrink(w["images"], size) for w in written])
    labels = torch.cat([w["labels"] for w in written])
    assert len(labels) == 2 * 2 * 9
    data = synthetic_dataset(shards, size)
    assert len(data) == len(labels) and torch.equal(data.labels, labels)
    rows = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    for batch in rows.split(7):
        got, got_labels = data[batch]
        assert got.dtype == torch.uint8 and got.shape == (len(batch), 3, size, size)
        assert torch.equal(got, images[batch]) and torch.equal(got_labels, labels[batch])
    assert torch.equal(data.read(rows[:5]), torch.cat([w["images"] for w in written])[rows[:5]])
    stored = [read_tensors(p) for p in shards["painting-0"]]
    stored_images = torch.cat([w["images"] for w in stored])
    stored_labels = torch.cat([w["labels"] for w in stored])
    firsts = torch.cat([torch.nonzero(stored_labels == c).flatten()[:2] for c in range(3)])
    grid = synthetic_by_class(shards["painting-0"], classes=3, per_class=2)
    assert torch.equal(grid, stored_images[firsts]), "two of each class, class by class"
    assert len(pickle.dumps(data)) < 4096, "the dataset holds paths and labels, no images"
    with pytest.raises(IndexError):
        data[torch.tensor([len(data)])]


def reference_augment(batch: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The loop it replaces: pad (replicate), crop per image, flip some."""
    n, _, h, w = batch.shape
    pad = max(1, h // 8)
    padded = F.pad(batch, (pad, pad, pad, pad), mode="replicate")
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    out = torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(n)])
    out[flip] = out[flip].flip(-1)
    return out


def test_vectorised_augmentation_is_a_crop_and_flip_of_its_input():
    n, h = 2000, 16
    pad = h // 8
    # every pixel of every image distinct: which crop and flip was taken can be read back
    images = torch.arange(n * 3 * h * h, dtype=torch.float32).reshape(n, 3, h, h)
    out = _augment(images, torch.Generator().manual_seed(5))
    assert out.shape == images.shape and out.dtype == images.dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, reference_augment(images, torch.Generator().manual_seed(5)))
    for i in range(0, n, 97):  # values come from the same image, never another
        assert set(out[i].unique().tolist()) <= set(images[i].unique().tolist())
    # the centre column of a crop moves right in a flipped image: read off the flip and offsets
    rows_left = out[:, 0, h // 2, 0] - images[:, 0, 0, 0]
    rows_right = out[:, 0, h // 2, -1] - images[:, 0, 0, 0]
    flipped = rows_left > rows_right
    share = flipped.float().mean().item()
    assert abs(share - 0.5) < 4 * (0.25 / n) ** 0.5, share
    dy = ((out[:, 0, h // 2, h // 2] - images[:, 0, 0, 0]) // h - h // 2 + pad).long()
    assert set(dy.clamp(0, 2 * pad).tolist()) == set(range(2 * pad + 1))
    again = _augment(images.to(torch.uint8), torch.Generator().manual_seed(5))
    assert again.dtype == torch.uint8  # any dtype: a gather, no arithmetic


def settings(**kw) -> TrainSettings:
    return TrainSettings(
        **{"epochs": 1, "lr": 0.01, "momentum": 0.9, "batch_size": 5, "image_size": 16, **kw}
    )


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def train(data, labels=None, seed: int = 1, **kw) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_classifier(3, "random")
    return weights(train_classifier(model, data, labels, settings(**kw), seed=seed))


def test_training_is_deterministic_given_the_seed_whatever_the_source(synthesized):
    _, _, _, shards = synthesized
    data = synthetic_dataset(shards, 16)
    first = train(data)
    assert same(first, train(data))
    assert not same(first, train(data, seed=2))
    in_memory = data[torch.arange(len(data))]
    assert same(first, train(TensorImages(*in_memory)))  # the same bytes held in memory
    assert same(first, train(data, num_workers=1))  # a reading process changes nothing


def test_test_sets_held_at_classifier_size_score_the_same():
    torch.manual_seed(0)
    model = build_classifier(3, "random").eval()
    images, labels = torch.rand(10, 3, 32, 32) * 2 - 1, torch.arange(10) % 3
    small = fit_to_classifier(images, 16)
    assert small.shape == (10, 3, 16, 16) and small.dtype == torch.float32
    a, b = evaluate(model, images, labels, 16), evaluate(model, small, labels, 16)
    assert torch.equal(a.predictions, b.predictions) and a.mean_loss == b.mean_loss
    assert fit_to_classifier(quantize(images), 16).dtype == torch.uint8


@pytest.mark.parametrize("bf16_cpu", [True, False])
def test_auto_precision_is_half_where_the_device_computes_it(bf16_cpu, monkeypatch):
    monkeypatch.setattr(ldm_module, "cpu_has_bf16", lambda: bf16_cpu)
    for size in (16, 64):
        cuda = Precision(torch.float16, channels_last=True)
        assert Precision.for_device("cuda", "auto", size) == cuda
        assert Precision.for_device("mps", "auto", size) == Precision()
        for device in ("cuda", "cpu", "mps"):
            assert Precision.for_device(device, "float32", size) == Precision()
    bf16 = Precision(torch.bfloat16, channels_last=True) if bf16_cpu else Precision()
    assert Precision.for_device("cpu", "auto", 64) == bf16
    assert Precision.for_device("cpu", "auto", 16) == Precision()  # see cpu_bf16_trains_soundly


def test_the_run_config_chooses_the_global_classifier_precision_not_the_judges():
    assert train_settings(FedBiPConfig().classifier).precision == "float32"
    auto = FedBiPConfig.from_flat({"classifier.precision": "auto"})
    assert train_settings(auto.classifier).precision == "auto"
    assert TrainSettings(1, 0.01, 0.9, 8, 16).precision == "float32"  # judges, oracles


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_step_shapes_and_dtypes_on_cpu(dtype):
    """What CUDA runs (autocast, channels_last, GradScaler for fp16), on the CPU's autocast."""
    precision = Precision(autocast=dtype, channels_last=True)
    torch.manual_seed(0)
    model = build_classifier(3, "random").to(memory_format=torch.channels_last).train()
    seen = {}
    model.fc.register_forward_hook(lambda _m, _i, out: seen.update(logits=out))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # a small initial scale: GradScaler's default (2**16) overflows fp16 and skips a first step
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, enabled=dtype == torch.float16)
    before = model.fc.weight.detach().clone()
    x = _augment(torch.rand(4, 3, 32, 32) * 2 - 1, torch.Generator().manual_seed(0))
    loss = _train_step(
        model,
        optimizer,
        scaler,
        x.contiguous(memory_format=torch.channels_last),
        torch.tensor([0, 1, 2, 0]),
        precision,
    )
    assert seen["logits"].shape == (4, 3) and seen["logits"].dtype == dtype
    assert loss.dtype == torch.float32 and loss.shape == () and torch.isfinite(loss)
    assert model.fc.weight.dtype == torch.float32 and model.fc.weight.grad.dtype == torch.float32
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not torch.equal(model.fc.weight, before)


def test_train_classifier_runs_the_mixed_precision_path(synthesized):
    """bf16 autocast and channels_last train the same weights every time, near float32's.

    Repeats catch a kernel that reads memory it does not own (oneDNN's bf16 weight gradient
    at 16 px gave different, often huge or NaN, weights on most calls)."""
    _, _, _, shards = synthesized
    images, labels = synthetic_dataset(shards, 32)[torch.arange(10)]

    def trained(precision: Precision) -> torch.nn.Module:
        torch.manual_seed(0)
        model = build_classifier(3, "random")
        return train_classifier(
            model, images, labels, settings(image_size=32), seed=0, precision=precision
        )

    half = [trained(Precision(torch.bfloat16, channels_last=True)) for _ in range(3)]
    full = trained(Precision())
    assert all(same(weights(half[0]), weights(model)) for model in half[1:])
    assert all(torch.isfinite(p).all() for p in half[0].parameters())
    assert max((a - b).abs().max() for a, b in zip(half[0].parameters(), full.parameters())) < 0.5
    assert half[0].conv1.weight.is_contiguous(memory_format=torch.channels_last)


def test_bf16_training_on_the_cpu_refuses_inputs_its_kernel_gets_wrong(synthesized):
    _, _, _, shards = synthesized
    images, labels = synthetic_dataset(shards, 16)[torch.arange(10)]
    assert not cpu_bf16_trains_soundly(16) and cpu_bf16_trains_soundly(17)
    with pytest.raises(ValueError, match="16 px"):
        train_classifier(
            build_classifier(3, "random"),
            images,
            labels,
            settings(),
            seed=0,
            precision=Precision(torch.bfloat16, channels_last=True),
        )


def test_shard_dataset_rejects_float_shards(tmp_path):
    path = write_tensors(
        tmp_path / "x.safetensors",
        {"images": torch.zeros(2, 3, 4, 4), "labels": torch.zeros(2).long()},
    )
    with pytest.raises(ValueError, match="uint8"):
        ShardImages([path], 4)


def test_releasing_cached_memory_leaves_a_cpu_run_alone():
    """Off CUDA there is no caching allocator to empty: the ClientApp logs nothing about it."""
    assert ldm_module.release_cached_memory(torch.device("cpu")) is None

"""OSCAR: captions -> per-class mean text-encoder states, uploaded once; fresh-noise METHOD_CFG toward
them on the server. The captioners it runs (a tiny BLIP built here, the shipped miniature
one), the upload's contract and the server's training set, on tiny models."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import (
    BertTokenizer,
    BlipConfig,
    BlipForConditionalGeneration,
    BlipImageProcessor,
    BlipProcessor,
)

from fedbip_flwr import shapes
from fedbip_flwr.captioner import BlipCaptioner, MiniatureCaptioner, load_captioner
from fedbip_flwr.config import NodeConfig
from fedbip_flwr.dataset import ClientSet
from fedbip_flwr.ldm import ModelLoadError
from fedbip_flwr.methods import ClientJob, create_for
from fedbip_flwr.methods.oscar import class_conditioning
from fedbip_flwr.server import RunFolder
from fedbip_flwr.storage import read_tensors
from fedbip_flwr.upload import PayloadError
from tests.helpers import client_job, method_config, server_job, tampered

ROOT = Path(__file__).resolve().parents[1]
MINIATURE = ROOT / "models" / "miniature-captioner"
BLIP_WORDS = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    "[DEC]",
    "a",
    "photo",
    "of",
    "drawing",
    "sketch",
    "circle",
    "square",
    "star",
    "on",
    "white",
    "the",
    "black",
    "line",
]


@pytest.fixture(scope="module")
def tiny_blip_dir(tmp_path_factory) -> Path:
    """A randomly initialised BLIP captioner with a BERT tokenizer over a vocab written here,
    saved in the layout of Salesforce/blip-image-captioning-base."""
    folder = tmp_path_factory.mktemp("tiny-blip")
    (folder / "vocab.txt").write_text("\n".join(BLIP_WORDS) + "\n")
    tokenizer = BertTokenizer(str(folder / "vocab.txt"), bos_token="[DEC]")
    ids = {t: BLIP_WORDS.index(t) for t in ("[PAD]", "[SEP]", "[DEC]")}
    blip = BlipConfig(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 16,
        },
        text_config={
            "vocab_size": len(BLIP_WORDS),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 40,
            "encoder_hidden_size": 32,
            "bos_token_id": ids["[DEC]"],
            "pad_token_id": ids["[PAD]"],
            "sep_token_id": ids["[SEP]"],
            "eos_token_id": ids["[SEP]"],
        },
        projection_dim=32,
    )
    torch.manual_seed(0)
    BlipForConditionalGeneration(blip).save_pretrained(folder)
    processor = BlipImageProcessor(size={"height": 32, "width": 32})
    BlipProcessor(image_processor=processor, tokenizer=tokenizer).save_pretrained(folder)
    return folder


def shapes_images(domain: str = "photo", per_class: int = 2) -> torch.Tensor:
    return shapes.test_set(domain, per_class, size=32).images


# --- captioners --------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["blip", "miniature"])
def test_captions_are_strings_reproducible_under_one_seed_and_differ_across_seeds(
    which, tiny_blip_dir
):
    captioner = load_captioner(str(tiny_blip_dir if which == "blip" else MINIATURE))
    assert isinstance(captioner, BlipCaptioner if which == "blip" else MiniatureCaptioner)
    images = torch.cat([shapes_images(d) for d in ("photo", "clipart", "painting")])
    global_state = torch.get_rng_state()
    first = captioner.caption(images, torch.Generator().manual_seed(1))
    assert torch.equal(torch.get_rng_state(), global_state), "only the client's generator is used"
    assert len(first) == len(images) and all(isinstance(c, str) for c in first)
    assert first == captioner.caption(images, torch.Generator().manual_seed(1))
    assert first != captioner.caption(images, torch.Generator().manual_seed(2))


def test_the_tiny_blip_loads_through_the_loader_and_speaks_its_own_vocabulary(tiny_blip_dir):
    captioner = load_captioner(str(tiny_blip_dir))
    assert captioner.name == tiny_blip_dir.name, "an absolute path is not recorded, its name is"
    captions = captioner.caption(shapes_images(), torch.Generator().manual_seed(0))
    words = {w for c in captions for w in c.split()}
    assert words and words <= set(BLIP_WORDS) - {"[PAD]", "[SEP]", "[DEC]", "[CLS]", "[MASK]"}


def test_the_shipped_miniature_captioner_names_shapes_in_its_vocabulary(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a relative captioner resolves like the model does
    monkeypatch.setenv("FEDBIP_PROJECT_DIR", str(ROOT))
    captioner = load_captioner("models/miniature-captioner")
    assert captioner.name == "models/miniature-captioner"
    assert (MINIATURE / "model.safetensors").stat().st_size < 2 * 2**20
    vocabulary = set(shapes.pretraining_words())
    for domain in shapes.DOMAINS:
        test = shapes.test_set(domain, 4, size=64)
        captions = captioner.caption(test.images, torch.Generator().manual_seed(0))
        assert all(c and set(c.split()) <= vocabulary for c in captions), captions
        named = [shapes.CLASSES[y] in c.split() for c, y in zip(captions, test.labels.tolist())]
        assert sum(named) >= len(named) // 2, (domain, captions)
        if domain in shapes.RARE_DOMAINS:
            assert not any(domain in c.split() for c in captions), "never captioned by name"
            others = {w for d, ws in shapes.RARE_DESCRIPTORS.items() if d != domain for w in ws}
            assert not any(others & set(c.split()) for c in captions), "nor as the other domain"


def test_a_captioner_that_cannot_be_loaded_says_which(tmp_path):
    with pytest.raises(ModelLoadError, match="captioner"):
        load_captioner(str(tmp_path / "nowhere"))


# --- the client's upload -----------------------------------------------------------------------


def test_the_upload_is_per_class_conditioning_of_the_text_encoders_shape(tiny_ldm):
    cfg = method_config("oscar")
    job = client_job(cfg, tiny_ldm)
    blob, metrics = create_for(cfg).upload(job)
    upload = create_for(cfg).accept(blob, server_job(cfg, tiny_ldm))
    length, width = tiny_ldm.tokenizer.model_max_length, tiny_ldm.text_encoder.config.hidden_size
    conditioning = upload.tensors["conditioning"]
    assert conditioning.shape == (6, length, width) and conditioning.dtype == torch.float32
    assert upload.tensors["class_counts"].tolist() == [2] * 6
    tensor_bytes = 6 * length * width * 4 + 6 * 8
    assert tensor_bytes < len(blob) < tensor_bytes + 2048, "the tensors and a small header"
    assert upload.meta.captioner == "models/miniature-captioner"
    assert upload.meta.base_model == tiny_ldm.fingerprint
    assert metrics["num-captions"] == 12 and set(metrics) == {
        "num-captions",
        "seconds-caption",
        "seconds-encode",
    }


def test_each_class_row_is_the_mean_of_its_encoded_captions(tiny_ldm):
    """Eq. 7, with the captions the client sampled (same generator seed, k = 2 per image) and
    each caption encoded on its own."""
    cfg = method_config("oscar", **{"oscar.captions-per-image": 2})
    wide = copy.deepcopy(tiny_ldm).to("cpu", torch.float64)  # float64: batch blockings agree
    job = client_job(cfg, wide)
    blob, _ = create_for(cfg).upload(job)
    conditioning = create_for(cfg).accept(blob, server_job(cfg, tiny_ldm)).tensors["conditioning"]
    captioner, generator = (
        load_captioner(cfg.settings_of("oscar").captioner),
        torch.Generator().manual_seed(0),
    )
    captions = [captioner.caption(job.data.images, generator) for _ in range(2)]
    tok = tiny_ldm.tokenizer
    for label in range(6):
        states = []
        for per_pass in captions:
            for caption, y in zip(per_pass, job.data.labels.tolist()):
                if y == label:
                    ids = tok(
                        caption,
                        padding="max_length",
                        max_length=tok.model_max_length,
                        truncation=True,
                        return_tensors="pt",
                    ).input_ids
                    states.append(wide.text_encoder(ids).last_hidden_state[0])
        assert len(states) == 4
        # the float64 mean is exact to ~1e-15; the upload rounds each state to float32 and sums
        # the 4 in float32: < 4 x 2^-24 max|state| after the division; 2^-21 leaves 2x
        mean = torch.stack(states).mean(0)
        atol = 2**-21 * float(mean.abs().max())
        assert torch.allclose(conditioning[label], mean.float(), rtol=0, atol=atol)


def test_class_conditioning_averages_per_label_and_leaves_absent_classes_zero(tiny_ldm):
    captions = ["a circle", "a photo of a circle", "a star", "a sketch", "a heart"]
    labels = torch.tensor([0, 0, 3, 3, 5])
    wide = copy.deepcopy(tiny_ldm).to("cpu", torch.float64)  # float64: batch blockings agree
    one = torch.tensor([0])
    encoded = torch.stack([class_conditioning(wide, [c], one, 1)[0] for c in captions])
    means = class_conditioning(wide, captions, labels, 6)
    # a batch of 5 against batches of 1: the float64 states agree to ~1e-15, then each is rounded
    # to float32 (a 1-ulp split at worst) and up to 2 summed: <= 4 x 2^-24 max|state|; 2^-21: 2x
    atol = 2**-21 * float(encoded.abs().max())
    assert torch.allclose(means[0], encoded[:2].mean(0), rtol=0, atol=atol)
    assert torch.allclose(means[3], encoded[2:4].mean(0), rtol=0, atol=atol)
    assert torch.allclose(means[5], encoded[4], rtol=0, atol=atol)
    assert not means[[1, 2, 4]].any()


def without_class(job: ClientJob, label: int) -> ClientJob:
    data = job.data
    keep = data.labels != label
    held = ClientSet(
        images=data.images[keep],
        labels=data.labels[keep],
        classes=data.classes,
        domain=data.domain,
        client_id=data.client_id,
    )
    return ClientJob(job.cfg, held, job.generator, job.ldm)


@pytest.mark.parametrize("images_per_class", [0, 3])
def test_an_absent_class_is_a_zero_row_and_gets_no_images(images_per_class, tiny_ldm, tmp_path):
    cfg = method_config("oscar", **{"oscar.images-per-class": images_per_class})
    job = without_class(client_job(cfg, tiny_ldm), 2)
    blob, _ = create_for(cfg).upload(job)
    server = server_job(cfg, tiny_ldm)
    upload = create_for(cfg).accept(blob, server)
    counts = upload.tensors["class_counts"]
    assert counts.tolist() == [2, 2, 0, 2, 2, 2]
    assert not upload.tensors["conditioning"][2].any() and upload.tensors["conditioning"][3].any()
    shard = create_for(cfg).train_set(
        {upload.client_id: upload}, server, RunFolder(tmp_path).shard_path
    )[upload.client_id][0]
    stored = read_tensors(shard)
    per_image = cfg.settings_of("oscar").images_per_image
    per_class = torch.full((6,), images_per_class) if images_per_class else counts * per_image
    per_class[2] = 0
    assert stored["labels"].tolist() == torch.repeat_interleave(torch.arange(6), per_class).tolist()
    assert stored["images"].dtype == torch.uint8 and stored["images"].shape[1:] == (3, 32, 32)


def test_an_upload_with_a_blip_captioner_goes_through_the_same_method(tiny_ldm, tiny_blip_dir):
    cfg = method_config("oscar", **{"oscar.captioner": str(tiny_blip_dir)})
    blob, _ = create_for(cfg).upload(client_job(cfg, tiny_ldm))
    upload = create_for(cfg).accept(blob, server_job(cfg, tiny_ldm))
    assert upload.meta.captioner == tiny_blip_dir.name
    assert upload.tensors["conditioning"].abs().amax(dim=(1, 2)).gt(0).all()


# --- the server's check: lies only OSCAR's upload can tell -------------------------------------


def scaled_row(tensors, _meta):
    tensors["conditioning"] = tensors["conditioning"].clone()
    tensors["conditioning"][0] *= 1000


def other_model(_tensors, meta):
    meta["fedbip.base_model"] = json.dumps("0123456789abcdef")


def filled_absent_row(tensors, _meta):  # counts say class 2 is absent, its row is not zero
    tensors["class_counts"] = tensors["class_counts"].clone()
    tensors["class_counts"][2], tensors["class_counts"][3] = 0, 4


def zeroed_present_row(tensors, _meta):
    tensors["conditioning"] = tensors["conditioning"].clone()
    tensors["conditioning"][1] = 0


def longer_sequence(tensors, _meta):  # SD's 77 positions against the tiny encoder's 16
    c = tensors["conditioning"]
    tensors["conditioning"] = torch.cat([c, c[:, -1:].expand(-1, 77 - c.shape[1], -1)], 1)


OSCAR_LIES = {
    "a row beyond the text encoder's range": (scaled_row, "most the server's text encoder"),
    "another base model": (other_model, "same LDM"),
    "a row for a class it lacks": (filled_absent_row, "zero exactly"),
    "no conditioning for a class it holds": (zeroed_present_row, "zero exactly"),
    "another sequence length": (longer_sequence, "expected"),
}


@pytest.mark.parametrize("lie", sorted(OSCAR_LIES))
def test_oscar_specific_lies_are_refused_with_a_reason(lie, tiny_ldm):
    cfg = method_config("oscar")
    blob, _ = create_for(cfg).upload(client_job(cfg, tiny_ldm))
    change, reason = OSCAR_LIES[lie]
    with pytest.raises(PayloadError, match=reason):
        create_for(cfg).accept(tampered(blob, "oscar", cfg, change), server_job(cfg, tiny_ldm))


def test_an_institution_may_name_its_own_copy_of_the_captioner():
    node = NodeConfig.from_flat({"captioner": "/models/blip"})
    assert node.run_overrides() == {"oscar.captioner": "/models/blip"}

"""Tests for the built-in miniature multi-domain dataset (``fedbip_flwr.shapes``): its layout,
determinism, disjoint splits, distinct domains and pretraining corpus. Whether every domain is
learnable, and whether the common domains' classifier fails on the rare ones, is the world's
contract: ``tests/test_world.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedbip_flwr import shapes as ds
from fedbip_flwr.shapes import (
    CLASSES,
    COMMON_DOMAINS,
    DOMAINS,
    RARE_DOMAINS,
    ImageSet,
    client_train_set,
    partition,
    render,
    test_set,
)
from fedbip_flwr.viz import to_uint8


# --------------------------------------------------------------------------------------------
# constants, determinism, layout
# --------------------------------------------------------------------------------------------
def test_constants() -> None:
    assert CLASSES == ("circle", "square", "triangle", "star", "cross", "heart")
    assert DOMAINS == ("photo", "clipart", "painting", "sketch", "quickdraw")
    assert set(COMMON_DOMAINS) | set(RARE_DOMAINS) == set(DOMAINS)
    assert not set(COMMON_DOMAINS) & set(RARE_DOMAINS)


@pytest.mark.parametrize("domain", DOMAINS)
def test_client_set_layout(domain: str) -> None:
    s = client_train_set(domain, shots_per_class=3, client_index=1, seed=0)
    assert isinstance(s, ImageSet)
    assert len(s) == 18
    assert s.images.shape == (18, 3, 64, 64)
    assert s.images.dtype == torch.float32
    assert s.labels.dtype == torch.int64
    assert s.images.min() >= -1.0 and s.images.max() <= 1.0
    assert s.images.min() < 0.0 < s.images.max()  # dark and light content, not a flat image
    assert torch.bincount(s.labels, minlength=6).tolist() == [3] * 6
    assert s.classes == CLASSES and s.domain == domain


def test_size_and_class_subset() -> None:
    s = test_set("clipart", per_class=2, size=32, classes=("star", "circle"))
    assert s.images.shape == (4, 3, 32, 32)
    assert s.classes == ("star", "circle")
    assert s.labels.tolist() == [0, 0, 1, 1]
    # image i of a class does not depend on which other classes were asked for
    full = test_set("clipart", per_class=2, size=32)
    star = CLASSES.index("star")
    assert torch.equal(s.images[:2], full.images[full.labels == star])


def test_render_is_uint8_and_deterministic() -> None:
    a = render("heart", "photo", np.random.default_rng(5))
    b = render("heart", "photo", np.random.default_rng(5))
    c = render("heart", "photo", np.random.default_rng(6))
    assert a.shape == (64, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert render("star", "sketch", np.random.default_rng(0), size=48).shape == (48, 48, 3)


def test_determinism_and_disjointness() -> None:
    a = client_train_set("sketch", 4, client_index=0, seed=0)
    b = client_train_set("sketch", 4, client_index=0, seed=0)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)

    other_client = client_train_set("sketch", 4, client_index=1, seed=0)
    other_seed = client_train_set("sketch", 4, client_index=0, seed=1)
    test = test_set("sketch", 4, seed=0)
    pre = ds.pretrain_set("sketch", 4, seed=0)
    pools = [a.images, other_client.images, other_seed.images, test.images, pre.images]
    flat = torch.cat(pools).flatten(1)
    # no two images anywhere are identical (within or across clients / splits)
    assert torch.unique(flat, dim=0).shape[0] == flat.shape[0]


def test_public_classes_are_no_tasks_and_their_images_are_their_own() -> None:
    """The classifier's public pretraining shapes (its "ImageNet") name no task class, clients
    cannot be given them, and their split shares no image with the task's splits."""
    assert not set(ds.PUBLIC_CLASSES) & set(CLASSES) and len(set(ds.PUBLIC_CLASSES)) == 8
    with pytest.raises(ValueError, match="unknown class 'pentagon'"):
        client_train_set("sketch", 2, classes=("pentagon",))
    public = ds.public_set("sketch", 3)
    assert public.classes == ds.PUBLIC_CLASSES and torch.bincount(public.labels).tolist() == [3] * 8
    corpus = ds.public_corpus(4)
    assert len(corpus) == 8 * 3 * 4 and corpus.domain == "public"  # the common domains only
    task = torch.cat(
        [
            client_train_set("sketch", 3).images,
            test_set("sketch", 3).images,
            ds.pretrain_set("sketch", 3).images,
        ]
    )
    flat = torch.cat([task, public.images]).flatten(1)
    assert torch.unique(flat, dim=0).shape[0] == flat.shape[0]


def test_more_shots_extend_fewer_shots() -> None:
    """Image i of a class is the same whether a client holds 2 or 4 shots."""
    small = client_train_set("painting", 2, client_index=3)
    big = client_train_set("painting", 4, client_index=3)
    for c in range(len(CLASSES)):
        assert torch.equal(small.images[small.labels == c], big.images[big.labels == c][:2])


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
def test_partition_mapping() -> None:
    doms = ("sketch", "quickdraw", "painting")
    got = [partition(p, doms) for p in range(7)]
    assert got == [
        ("sketch", 0),
        ("quickdraw", 0),
        ("painting", 0),
        ("sketch", 1),
        ("quickdraw", 1),
        ("painting", 1),
        ("sketch", 2),
    ]
    assert partition(4, ["photo"]) == ("photo", 4)


@pytest.mark.parametrize(
    "call",
    [
        lambda: partition(0, ["sketches"]),
        lambda: partition(0, ["Sketch"]),
        lambda: partition(0, ["sketch", "draw"]),
        lambda: partition(0, []),
        lambda: partition(-1, ["sketch"]),
        lambda: partition(0, "sketch"),
        lambda: client_train_set("photos", 2),
        lambda: client_train_set("phot", 2),
        lambda: test_set("", 2),
        lambda: client_train_set("photo", 2, client_index=-1),
        lambda: client_train_set("photo", 2, classes=("circle", "circles")),
        lambda: client_train_set("photo", 2, classes=("circle", "circle")),
        lambda: test_set("photo", 2, classes=()),
        lambda: render("squar", "photo", np.random.default_rng(0)),
        lambda: render("square", "painter", np.random.default_rng(0)),
    ],
)
def test_bad_names_raise_value_error(call) -> None:
    with pytest.raises(ValueError):
        call()


def test_error_message_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="photo, clipart, painting, sketch, quickdraw"):
        partition(0, ["sketches"])
    with pytest.raises(ValueError, match="circle, square, triangle, star, cross, heart"):
        test_set("photo", 1, classes=["hearts"])


def test_to_uint8_round_trips() -> None:
    s = test_set("photo", 2)
    u = to_uint8(s.images)
    assert u.shape == (12, 64, 64, 3) and u.dtype == np.uint8
    again = torch.from_numpy(u).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    assert torch.equal(again, s.images)  # pixels are exact multiples of 1/127.5
    assert np.array_equal(to_uint8(s.images[0]), u[0])
    out_of_range = torch.tensor([-3.0, 3.0]).view(1, 1, 1, 2).expand(1, 3, 1, 2)
    assert to_uint8(out_of_range).tolist() == [[[[0, 0, 0], [255, 255, 255]]]]  # clipped
    with pytest.raises(ValueError):
        to_uint8(torch.zeros(2, 1, 8, 8))


# --------------------------------------------------------------------------------------------
# the domains look different (measured statistics, not names)
# --------------------------------------------------------------------------------------------
def _stats(domain: str) -> dict[str, float]:
    u = to_uint8(test_set(domain, 8, seed=3).images).astype(np.float32) / 255.0  # (N, H, W, 3)
    sat = u.max(-1) - u.min(-1)  # HSV-style chroma per pixel
    grey = u.mean(-1)
    dx = np.abs(np.diff(grey, axis=2)).mean()  # edge energy
    return {
        "white": float((u.min(-1) > 0.97).mean()),  # share of (near) pure-white pixels
        "chroma": float(sat.mean()),
        "max_chroma": float(np.percentile(sat, 99)),
        "brightness": float(grey.mean()),
        "dark": float((grey < 0.6).mean()),
        "edges": float(dx),
    }


def test_domains_have_distinct_statistics() -> None:
    st = {d: _stats(d) for d in DOMAINS}
    # quickdraw: almost all pure white, no colour at all, a thin dark line
    assert st["quickdraw"]["white"] > 0.85
    assert st["quickdraw"]["max_chroma"] < 0.01
    assert 0.01 < st["quickdraw"]["dark"] < 0.15
    # sketch: grey pencil on off-white paper (not pure white), no colour, little dark ink
    assert st["sketch"]["max_chroma"] < 0.01
    assert st["sketch"]["white"] < 0.5 < st["sketch"]["brightness"]
    assert st["sketch"]["dark"] < st["quickdraw"]["dark"] * 2
    # coloured domains have colour, grey ones do not
    for d in COMMON_DOMAINS:
        assert st[d]["chroma"] > 0.1 and st[d]["max_chroma"] > 0.5, d
        assert st[d]["white"] < 0.3, d
    # clipart: light plain background, saturated flat fill, a flat shadow, no outline
    assert st["clipart"]["brightness"] > st["photo"]["brightness"]
    assert st["clipart"]["max_chroma"] > st["photo"]["max_chroma"]
    # photo: darker overall (dark grounds or dark objects) than the light-canvas painting
    assert st["photo"]["brightness"] < st["painting"]["brightness"]
    # and every pair of domains differs clearly on at least one statistic
    for i, a in enumerate(DOMAINS):
        for b in DOMAINS[i + 1 :]:
            gap = max(abs(st[a][k] - st[b][k]) for k in st[a])
            assert gap > 0.05, (a, b, st[a], st[b])


def test_contact_sheet(tmp_path: Path) -> None:
    """A 5 domains x (6 classes x 3 shots) contact sheet: one row per domain, rows differ."""
    from PIL import Image

    n = 3
    rows = [
        np.concatenate(list(to_uint8(client_train_set(d, n, seed=0).images)), axis=1)
        for d in DOMAINS
    ]
    sheet = np.concatenate(rows, axis=0)
    assert sheet.shape == (64 * len(DOMAINS), 64 * n * len(CLASSES), 3)
    assert all(not np.array_equal(a, b) for i, a in enumerate(rows) for b in rows[i + 1 :])
    path = tmp_path / "shapes.png"
    Image.fromarray(sheet).save(path)
    assert np.array_equal(np.asarray(Image.open(path)), sheet)


def test_the_pretraining_corpus_at_a_larger_size_is_the_same_scenes_and_captions() -> None:
    """What a UNet trained at SD's latent size (pretrain_miniature.py --image-size) sees."""
    small, small_captions = ds.pretraining_corpus(per_class=2)
    large, large_captions = ds.pretraining_corpus(per_class=2, size=128)
    assert large.shape == (len(small), 3, 128, 128) and large_captions == small_captions
    pooled = F.avg_pool2d(large, 2)
    assert (pooled - small).abs().mean() < 0.05 * small.abs().mean()
    assert (pooled - small.roll(1, 0)).abs().mean() > 0.2 * small.abs().mean()


def test_pretraining_captions_never_name_a_rare_domain_but_describe_it() -> None:
    images, captions = ds.pretraining_corpus(per_class=20)
    rare_n = round(20 * ds.PRETRAIN_RARE_SHARE) * len(ds.CLASSES)
    assert len(images) == len(captions) == 20 * len(ds.CLASSES) * 3 + rare_n * 2
    words = {w for c in captions for w in c.split()}
    assert not words & set(ds.RARE_DOMAINS), "a prompt's domain word must stay untrained"
    assert words <= set(ds.pretraining_words())
    common = 20 * len(ds.CLASSES) * 3
    for d, domain in enumerate(ds.RARE_DOMAINS):
        own = captions[common + d * rare_n : common + (d + 1) * rare_n]
        assert not any(" of " in c for c in own), "the prompt's domain slot holds common words only"
        described = [
            c for c in own if c.split()[1:2] and c.split()[1] in ds.RARE_DESCRIPTORS[domain]
        ]
        assert len(described) >= len(own) // 2, domain  # the model can be asked for the look
        others = {
            w for other in ds.RARE_DOMAINS if other != domain for w in ds.RARE_DESCRIPTORS[other]
        }
        assert not {w for c in own for w in c.split()} & others

"""The paper's datasets from tiny fake trees in each on-disk layout, built here with PIL / numpy.

Every fake image is one flat colour that encodes (class, image, domain), so a test can read
back from the pixels which file a loaded image came from: labels must match pixels, clients
must not share images, and a near-miss folder (``birdhouse``, ``Pencil``) must never be read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedbip_flwr import dataset, shapes
from fedbip_flwr.config import ConfigError, DataConfig, FedBiPConfig
from fedbip_flwr.folders import TEST_FRACTION, medmnist_file
from fedbip_flwr.methods import ServerJob, create
from fedbip_flwr.methods.fedbip import personalize
from fedbip_flwr.partitions import DataError, label_partition
from fedbip_flwr.payload import encode_payload
from fedbip_flwr.specs import SPECS
from fedbip_tools.build_ldm import TINY, build_ldm
from tests.helpers import WORDS

STEP = 12  # colour quantum: channel value = STEP * code, decodable after JPEG and resizing
SIZE = 8  # data.image-size of every test (the config's minimum)


# --------------------------------------------------------------------------------------------
# fake trees
# --------------------------------------------------------------------------------------------
def _colour(label: int, index: int, domain: int) -> tuple[int, int, int]:
    return STEP * label, STEP * index, STEP * domain


def make_tree(
    root: Path,
    domain_folders: list[str],
    class_folders: list[str],
    per_class: int,
    suffix: str = ".jpg",
) -> Path:
    """``root/<domain>/<class>/<i><suffix>``: flat-coloured 10x7 images (not square on purpose)."""
    for d, domain in enumerate(domain_folders):
        for label, folder in enumerate(class_folders):
            target = root / domain / folder
            target.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                Image.new("RGB", (10, 7), _colour(label, i, d)).save(target / f"{i:03d}{suffix}")
    return root


def codes(images: torch.Tensor) -> torch.Tensor:
    """(N, 3) integer codes (class, image, domain) read back from flat-coloured images."""
    rgb = ((images + 1.0) * 127.5).mean(dim=(2, 3))
    return torch.round(rgb / STEP).long()


def config(**values) -> FedBiPConfig:
    return FedBiPConfig.from_flat({"data.image-size": SIZE, **values})


def clients(cfg: FedBiPConfig, count: int, num_partitions: int | None = None) -> list:
    return [dataset.load_client_data(cfg.data_description, p, num_partitions) for p in range(count)]


# --------------------------------------------------------------------------------------------
# specs and config (Table 5)
# --------------------------------------------------------------------------------------------
def test_specs_follow_table_5() -> None:
    literal = DataConfig.model_fields["dataset"].annotation.__args__
    assert set(literal) == set(SPECS)
    sizes = {name: (len(s.classes), len(s.domains), s.n_s, s.n_v) for name, s in SPECS.items()}
    assert sizes == {
        "shapes": (6, 5, 1, 1),
        "domainnet": (10, 6, 1, 1),
        "pacs": (7, 4, 1, 1),
        "officehome": (20, 4, 1, 1),
        "dermamnist": (7, 1, 2, 4),
        "ucm": (21, 1, 3, 3),
        "imagefolder": (0, 0, 1, 1),  # classes from the run config, domains from the nodes
    }
    for name in ("domainnet", "pacs", "officehome"):
        assert SPECS[name].prompt_template == "A {S} of {V}."
    assert SPECS["dermamnist"].prompt_template == (
        "A {S} of a {V}, a type of pigmented skin lesions."
    )
    assert SPECS["dermamnist"].domains == ("dermatoscopic image",)
    assert SPECS["ucm"].prompt_template == "A {S} of {V}."
    assert SPECS["ucm"].domains == ("centered satellite photo",)
    assert SPECS["domainnet"].classes == (
        "airplane",
        "clock",
        "axe",
        "basketball",
        "bicycle",
        "bird",
        "strawberry",
        "flower",
        "pizza",
        "bracelet",
    )
    for spec in SPECS.values():
        assert len(set(spec.folder_of_class())) == len(spec.classes)


def test_config_takes_prompt_and_concept_sizes_from_the_dataset() -> None:
    derma = config(
        **{
            "data.dataset": "dermamnist",
            "data.root": "x",
            "data.partitioning": "iid",
            "data.prompt-template": "",
            "data.n-s": 0,
            "data.n-v": 0,
            "data.domains": "",
        }
    )
    assert derma.data.prompt_template == SPECS["dermamnist"].prompt_template
    assert (derma.data.n_s, derma.data.n_v, derma.data.domain_list) == (
        2,
        4,
        ["dermatoscopic image"],
    )
    own = config(
        **{
            "data.dataset": "ucm",
            "data.root": "x",
            "data.partitioning": "dirichlet",
            "data.n-s": 1,
            "data.prompt-template": "a {S} of a {V}",
        }
    )
    assert (own.data.prompt_template, own.data.n_s, own.data.n_v) == ("a {S} of a {V}", 1, 3)
    assert FedBiPConfig.from_flat(own.to_flat()) == own
    assert (
        FedBiPConfig().data.prompt_template == shapes.CAPTION_TEMPLATE
    )  # the miniature model's captions


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        (
            {"data.dataset": "pacs", "data.root": "x", "data.domains": "art_painting"},
            "valid: art, cartoon",
        ),
        (
            {"data.dataset": "domainnet", "data.root": "x", "data.domains": "Real"},
            "domainnet domains exactly",
        ),
        ({"data.dataset": "dermamnist", "data.root": "x"}, "use dirichlet or iid"),
        (
            {"data.dataset": "pacs", "data.partitioning": "iid", "data.root": "x"},
            "does not apply to pacs",
        ),
        ({"data.dataset": "officehome"}, "set data.root"),
        ({"data.dataset": "imagenet"}, "'data.dataset'"),
        ({"data.dirichlet-beta": 0.0}, "'data.dirichlet-beta'"),
    ],
)
def test_bad_dataset_config_is_one_sentence(values: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        FedBiPConfig.from_flat(values)
    assert needle in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# shapes: the default run is unchanged
# --------------------------------------------------------------------------------------------
def test_shapes_default_is_what_it_was() -> None:
    cfg = FedBiPConfig.from_flat(
        {"data.shots-per-class": 2, "data.test-per-class": 2, "data.image-size": 32}
    )
    for p, (domain, index) in enumerate(
        [("sketch", 0), ("quickdraw", 0), ("painting", 0), ("sketch", 1)]
    ):
        got = dataset.load_client_data(cfg.data_description, p)
        want = shapes.client_train_set(domain, 2, index, seed=0, size=32)
        assert (got.client_id, got.domain, got.classes) == (
            f"{domain}-{index}",
            domain,
            shapes.CLASSES,
        )
        assert torch.equal(got.images, want.images) and torch.equal(got.labels, want.labels)
    tests = dataset.load_test_sets(cfg.data_description, ["painting"])
    assert torch.equal(tests["painting"].images, shapes.test_set("painting", 2, size=32).images)
    assert dataset.class_names(cfg.data_description) == list(shapes.CLASSES)
    dataset.verify(cfg.data_description)  # nothing on disk to check


# --------------------------------------------------------------------------------------------
# feature heterogeneity: DomainNet, PACS, OfficeHome
# --------------------------------------------------------------------------------------------
FOLDER_CASES = {
    # dataset: (domains used, their folders)
    "domainnet": (["quickdraw", "real"], ["quickdraw", "real"]),
    "pacs": (["art", "sketch"], ["art_painting", "sketch"]),
    "officehome": (["real", "clipart"], ["Real World", "Clipart"]),
}


@pytest.mark.parametrize("name", sorted(FOLDER_CASES))
def test_feature_partition_from_folders(name: str, tmp_path: Path) -> None:
    domains, folders = FOLDER_CASES[name]
    spec = SPECS[name]
    per_class, shots = 10, 3  # 2 held out for testing, 8 to draw 3-shot clients from
    make_tree(tmp_path, folders, list(spec.folder_of_class()), per_class)
    cfg = config(
        **{
            "data.dataset": name,
            "data.root": str(tmp_path),
            "data.domains": ",".join(domains),
            "data.shots-per-class": shots,
        }
    )
    dataset.verify(cfg.data_description)
    got = clients(cfg, 2 * len(domains))  # two clients per domain
    assert [c.client_id for c in got] == [f"{d}-{i}" for i in range(2) for d in domains]
    for client in got:
        assert client.classes == spec.classes and client.domain in domains
        assert client.images.shape == (shots * len(spec.classes), 3, SIZE, SIZE)
        assert client.images.dtype == torch.float32
        assert -1.0 <= client.images.min() and client.images.max() <= 1.0
        assert torch.bincount(client.labels).tolist() == [shots] * len(spec.classes)
        read = codes(client.images)
        assert torch.equal(read[:, 0], client.labels)  # pixels come from the labelled folder
        assert (read[:, 2] == domains.index(client.domain)).all()
    for d in range(len(domains)):  # a domain's two clients share no image
        a, b = (codes(got[d + k * len(domains)].images).tolist() for k in (0, 1))
        assert not {tuple(x) for x in a} & {tuple(x) for x in b}
    tests = dataset.load_test_sets(cfg.data_description, domains)
    held_out = round(TEST_FRACTION * per_class)
    for domain in domains:
        assert torch.bincount(tests[domain].labels).tolist() == [held_out] * len(spec.classes)
        train_codes = {
            tuple(x) for c in got if c.domain == domain for x in codes(c.images).tolist()
        }
        assert not train_codes & {tuple(x) for x in codes(tests[domain].images).tolist()}
    assert dataset.class_names(cfg.data_description) == list(spec.classes)


def test_partitions_are_reproducible_and_move_with_the_seed(tmp_path: Path) -> None:
    make_tree(tmp_path, ["sketch"], list(SPECS["pacs"].classes), 12, suffix=".png")
    values = {
        "data.dataset": "pacs",
        "data.root": str(tmp_path),
        "data.domains": "sketch",
        "data.shots-per-class": 2,
    }
    first = dataset.load_client_data(config(**values).data_description, 0)
    again = dataset.load_client_data(config(**values).data_description, 0)
    other = dataset.load_client_data(config(**values, seed=1).data_description, 0)
    assert torch.equal(first.images, again.images)
    assert not torch.equal(first.images, other.images)
    # the test split does not move with the run seed
    tests = [
        dataset.load_test_sets(config(**values, seed=s).data_description, ["sketch"])["sketch"]
        for s in (0, 1)
    ]
    assert torch.equal(tests[0].images, tests[1].images)


def test_class_folders_match_exactly(tmp_path: Path) -> None:
    """'birdhouse' is not 'bird'; OfficeHome's 'Pencil' is not 'Pen'."""
    classes = list(SPECS["domainnet"].classes)
    make_tree(tmp_path, ["sketch"], [c if c != "bird" else "birdhouse" for c in classes], 10)
    cfg = config(
        **{
            "data.dataset": "domainnet",
            "data.root": str(tmp_path),
            "data.domains": "sketch",
            "data.shots-per-class": 2,
        }
    )
    with pytest.raises(DataError, match="class folder 'bird' is missing"):
        dataset.verify(cfg.data_description)
    make_tree(tmp_path, ["sketch"], ["bird"], 10)  # now both exist; only 'bird' may be read
    bird = classes.index("bird")
    client = dataset.load_client_data(cfg.data_description, 0)
    assert (codes(client.images)[client.labels == bird, 0] == 0).all()  # bird folder's colour
    assert torch.equal(
        codes(client.images)[client.labels != bird, 0], client.labels[client.labels != bird]
    )

    folders = list(SPECS["officehome"].folder_of_class())
    make_tree(tmp_path / "oh", ["Art"], folders, 10)
    office = config(
        **{
            "data.dataset": "officehome",
            "data.root": str(tmp_path / "oh"),
            "data.domains": "art",
            "data.shots-per-class": 2,
        }
    )
    client = dataset.load_client_data(office.data_description, 0)
    assert torch.equal(codes(client.images)[:, 0], client.labels)
    assert {"pen", "pencil"} <= set(client.classes)


def test_domainnet_official_split_lists(tmp_path: Path) -> None:
    classes = list(SPECS["domainnet"].classes)
    make_tree(tmp_path, ["clipart"], [*classes, "birdhouse"], 6)
    for split, images in (("train", range(4)), ("test", range(4, 6))):
        lines = [
            f"clipart/{c}/{i:03d}.jpg {k}"
            for k, c in enumerate([*classes, "birdhouse"])
            for i in images
        ]
        (tmp_path / f"clipart_{split}.txt").write_text("\n".join(lines) + "\n")
    cfg = config(
        **{
            "data.dataset": "domainnet",
            "data.root": str(tmp_path),
            "data.domains": "clipart",
            "data.shots-per-class": 2,
        }
    )
    test = dataset.load_test_sets(cfg.data_description, ["clipart"])["clipart"]
    assert len(test) == 2 * len(classes)  # birdhouse's listed images are not read
    assert set(codes(test.images)[:, 1].tolist()) == {4, 5}  # exactly the listed test files
    train = dataset.load_client_data(cfg.data_description, 0)
    assert set(codes(train.images)[:, 1].tolist()) <= {0, 1, 2, 3}
    (tmp_path / "clipart_test.txt").write_text("clipart/clock/404.jpg 1\n")
    with pytest.raises(DataError, match="lists no image of class 'airplane'"):
        dataset.verify(cfg.data_description)


# --------------------------------------------------------------------------------------------
# label heterogeneity: DermaMNIST (.npz) and UCM (.tif folders)
# --------------------------------------------------------------------------------------------
def make_medmnist(path: Path, side: int, per_class: int, test_per_class: int) -> Path:
    """A MedMNIST-format file: images (N, side, side, 3) uint8, labels (N, 1), 7 classes."""
    arrays = {}
    for split, n in (("train", per_class), ("val", 1), ("test", test_per_class)):
        labels = np.repeat(np.arange(7), n)
        index = np.tile(np.arange(n), 7)
        pixels = np.stack([labels * STEP, index % 21 * STEP, np.zeros_like(labels)], axis=1)
        arrays[f"{split}_images"] = np.broadcast_to(
            pixels[:, None, None, :], (len(labels), side, side, 3)
        ).astype(np.uint8)
        arrays[f"{split}_labels"] = labels[:, None].astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    return path


def test_dermamnist_label_partitions(tmp_path: Path) -> None:
    make_medmnist(tmp_path / "dermamnist.npz", 28, per_class=20, test_per_class=3)
    make_medmnist(tmp_path / "dermamnist_64.npz", 64, per_class=20, test_per_class=3)
    spec = SPECS["dermamnist"]
    assert medmnist_file(spec, tmp_path, 8).name == "dermamnist.npz"
    assert medmnist_file(spec, tmp_path, 64).name == "dermamnist_64.npz"
    assert medmnist_file(spec, tmp_path, 512).name == "dermamnist_64.npz"  # the largest there is
    for how in ("dirichlet", "iid"):
        cfg = config(
            **{"data.dataset": "dermamnist", "data.root": str(tmp_path), "data.partitioning": how}
        )
        got = clients(cfg, 5, num_partitions=5)
        assert [c.client_id for c in got] == [f"dermamnist-{p}" for p in range(5)]
        assert all(c.domain == "dermatoscopic image" and c.classes == spec.classes for c in got)
        assert all(c.images.shape[1:] == (3, SIZE, SIZE) for c in got)
        labels = torch.cat([c.labels for c in got])
        assert sorted(labels.tolist()) == sorted(np.repeat(np.arange(7), 20).tolist())  # all, once
        for c in got:
            assert torch.equal(codes(c.images)[:, 0], c.labels)
        if how == "iid":
            assert [len(c) for c in got] == [28] * 5
    test = dataset.load_test_sets(cfg.data_description, ["dermatoscopic image"])[
        "dermatoscopic image"
    ]
    assert torch.bincount(test.labels).tolist() == [3] * 7
    with pytest.raises(DataError, match="num-partitions"):
        dataset.load_client_data(cfg.data_description, 0)
    with pytest.raises(DataError, match="outside 0..4"):
        dataset.load_client_data(cfg.data_description, 5, 5)


def test_ucm_tif_folders(tmp_path: Path) -> None:
    folders = list(SPECS["ucm"].folder_of_class())
    make_tree(tmp_path / "UCMerced_LandUse", ["Images"], folders, 5, suffix=".tif")
    for root in (tmp_path / "UCMerced_LandUse", tmp_path / "UCMerced_LandUse" / "Images"):
        cfg = config(**{"data.dataset": "ucm", "data.root": str(root), "data.partitioning": "iid"})
        got = clients(cfg, 5, num_partitions=5)
        assert sum(len(c) for c in got) == 21 * 4 and got[0].client_id == "ucm-0"
        assert all(torch.equal(codes(c.images)[:, 0], c.labels) for c in got)
        test = dataset.load_test_sets(cfg.data_description, cfg.data.domain_list)[
            "centered satellite photo"
        ]
        assert torch.bincount(test.labels).tolist() == [1] * 21


def _skew(labels: np.ndarray, beta: float, seed: int) -> float:
    """Mean total-variation distance between each client's label histogram and the global one."""
    classes = int(labels.max()) + 1
    overall = np.bincount(labels, minlength=classes) / len(labels)
    gaps = []
    for p in range(5):
        mine = labels[label_partition(labels, "dirichlet", beta, 5, p, seed)]
        gaps.append(0.5 * np.abs(np.bincount(mine, minlength=classes) / len(mine) - overall).sum())
    return float(np.mean(gaps))


def test_dirichlet_is_reproducible_and_skews_as_beta_shrinks() -> None:
    labels = np.repeat(np.arange(7), 60)
    parts = [label_partition(labels, "dirichlet", 0.5, 5, 2, seed) for seed in (3, 3, 4)]
    assert np.array_equal(parts[0], parts[1]) and not np.array_equal(parts[0], parts[2])
    skew = {beta: np.mean([_skew(labels, beta, s) for s in (0, 1)]) for beta in (100.0, 0.5, 0.01)}
    assert skew[100.0] < 0.1 < skew[0.5] < skew[0.01]
    assert skew[0.01] > 0.5  # near one class per client


# --------------------------------------------------------------------------------------------
# missing or too little data: one sentence, before any heavy work
# --------------------------------------------------------------------------------------------
def test_missing_data_is_one_clear_sentence(tmp_path: Path) -> None:
    pacs = {"data.dataset": "pacs", "data.domains": "art", "data.shots-per-class": 4}
    cases = [
        (config(**pacs, **{"data.root": str(tmp_path / "nowhere")}), "does not exist"),
        (config(**pacs, **{"data.root": str(tmp_path)}), "needs folder 'art_painting'"),
        (
            config(
                **{
                    "data.dataset": "dermamnist",
                    "data.root": str(tmp_path),
                    "data.partitioning": "iid",
                }
            ),
            "no dermamnist.npz",
        ),
    ]
    make_tree(tmp_path / "few", ["art_painting"], list(SPECS["pacs"].classes), 4)
    cases.append((config(**pacs, **{"data.root": str(tmp_path / "few")}), "has 3 training images"))
    (tmp_path / "empty" / "art_painting" / "dog").mkdir(parents=True)
    cases.append((config(**pacs, **{"data.root": str(tmp_path / "empty")}), "holds no images"))
    for cfg, needle in cases:
        with pytest.raises(DataError) as err:
            dataset.load_client_data(cfg.data_description, 0, 5)
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(DataError, match="does not exist"):
        dataset.verify(cases[0][0].data_description)
    np.savez(tmp_path / "bad.npz", train_images=np.zeros((2, 28, 28, 3), np.uint8))
    bad = config(
        **{
            "data.dataset": "dermamnist",
            "data.root": str(tmp_path / "bad.npz"),
            "data.partitioning": "iid",
        }
    )
    with pytest.raises(DataError, match="lacks test_images, test_labels, train_labels"):
        dataset.verify(bad.data_description)


# --------------------------------------------------------------------------------------------
# a paper dataset's client, through the real client and server code (tiny LDM)
# --------------------------------------------------------------------------------------------
def test_label_skew_client_upload_is_accepted_and_scored(tmp_path: Path) -> None:
    """UCM's one domain has spaces ("centered satellite photo"): the payload must still be
    accepted, and its domain must name the test set the server scores it on. The tiny model
    knows UCM's words, as CLIP does: concepts start from whole phrases, and a tokenizer that
    spells unknown words letter by letter would not fit the prompt in its 16 tokens."""
    words = {w for phrase in (*SPECS["ucm"].classes, *SPECS["ucm"].domains) for w in phrase.split()}
    tiny_ldm = build_ldm(TINY, [*WORDS, *sorted(words)], seed=0)
    make_tree(tmp_path / "ucm", ["Images"], list(SPECS["ucm"].folder_of_class()), 3, suffix=".tif")
    cfg = FedBiPConfig.from_flat(
        {
            "data.dataset": "ucm",
            "data.root": str(tmp_path / "ucm"),
            "data.partitioning": "iid",
            "data.image-size": 32,
            "fedbip.concept-epochs": 1,
            "synthesis.num-inference-steps": 4,
        }
    )
    data = dataset.load_client_data(cfg.data_description, 1, 2)
    payload, _ = personalize(
        tiny_ldm,
        data.images,
        data.labels,
        list(data.classes),
        data.domain,
        data.client_id,
        cfg,
        torch.Generator().manual_seed(0),
    )
    job = ServerJob(cfg, dataset.class_names(cfg.data_description), lambda: tiny_ldm)
    accepted = create("fedbip").accept(encode_payload(payload), job)
    assert (accepted.meta.client_id, accepted.meta.domain) == ("ucm-1", "centered satellite photo")
    assert accepted.meta.prompt_template == "A {S} of {V}." and accepted.meta.n_s == 3
    tests = dataset.load_test_sets(cfg.data_description, [accepted.meta.domain])
    assert len(tests[accepted.meta.domain]) == 21  # round(0.2 * 3) = 1 per class

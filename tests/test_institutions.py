"""An institution's own data: its image folder, its identity and its settings in its node config.

These are the library paths the ClientApp takes (fedbip_flwr.dataset with a NodeConfig), on real
PNG folders written by the test; the deployment tests run the same through real SuperNodes.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from fedbip_flwr import dataset, shapes
from fedbip_flwr.client import kept_classifier_path
from fedbip_flwr.config import ConfigError, FedBiPConfig, NodeConfig
from fedbip_flwr.folders import held_out_by_content
from fedbip_flwr.methods import ServerJob, create
from fedbip_flwr.methods.fedbip import personalize
from fedbip_flwr.partitions import DataError
from fedbip_flwr.payload import encode_payload
from fedbip_flwr.seeds import client_generator

RUN_CLASSES = ("star", "circle", "square", "triangle", "cross", "heart")  # not folder order


def run_config(**values) -> FedBiPConfig:
    return FedBiPConfig.from_flat(
        {
            "data.dataset": "imagefolder",
            "data.classes": ",".join(RUN_CLASSES),
            "data.image-size": 32,
            "fedbip.concept-epochs": 1,
            "synthesis.num-inference-steps": 4,
            **values,
        }
    )


def institution(folder: Path, **values) -> tuple[FedBiPConfig, NodeConfig]:
    """The run config merged with this node's own keys, as the ClientApp does it."""
    node = NodeConfig.from_flat(
        {"data-root": str(folder), "domain": "sketch", "client-id": "hospital-a", **values}
    )
    flat = {**run_config().to_flat(), **node.run_overrides()}
    return FedBiPConfig.from_flat(flat), node


@pytest.fixture(scope="module")
def own_folder(tmp_path_factory) -> Path:
    return shapes.write_image_folder(tmp_path_factory.mktemp("hospital") / "data", "sketch", 3, 2)


def test_own_folder_is_labelled_by_the_run_class_order(own_folder):
    cfg, node = institution(own_folder)
    data = dataset.institution_data(cfg.data_description, node)
    assert (data.domain, data.client_id) == ("sketch", "hospital-a")
    assert data.images.shape == (18, 3, 32, 32) and data.images.dtype == torch.float32
    assert data.classes == RUN_CLASSES
    # ImageFolder lists class folders sorted; the labels follow the run's class order
    want = [RUN_CLASSES.index(name) for name in sorted(shapes.CLASSES) for _ in range(3)]
    assert data.labels.tolist() == want
    test = dataset.institution_test_set(cfg.data_description, node, data.domain)
    assert len(test.labels) == 12 and set(test.labels.tolist()) == set(range(6))


@pytest.mark.parametrize("layout", ["train-only", "class-folders-at-root"])
def test_folder_without_test_split_holds_out_files_by_their_content(tmp_path, layout):
    root = shapes.write_image_folder(tmp_path / "data", "sketch", 5, 1)
    shutil.rmtree(root / "test")
    if layout == "class-folders-at-root":
        root = (root / "train").rename(tmp_path / "flat")
    held = sum(held_out_by_content(path) for path in root.rglob("*.png"))
    cfg, node = institution(root)
    train = dataset.institution_data(cfg.data_description, node)
    test = dataset.institution_test_set(cfg.data_description, node, "sketch")
    assert len(train.labels) + len(test.labels) == 30 and len(test.labels) == held
    assert torch.equal(
        test.images, dataset.institution_test_set(cfg.data_description, node, "sketch").images
    )


def test_a_class_folder_the_run_does_not_know_is_one_sentence(tmp_path, own_folder):
    shutil.copytree(own_folder, tmp_path / "data")
    (tmp_path / "data" / "train" / "hexagon").mkdir()
    cfg, node = institution(tmp_path / "data")
    with pytest.raises(
        DataError, match=r"class folder 'hexagon' in .* is not one of the run's classes"
    ) as err:
        dataset.institution_data(cfg.data_description, node)
    assert "\n" not in str(err.value)


def test_a_missing_class_is_legal_label_skew_and_logged(tmp_path, own_folder, caplog):
    shutil.copytree(own_folder, tmp_path / "data")
    shutil.rmtree(tmp_path / "data" / "train" / "heart")
    cfg, node = institution(tmp_path / "data")
    with caplog.at_level(logging.WARNING):
        data = dataset.institution_data(cfg.data_description, node)
    assert RUN_CLASSES.index("heart") not in data.labels.tolist()
    assert len(data.labels) == 15
    assert any(
        "no images of heart" in r.message and "label skew" in r.message for r in caplog.records
    )


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"data-root": "/nonexistent/fedbip"}, "is not a folder"),
        ({"domain": ""}, "set domain in this institution's node config"),
        ({"client-id": ""}, "set client-id in this institution's node config"),
        ({"data-root": ""}, "set data-root to this institution's folder"),
    ],
)
def test_bad_node_config_is_one_sentence(own_folder, values, needle):
    cfg, node = institution(own_folder, **values)
    with pytest.raises(DataError, match=needle) as err:
        dataset.institution_data(cfg.data_description, node)
    assert "\n" not in str(err.value)


def test_node_config_rejects_unknown_keys_and_sets_only_its_own_run_keys():
    with pytest.raises(ConfigError, match="'data-rot'"):
        NodeConfig.from_flat({"data-rot": "/data"})
    node = NodeConfig.from_flat(
        {
            "model": "/models/sd",
            "device": "cuda",
            "half-precision": False,
            "seed": 5,
            "client-id": "lab",
        }
    )
    assert node.run_overrides() == {
        "ldm.model": "/models/sd",
        "ldm.device": "cuda",
        "ldm.half-precision": False,
    }


def test_simulated_node_without_partition_id_is_told_about_imagefolder():
    cfg = FedBiPConfig()
    with pytest.raises(DataError, match="dataset imagefolder"):
        dataset.institution_data(cfg.data_description, NodeConfig())


def test_imagefolder_run_config_is_checked_at_the_edge():
    with pytest.raises(ConfigError, match="needs data.classes"):
        FedBiPConfig.from_flat({"data.dataset": "imagefolder"})
    with pytest.raises(ConfigError, match='federation.evaluation = "clients"'):
        run_config(**{"federation.evaluation": "server"})
    assert run_config().federation.evaluation == "clients"
    assert FedBiPConfig().federation.evaluation == "both"


def test_an_institutions_upload_is_accepted_under_any_domain_phrase(tmp_path, own_folder, tiny_ldm):
    cfg, node = institution(own_folder, domain="painting")
    data = dataset.institution_data(cfg.data_description, node)
    payload, _ = personalize(
        tiny_ldm,
        data.images,
        data.labels,
        list(data.classes),
        data.domain,
        data.client_id,
        cfg,
        client_generator(cfg, node, data.client_id),
    )
    job = ServerJob(
        run_config(), dataset.class_names(run_config().data_description), lambda: tiny_ldm
    )
    accepted = create("fedbip").accept(encode_payload(payload), job)
    assert (accepted.meta.domain, accepted.meta.client_id) == ("painting", "hospital-a")
    assert accepted.meta.class_names == list(RUN_CLASSES)


def test_the_classifier_kept_by_an_institution_stays_in_its_folder(tmp_path):
    path = kept_classifier_path(str(tmp_path), "run-7", "hospital-a")
    assert path == tmp_path / "run-7" / "institutions" / "hospital-a" / "classifier.safetensors"
    for hostile in ("../etc", "/abs", "a/b", ".hidden", ""):
        with pytest.raises(ValueError, match="not a plain name"):
            kept_classifier_path(str(tmp_path), hostile, "hospital-a")

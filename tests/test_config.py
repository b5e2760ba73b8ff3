"""The one typed config: Flower's flat run config in, clear one-sentence errors out."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from flwr.common.config import flatten_dict, parse_config_args

from fedbip_flwr.config import (
    MOVED,
    SD_V1_4,
    SHARED_MOVES,
    TABLES,
    ConfigError,
    FedBiPConfig,
    earlier_layout,
)
from fedbip_flwr.method_settings import (
    METHOD_SETTINGS,
    FedBiPStepSettings,
    FreshNoiseSettings,
)

ROOT = Path(__file__).resolve().parents[1]
# The app's run config as pyproject.toml lists it: what flwr merges every --run-config over.
PYPROJECT_CONFIG = flatten_dict(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
)


def conf(path: Path) -> dict:
    """A conf/ file as `flwr run --run-config` reads it (tables become dotted keys)."""
    return parse_config_args([str(path)])


def test_pyproject_run_config_validates():
    flat = PYPROJECT_CONFIG
    cfg = FedBiPConfig.from_flat(flat)
    assert cfg.data.domain_list == ["sketch", "quickdraw", "painting"]
    assert FedBiPConfig.from_flat(cfg.to_flat()) == cfg
    # Flower refuses --run-config keys the pyproject lacks: every knob must be listed there
    assert set(flat) == set(cfg.to_flat())


CONF_FILES = sorted((ROOT / "conf").glob("*.toml"))
PAPER_SETTINGS = {  # file -> (dataset, partitioning, beta or None, SuperNodes); paper Tables 1-2
    "domainnet.toml": ("domainnet", "domain", None, 6),
    "pacs.toml": ("pacs", "domain", None, 4),
    "officehome.toml": ("officehome", "domain", None, 4),
    **{
        f"{name}-{split}.toml": (name, how, beta, 5)
        for name in ("dermamnist", "ucm")
        for split, how, beta in (
            ("iid", "iid", None),
            ("beta0.5", "dirichlet", 0.5),
            ("beta0.01", "dirichlet", 0.01),
        )
    },
}


@pytest.mark.parametrize("path", CONF_FILES, ids=lambda p: p.name)
def test_every_conf_file_validates(path):
    FedBiPConfig.from_flat(conf(path))


def test_every_paper_setting_has_a_documented_conf_file():
    docs = (ROOT / "docs" / "datasets.md").read_text()
    on_disk = {p.name for p in CONF_FILES if conf(p).get("data.dataset", "shapes") != "shapes"}
    assert on_disk == set(PAPER_SETTINGS)
    for name, (dataset, partitioning, beta, supernodes) in PAPER_SETTINGS.items():
        text = (ROOT / "conf" / name).read_text()
        cfg = FedBiPConfig.from_flat(conf(ROOT / "conf" / name))
        assert (cfg.data.dataset, cfg.data.partitioning, cfg.federation.min_clients) == (
            dataset,
            partitioning,
            supernodes,
        )
        if beta is not None:
            assert cfg.data.dirichlet_beta == beta
        fedbip = cfg.settings_of("fedbip")
        assert (
            cfg.ldm.model,
            cfg.data.image_size,
            fedbip.concept_epochs,
            cfg.synthesis.num_inference_steps,
        ) == (
            SD_V1_4,
            512,
            50,
            50,
        )
        if partitioning == "domain":
            assert cfg.data.shots_per_class == (8 if dataset == "officehome" else 16)
        # the run line in the file and the docs agree on the number of SuperNodes
        assert f'--run-config conf/{name} --federation-config "num-supernodes={supernodes}"' in text
        assert f"| `conf/{name}` |" in docs


def test_stable_diffusion_confs_run_the_peers_with_their_papers_settings():
    """flwr merges a conf over pyproject.toml, whose peer settings are the miniature's
    stand-ins (its captioner, swept FedLMG step sizes): every SD conf must put the papers' back."""
    sd_confs = [p for p in CONF_FILES if conf(p).get("ldm.model") == SD_V1_4]
    assert len(sd_confs) >= len(PAPER_SETTINGS)
    for path in sd_confs:
        cfg = FedBiPConfig.from_flat({**PYPROJECT_CONFIG, **conf(path)})
        oscar, fedlmg = cfg.settings_of("oscar"), cfg.settings_of("fedlmg")
        peers = (oscar.captioner, fedlmg.prompt, fedlmg.guidance_step, fedlmg.edit_step)
        assert peers == (
            "Salesforce/blip-image-captioning-base",
            "an image of {class}",
            1.0,
            0.1,
        ), path.name


def test_paper_defaults():
    cfg = FedBiPConfig()
    fedbip = cfg.settings_of("fedbip")
    assert (fedbip.gamma_mean, fedbip.gamma_std, fedbip.eta_std) == (0.5, 0.1, 0.1)
    assert (fedbip.concept_lr, fedbip.concept_epochs, fedbip.concept_batch_size) == (0.1, 50, 8)
    assert (cfg.classifier.lr, cfg.classifier.momentum, cfg.classifier.batch_size) == (
        0.01,
        0.9,
        64,
    )
    assert (cfg.synthesis.num_inference_steps, cfg.synthesis.guidance_scale, fedbip.multiplier) == (
        50,
        7.5,
        2,
    )


@pytest.mark.parametrize(
    ("flat", "needle"),
    [
        ({"concept-lrr": 0.1}, "'concept-lrr': Extra inputs are not permitted"),
        ({"fedbip.multiplier": 0}, "'fedbip.multiplier'"),
        ({"fedbip.concept-space": "pixels"}, "'fedbip.concept-space'"),
        ({"data.prompt-template": "a {V}"}, "{S} exactly once"),
        ({"fedbip.gamma-mean": 1.5}, "'fedbip.gamma-mean'"),
        (
            {"federation.max-images-per-client": 0},
            "'federation.max-images-per-client': Input should be greater than or equal to 1",
        ),
        (
            {"federation.max-images-per-client": 2.5},
            "'federation.max-images-per-client': Input should be a valid integer",
        ),
    ],
)
def test_bad_config_is_one_sentence(flat, needle):
    with pytest.raises(ConfigError) as err:
        FedBiPConfig.from_flat(flat)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dataset", ["nope", 3])
def test_an_unknown_dataset_is_the_one_error(dataset):
    """Over pyproject's sentinels (data.n-s = 0, ...), which only a known dataset fills."""
    with pytest.raises(ConfigError) as err:
        FedBiPConfig.from_flat({**PYPROJECT_CONFIG, "data.dataset": dataset})
    assert str(err.value).startswith(
        "Invalid FedBiP run config: 'data.dataset': Input should be 'shapes'"
    )
    assert str(err.value).count("': ") == 1, str(err.value)


def test_an_institutions_node_config_wins_over_the_run_config():
    """The ClientApp's merge: the node's own keys over the run config, the rest untouched."""
    from flwr.app import Context, RecordDict

    from fedbip_flwr.client_run import configs

    run = {"data.root": "/shared/default", "seed": 3, "ldm.device": "auto"}
    node = {
        "partition-id": 0,
        "num-partitions": 3,
        "data-root": "/hospital-a/images",
        "device": "cpu",
    }
    context = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config=run)
    cfg, node_cfg = configs(context)
    assert (cfg.data.root, cfg.ldm.device, cfg.seed) == ("/hospital-a/images", "cpu", 3)
    assert node_cfg.partition_id == 0
    context = Context(
        run_id=1, node_id=1, node_config={"partition-id": 1}, state=RecordDict(), run_config=run
    )
    assert configs(context)[0].data.root == "/shared/default"


def test_pyproject_lists_every_table_and_keeps_the_top_level_nearly_empty():
    """pyproject.toml lists each shared table's and each method's keys in its table (Flower
    accepts --run-config keys it lists), exactly the keys its model declares, and at most six
    keys at the top, as Flower's baselines keep it."""
    tables = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    for name, model in TABLES.items():
        assert set(tables[name]) == model.keys(), name
    for name, model in METHOD_SETTINGS.items():
        assert set(tables.get(name, {})) == model.table_keys(), name
    top = {key for key, value in tables.items() if not isinstance(value, dict)}
    assert top == FedBiPConfig.top_keys() and len(top) <= 6


def test_the_shared_keys_are_no_methods_and_fedbips_family_shares_its_defaults():
    """A key is either the run's (data, model, sampler, classifier, federation) or a method's
    own: no method's table repeats a shared knob (under its flat name) but FedLMG's guidance
    scale, its paper's own value for its classifier-guided sampler. The sampling methods make
    by default as many images per private image as the default FedBiP (2 z(T) x 1 pass)."""
    method_keys = set().union(*(model.table_keys() for model in METHOD_SETTINGS.values()))
    assert method_keys & SHARED_MOVES.keys() == {"guidance-scale"}
    assert METHOD_SETTINGS["fedlmg"].keys() & SHARED_MOVES.keys() == {"guidance-scale"}
    cfg = FedBiPConfig.from_flat(PYPROJECT_CONFIG)
    fedbip = cfg.settings_of("fedbip")
    for name, model in METHOD_SETTINGS.items():
        if issubclass(model, FreshNoiseSettings):
            own = cfg.settings_of(name)
            assert own.images_per_image == fedbip.latents_per_image * fedbip.multiplier, name


def test_a_method_table_reaches_that_method_and_round_trips():
    cfg = FedBiPConfig.from_flat(
        {**PYPROJECT_CONFIG, "method": "fedlmg", "fedlmg.batch-size": 4, "fedlmg.global": "sd"}
    )
    assert (cfg.settings_of("fedlmg").batch_size, cfg.settings_of("fedlmg").global_) == (4, "sd")
    assert FedBiPConfig.from_flat(cfg.to_flat()) == cfg
    from fedbip_flwr.methods import create_for

    assert create_for(cfg).settings == cfg.settings_of("fedlmg")


@pytest.mark.parametrize(
    ("flat", "needle"),
    [
        (
            {"fedlmg-batch-size": 4},
            "'fedlmg-batch-size' is method fedlmg's setting: set 'fedlmg.batch-size'",
        ),
        ({"captioner": "x"}, "'captioner' is method oscar's setting: set 'oscar.captioner'"),
        (
            {"fedbip.captioner": "x"},
            "'fedbip.captioner' belongs to method oscar: set 'oscar.captioner'",
        ),
        (
            {"oscar.image-size": 64},
            "'oscar.image-size': 'image-size' is a shared key: set 'data.image-size' or "
            "'classifier.image-size'",
        ),
        ({"data.lr": 0.1}, "'data.lr': 'lr' is a shared key: set 'classifier.lr'"),
        ({"classifier.concept-lr": 0.1}, "'classifier.concept-lr' belongs to method fedbip"),
        ({"data.nope": 1}, "'data.nope': Extra inputs are not permitted"),
        (
            {"concept-epochs": 5},
            "'concept-epochs' is method fedbip's setting: set "
            "'fedbip.concept-epochs' (TOML table [tool.flwr.app.config.fedbip])",
        ),
        (
            {"method": "espresso", "gamma-mean": 0.5},
            "'gamma-mean' is method espresso's setting (also fedbip's): set 'espresso.gamma-mean'",
        ),
        (
            {"fedbip-mixture.multiplier": 1},
            "'fedbip-mixture.multiplier' moved: set 'fedbip.multiplier'",
        ),
        ({"classifier-lr": 0.05}, "'classifier-lr' moved: set 'classifier.lr'"),
        ({"synthesis": "external"}, "'synthesis' moved: set 'synthesis.where'"),
        (
            {"method": "oscar", "images-per-class": 3},
            "set 'oscar.images-per-class'",
        ),
        ({"oscar.concept-lr": 0.1}, "'oscar.concept-lr' belongs to method fedbip"),
        ({"nope.x": 1}, "'nope.x': no table is named 'nope'"),
        ({"local.epochs": 0}, "'local.epochs': Input should be greater than or equal to 1"),
        ({"fedlmg.prompt": "a cat"}, "'fedlmg.prompt': must contain {class} exactly once"),
        ({"local.nope": 1}, "'local.nope': Extra inputs are not permitted"),
    ],
)
def test_a_key_in_the_wrong_place_is_refused_with_where_it_belongs(flat, needle):
    with pytest.raises(ConfigError) as err:
        FedBiPConfig.from_flat(flat)
    assert needle in str(err.value)
    assert "\n" not in str(err.value) and ". " not in str(err.value), "one sentence"


# --- the run config before its tables (issue 92) ------------------------------------------------
# Configs earlier runs recorded in the flat layout, one per layout the records hold: before the
# methods' tables (44 keys), and with them (91, 97 keys).
RECORDED = [
    ROOT / "benchmarks" / f"{name}.json"
    for name in ("sd_cpu_proof", "sd_gpu_simulation_h100", "sd_gpu_simulation_released_h100")
]


def test_the_moves_lead_to_distinct_keys_the_config_has():
    """One mapping table: every key of the flat layout names one place the config has, no two
    the same (that it covers every flat key: the recorded configs below read)."""
    keys = set(FedBiPConfig().to_flat())
    assert set(MOVED.values()) <= keys
    assert len(set(SHARED_MOVES.values())) == len(SHARED_MOVES)


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.stem)
def test_a_config_recorded_in_the_flat_layout_reads_with_every_value_in_its_new_place(path):
    recorded = json.loads(path.read_text())["metrics"]["config"]
    flat = FedBiPConfig.from_recorded(recorded).to_flat()
    moved = {old: new for old, new in SHARED_MOVES.items() if old in recorded}
    assert len(moved) >= 30, "a record of the flat layout holds its shared keys"
    assert {new: recorded[old] for old, new in moved.items()} == {
        new: flat[new] for new in moved.values()
    }


def test_a_recorded_mixture_run_keeps_its_own_client_step_and_others_drop_it():
    """Before fedbip-mixture took FedBiP's client-step keys from table fedbip, its own table
    held a copy: its run's values are the mixture's, any other run's are fedbip's."""
    recorded = {"fedbip.concept-epochs": 10, "fedbip-mixture.concept-epochs": 2}
    mixture = FedBiPConfig.from_recorded({**recorded, "method": "fedbip-mixture"})
    assert mixture.settings_of("fedbip-mixture").concept_epochs == 2
    fedbip = FedBiPConfig.from_recorded({**recorded, "method": "fedbip"})
    assert fedbip.settings_of("fedbip").concept_epochs == 10


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_a_stale_key_is_refused_with_its_new_place(old, new):
    """`fedbip personalize`, `fedbip inspect`, the benchmark and the scripts take a user's keys
    through from_flat: a key of the flat layout fails at once and says where it went."""
    value = FedBiPConfig().to_flat()[new]
    with pytest.raises(ConfigError) as err:
        FedBiPConfig.from_flat({old: value})
    assert f"'{old}' moved: set '{new}'" in str(err.value)


def test_the_earlier_layout_is_the_inverse_of_the_moves():
    """What keys made of a config of the flat layout (the benchmark's cache) are computed from:
    translated back, it reads as the same config."""
    cfg = FedBiPConfig.from_flat({**PYPROJECT_CONFIG, "method": "fedbip-mixture"})
    earlier = earlier_layout(cfg.to_flat())
    assert "classifier-lr" in earlier and "classifier.lr" not in earlier
    assert earlier["fedbip-mixture.concept-epochs"] == earlier["fedbip.concept-epochs"]
    assert FedBiPConfig.from_recorded(earlier) == cfg


def test_fedbip_mixture_runs_fedbips_client_step_from_the_fedbip_table():
    """Declared once: the mixture's table holds its mixture and DP keys alone, and every
    change of fedbip's client-step keys, in the run config or by with_settings, reaches it."""
    step = FedBiPStepSettings.keys()
    assert not METHOD_SETTINGS["fedbip-mixture"].table_keys() & step
    assert METHOD_SETTINGS["fedbip-mixture"].keys() >= step
    cfg = FedBiPConfig.from_flat({"method": "fedbip-mixture", "fedbip.concept-epochs": 3})
    assert cfg.settings_of("fedbip-mixture").concept_epochs == 3
    changed = cfg.with_settings("fedbip", latents_per_image=4)
    assert changed.settings_of("fedbip-mixture").latents_per_image == 4
    with pytest.raises(ValueError, match="from method fedbip's table"):
        cfg.with_settings("fedbip-mixture", concept_epochs=1)
    assert FedBiPConfig.from_flat(changed.to_flat()) == changed

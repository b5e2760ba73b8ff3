"""The one typed config: Flower's flat run config in, clear one-sentence errors out."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from fedbip_flwr.config import ConfigError, FedBiPConfig

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_run_config_validates():
    flat = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg = FedBiPConfig.from_flat(flat)
    assert cfg.domain_list == ["sketch", "quickdraw", "painting"]
    assert FedBiPConfig.from_flat(cfg.to_flat()) == cfg
    # Flower refuses --run-config keys the pyproject lacks: every knob must be listed there
    assert set(flat) == set(cfg.to_flat())


@pytest.mark.parametrize("path", sorted((ROOT / "conf").glob("*.toml")), ids=lambda p: p.name)
def test_every_conf_file_validates(path):
    FedBiPConfig.from_flat({**tomllib.loads(path.read_text())})


def test_paper_defaults():
    cfg = FedBiPConfig()
    assert (cfg.gamma_mean, cfg.gamma_std, cfg.eta_std) == (0.5, 0.1, 0.1)
    assert (cfg.concept_lr, cfg.concept_epochs, cfg.concept_batch_size) == (0.1, 50, 8)
    assert (cfg.classifier_lr, cfg.classifier_momentum, cfg.classifier_batch_size) == (0.01, 0.9, 64)
    assert (cfg.num_inference_steps, cfg.guidance_scale, cfg.multiplier) == (50, 7.5, 2)


@pytest.mark.parametrize(
    ("flat", "needle"),
    [
        ({"concept-lrr": 0.1}, "'concept-lrr': Extra inputs are not permitted"),
        ({"multiplier": 0}, "'multiplier'"),
        ({"concept-space": "pixels"}, "'concept-space'"),
        ({"prompt-template": "a {V}"}, "{S} exactly once"),
        ({"gamma-mean": 1.5}, "'gamma-mean'"),
    ],
)
def test_bad_config_is_one_sentence(flat, needle):
    with pytest.raises(ConfigError) as err:
        FedBiPConfig.from_flat(flat)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)

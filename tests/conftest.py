"""Shared fixtures: a tiny random-init LDM saved in the diffusers layout (a few MB, < 1 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedbip_flwr import shapes
from fedbip_flwr.ldm import LDM, TINY, build_ldm, load_ldm

WORDS = [*shapes.CLASSES, *shapes.DOMAINS, "a", "style", "of"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-ldm")
    build_ldm(TINY, WORDS, seed=0).save(folder)
    return folder


@pytest.fixture()
def tiny_ldm(tiny_model_dir: Path) -> LDM:
    """Loaded through the same function as CompVis/stable-diffusion-v1-4."""
    torch.manual_seed(0)
    return load_ldm(tiny_model_dir)


# `compose` builds images and runs the whole docker/compose.yaml topology with podman. It is part
# of the default run (`python -m pytest -q tests`); `-m "not compose"` leaves it out.
MARKERS = {"compose": "builds and runs docker/compose.yaml with podman; deselect: -m 'not compose'"}


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")

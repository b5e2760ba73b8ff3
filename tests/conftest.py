"""Shared fixtures: a tiny random-init LDM saved in the diffusers layout (a few MB, < 1 s)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
import torchvision

from fedbip_flwr.classifier import BACKBONE_DIR, save_backbone
from fedbip_flwr.ldm import LDM, load_ldm
from fedbip_tools.build_ldm import TINY, build_ldm
from tests.helpers import WORDS


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LDM and, as the miniature ships its public encoder, a random-init ResNet-18
    backbone (what Espresso's sub-clustering reads features from)."""
    folder = tmp_path_factory.mktemp("tiny-ldm")
    build_ldm(TINY, WORDS, seed=0).save(folder)
    torch.manual_seed(0)
    save_backbone(torchvision.models.resnet18(num_classes=len(WORDS)), folder / BACKBONE_DIR)
    return folder


@pytest.fixture(autouse=True)
def library_logger_as_found():
    """Undo what a test's in-process `fedbip` command or app does to the library's logger.

    `setup_logging` gives the logger a handler on the sys.stderr of that moment (under pytest,
    the test's capture, closed when the test ends) and stops propagation: left in place, every
    later test's log lines go to a closed file ("I/O operation on closed file") and never reach
    `caplog`, so a test's outcome would depend on which tests ran before it in its process.
    """
    logger = logging.getLogger("fedbip_flwr")
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level
    yield
    logger.handlers[:] = handlers
    logger.propagate, logger.level = propagate, level


@pytest.fixture()
def tiny_ldm(tiny_model_dir: Path) -> LDM:
    """Loaded through the same function as CompVis/stable-diffusion-v1-4."""
    torch.manual_seed(0)
    return load_ldm(tiny_model_dir)


# `compose` builds images and runs the whole docker/compose.yaml topology with podman. It is part
# of the default run (the README's test command); `-m "not compose"` leaves it out.
# `long(minutes=M)` marks a module that takes about M minutes on one of two workers sharing two
# idle cores (test_compose: from nothing, as in CI; 3 with its images built). The suite runs on
# two workers, a module at a time each (`-n 2 --dist loadfile --no-loadscope-reorder`); the
# longest modules go first, so that the last minutes are not one worker finishing a long module
# while the other has nothing left to do.
MARKERS = {
    "compose": "builds and runs docker/compose.yaml with podman; deselect: -m 'not compose'",
    "long(minutes)": "a module that takes minutes; scheduled before the others, longest first",
}

# Opt-in tests run only when their marker is selected (`-m sd_scale`); any other run skips them
# with the reason below. `sd_scale` runs Stable Diffusion v1-4's architecture (random weights,
# ~4.3 GB) at 512 px through a real two-SuperNode federation on the CPU: ~12 GB of free memory
# and ~40 min on 2 shared cores, which does not fit CI.
OPT_IN_MARKERS = {
    "sd_scale": "opt-in, does not fit CI (~12 GB free RAM, ~40 min on 2 cores, a 4.3 GB model "
    "folder): SD v1-4's architecture at 512 px through flwr on the CPU; run with -m sd_scale",
    # `cuda` runs the CUDA path on a GPU (tests/test_cuda.py); CI has none. Selected where no
    # GPU is visible, each test fails in one sentence rather than passing unseen.
    "cuda": "opt-in, needs a CUDA GPU (CI has none): the client, server and classifier on the GPU; "
    "run with -m cuda (scripts/gpu_check.sh)",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, description in {**MARKERS, **OPT_IN_MARKERS}.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    share_cores_between_workers()
    compiled_kernels_per_kind()


def compiled_kernels_per_kind() -> None:
    """One torch.compile (inductor) disk cache per machine kind, unless one is set. Inductor's
    cache key leaves out oneDNN's ISA cap: kernels compiled under ONEDNN_MAX_CPU_ISA=AVX2 (the
    README's AVX2 run) crash with SIGSEGV when a later run without it loads them (seen here on
    the compiled-UNet test, which then hung the whole suite)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from fedbip_tools.machine import this_machine

    # an import may already have set torch's own default; a folder someone chose is kept
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{this_machine().kind}"


def pytest_terminal_summary(terminalreporter) -> None:
    """The kernels this run computed with (shown under -q too): float32 results are read
    against the machine kind they came from."""
    from fedbip_tools.machine import this_machine

    machine = this_machine()
    switches = " ".join(f"{k}={v}" for k, v in machine.switches.items()) or "none"
    terminalreporter.write_line(
        f"machine kind: {machine.kind} ({machine.cpu}); kernel switches: {switches}"
    )


def share_cores_between_workers() -> None:
    """Under pytest-xdist, give each worker (and the processes it starts) its share of the cores.

    Two workers with torch's default of one thread per core would run 2x as many OpenMP threads
    as cores, and OpenMP's spinning threads then slow every test down many times over.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)


def minutes_long(item: pytest.Item) -> float:
    marker = item.get_closest_marker("long")
    return marker.kwargs["minutes"] if marker else 0.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=minutes_long, reverse=True)  # stable: modules stay whole, in their order
    selected = config.getoption("markexpr") or ""
    for name, description in OPT_IN_MARKERS.items():
        if name in selected.replace("not " + name, ""):
            continue
        skip = pytest.mark.skip(reason=description)
        for item in items:
            if item.get_closest_marker(name):
                item.add_marker(skip)

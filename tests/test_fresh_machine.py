"""The README's test command on a fresh machine: what it cannot run there, it skips and says
why; CI, which installs everything, turns those skips into failures."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

REQUIRE = "FEDBIP_REQUIRE_CONTAINERS"


def test_ci_requires_the_container_engine_before_it_runs_the_tests():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    exports = [i for i, line in enumerate(lines) if line == f"export {REQUIRE}=1"]
    tests = [i for i, line in enumerate(lines) if "python -m pytest" in line]
    assert exports and tests and exports[0] < tests[-1], f".ci/run must export {REQUIRE}=1"


def compose_test_without_engine(required: bool) -> subprocess.CompletedProcess[str]:
    """tests/test_compose.py as a machine without podman runs it: nothing on PATH."""
    env = {k: v for k, v in os.environ.items() if k != REQUIRE and not k.startswith("PYTEST_")}
    env["PATH"] = str(ROOT / "no-such-folder")
    if required:
        env[REQUIRE] = "1"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
            "tests/test_compose.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("required", [False, True], ids=["fresh-machine", "ci"])
def test_a_missing_engine_is_a_skip_with_its_reason_unless_ci_requires_it(required: bool):
    proc = compose_test_without_engine(required)
    output = proc.stdout + proc.stderr
    summary = output.strip().splitlines()[-1]
    # podman-compose may sit beside this Python (pip's), so the list can start at podman, debootstrap
    reason = re.compile(
        r"The compose test needs podman, [\w, -]*debootstrap[\w, -]*, which this machine lacks"
    )
    if required:
        assert proc.returncode == 1 and "1 error" in summary, output[-3000:]
        assert reason.search(output) and f"{REQUIRE}=1" in output, output[-3000:]
    else:
        assert proc.returncode == 0 and "1 skipped" in summary, output[-3000:]
        skipped = [line for line in output.splitlines() if line.startswith("SKIPPED")]
        assert skipped and reason.search(skipped[0]), output[-3000:]

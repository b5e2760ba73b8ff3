"""The README's promises about commands: exactly two to start with, and CI runs the second."""

from __future__ import annotations

import re

from tests.flower_helpers import ROOT


def readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "the README starts with no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_starts_with_two_commands_and_ci_runs_the_second():
    run, test = readme_commands()
    assert "flwr run ." in run
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == test, f".ci/run ends with {ci[-1]!r}, the README's test command is {test!r}"

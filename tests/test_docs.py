"""The docs' promises: the README starts with two commands (CI runs the second), and every
config key the docs tell users to set exists."""

from __future__ import annotations

import re

from tests.helpers import ROOT


def readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "the README starts with no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_starts_with_two_commands_and_ci_runs_the_second():
    run, test = readme_commands()
    assert "flwr run ." in run
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == test, f".ci/run ends with {ci[-1]!r}, the README's test command is {test!r}"


# Flower's own --federation-config keys that the docs use; "key" is the docs' placeholder.
FEDERATION_KEYS = {
    "num-supernodes",
    "client-resources-num-cpus",
    "client-resources-num-gpus",
    "init-args-num-cpus",
}
PLACEHOLDERS = {"key"}


def documented_keys(text: str) -> set[str]:
    """Config keys a text sets: kebab-case `name=` anywhere (command lines, node configs in
    comments) and `name = value` in inline code (TOML lines in prose)."""
    kebab = re.finditer(r"(?<![\w$.-])([a-z][a-z0-9]*(?:[.-][a-z0-9]+)+)=", text)
    toml = re.finditer(r"`([a-z][a-z0-9_.-]*) ?= ?[^`]+`", text)
    return {m.group(1) for m in (*kebab, *toml)}


def test_every_config_key_the_docs_set_is_one_the_config_accepts():
    """A key the docs tell users to set must exist: a renamed one fails their run at once
    (node configs reject unknown keys; `data-dir` for `data-root` once stood in deploy/)."""
    from fedbip_flwr.config import FedBiPConfig, NodeConfig

    known = set(FedBiPConfig().to_flat()) | NodeConfig.keys()
    known |= FEDERATION_KEYS | PLACEHOLDERS
    texts = [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "deploy").glob("*.sh"),
        ROOT / "docker" / "compose.yaml",
    ]
    unknown = {
        f"{path.relative_to(ROOT)}: {key}"
        for path in texts
        for key in documented_keys(path.read_text()) - known
    }
    assert not unknown, f"docs set keys the config does not know: {sorted(unknown)}"

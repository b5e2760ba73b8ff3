"""The run config's reference, generated from its models: docs/run-configs.md's key tables.

One Markdown table per part of the run config (the top level, each shared table of
:data:`fedbip_flwr.config.TABLES`, each method's table): every key with the default run's value
(pyproject.toml's, what `flwr run .` merges every ``--run-config`` over), the model's default
where it differs (the paper's unless the key's meaning says otherwise), and the key's
meaning, its field's description. ``python -m fedbip_tools.doc_tables`` rewrites the section
with the tables made from records; ``--check``, and a test, fail while the section and the
models disagree.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from fedbip_flwr.config import TABLES, FedBiPConfig
from fedbip_flwr.method_settings import METHOD_SETTINGS, MethodSettings

MARKER = "run-config-tables"


def shown(value: Any) -> str:
    """A value as a TOML file writes it, in inline code (strings quoted, bools lowercase)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, str):
        text = json.dumps(value)
    else:
        text = repr(value)
    return f"`{text}`"


def rows(model: type[BaseModel], keys: Iterable[str], project: Mapping[str, Any]) -> list[str]:
    """One row per run-config key of ``model`` in ``keys``: key, default, meaning."""
    out = []
    for name, field in model.model_fields.items():
        key = field.alias or name.replace("_", "-")
        if key not in keys:
            continue
        default = field.default if field.default is not PydanticUndefined else None
        value = project.get(key, default)
        differs = "" if value == default else f" (model: {shown(default)})"
        meaning = (field.description or "").replace("|", "\\|")
        out.append(f"| `{key}` | {shown(value)}{differs} | {meaning} |")
    return out


def table(
    title: str,
    intro: str,
    model: type[BaseModel],
    keys: Iterable[str],
    project: Mapping[str, Any],
) -> str:
    head = ["| key | default | meaning |", "| --- | --- | --- |"]
    return "\n".join([f"### {title}", "", intro, "", *head, *rows(model, keys, project), ""])


def intro(model: type[BaseModel]) -> str:
    """A table's first line: its model's docstring on one line."""
    return " ".join((model.__doc__ or "").split())


def method_intro(name: str, model: type[MethodSettings]) -> str:
    """A method table's first line: its keys, its docstring and what it takes from another's."""
    text = f"Keys ``{name}.KEY``: {intro(model)}"
    if model.LENDER:
        lender = model.LENDER[0]
        text += f" Its client-step keys are {lender}'s, set in table ``{lender}`` (above)."
    return text


def reference(project: Mapping[str, Any]) -> str:
    """Every key table; ``project`` is pyproject.toml's run config, its tables unflattened."""
    top = "``[tool.flwr.app.config]`` itself: the method, the seed and where the run's folder goes."
    parts = [table("The top level", top, FedBiPConfig, FedBiPConfig.top_keys(), project)]
    for name, model in TABLES.items():
        parts.append(table(f"`{name}`", intro(model), model, model.keys(), project.get(name, {})))
    for name, model in METHOD_SETTINGS.items():
        if model.table_keys():
            text, values = method_intro(name, model), project.get(name, {})
            parts.append(table(f"`{name}`", text, model, model.table_keys(), values))
    return "\n".join(parts)


def project_config(pyproject: Path) -> dict[str, Any]:
    """A pyproject.toml's ``[tool.flwr.app.config]``, its tables as nested dicts."""
    import tomllib

    return tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]

"""Flower's flat configuration dicts as validated models: the base every config model shares.

Flower hands a run config, a node config and a method's table over as flat
``dict[str, bool | int | float | str]`` with kebab-case keys, a table's dotted
(``classifier.lr``);
:meth:`FlatConfig.from_flat` turns one into its model and refuses unknown keys and bad values
with one readable :class:`ConfigError`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A run config that cannot be used; the message says which key and why."""


def kebab(name: str) -> str:
    """A field's run-config key: ``concept_lr`` -> ``concept-lr``."""
    return name.replace("_", "-")


def problems(err: ValidationError, table: str = "", tables: Collection[str] = ()) -> str:
    """Each problem as 'key': reason; a check of the whole config, or of one of its
    ``tables`` (fields that are tables of their own), says only its reason."""
    found = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        reason = e["msg"].removeprefix("Value error, ")
        found.append(f"'{table}{key}': {reason}" if key and key not in tables else reason)
    return "; ".join(found)


class FlatConfig(BaseModel):
    """A configuration Flower hands over as a flat dict with kebab-case keys."""

    model_config = ConfigDict(
        extra="forbid", alias_generator=kebab, populate_by_name=True, frozen=True
    )
    WHAT: ClassVar[str] = "config"  # how error messages name it
    # its fields that are tables of their own, whose checks name their keys themselves
    TABLE_FIELDS: ClassVar[Collection[str]] = ()

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> Self:
        """Build from Flower's flat dict; raise :class:`ConfigError` with one sentence."""
        try:
            return cls.model_validate(dict(flat))
        except ValidationError as err:
            raise ConfigError(
                f"Invalid {cls.WHAT}: {problems(err, tables=cls.TABLE_FIELDS)}."
            ) from None

    def to_flat(self) -> dict[str, Any]:
        """The kebab-case dict form, as :meth:`from_flat` accepts it."""
        return self.model_dump(by_alias=True)

    @classmethod
    def keys(cls) -> set[str]:
        """Its run-config keys, kebab-case."""
        return {field.alias or kebab(name) for name, field in cls.model_fields.items()}

"""What every section of the run configuration shares (config.py assembles them), and the one rule of a section
with variants: a `type`-like key says which variant it is, and keys of other variants are refused by name."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from services.contracts.untyped import JsonValue


class ConfigError(ValueError):
    """A configuration problem, with a message naming the offending key."""


class Section(BaseModel):
    # coerce_numbers_to_str: `--set run_name=2024` or `path: 7` mean the string, as YAML users expect.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, coerce_numbers_to_str=True)


def with_default_variant(value: JsonValue, *, key: str, default: str) -> JsonValue:
    """A section given without its variant key (`weights: {bucket_mb: 32}`) is the default variant."""
    if isinstance(value, dict) and key not in value:
        return {key: default, **value}
    return value

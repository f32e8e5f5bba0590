"""Config keys are added and removed on purpose (torchtitan's test_no_new_cli_options): tests/config_keys.txt lists
every dotted key, docs/config.md documents each, and both are generated from the pydantic models, so a new key shows
in review as a line of that list. After adding or removing a key: `make config-keys`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from services.contracts.config_base import Section
from services.contracts.config_reference import (
    CONFIG_DOC,
    KEY_LIST,
    WRITE_COMMAND,
    ConfigKey,
    config_keys,
    render_key_list,
    render_markdown,
)


def test_the_set_of_config_keys_changes_only_on_purpose():
    now = set(render_key_list(config_keys()).splitlines())
    committed = set(KEY_LIST.read_text().splitlines())
    added, removed = sorted(now - committed), sorted(committed - now)
    assert not added and not removed, (
        f"config keys changed: added {added}, removed {removed}. If that is meant, accept it with: {WRITE_COMMAND} "
        f"(it rewrites {KEY_LIST.name} and docs/{CONFIG_DOC.name}), and commit both"
    )


def test_docs_config_md_is_generated_from_the_current_models():
    assert CONFIG_DOC.read_text() == render_markdown(config_keys()), (
        f"docs/{CONFIG_DOC.name} is stale (a default, type or description changed); run: {WRITE_COMMAND}"
    )


class _Inner(Section):
    depth: int = Field(default=2, ge=0, description="how deep")


class _Cat(Section):
    kind: Literal["cat"] = "cat"
    lives: int = 9


class _Dog(Section):
    kind: Literal["dog"] = "dog"
    bark: str | None = None


class _Root(Section):
    name: str
    inner: _Inner = _Inner()
    maybe: _Inner | None = None
    pets: tuple[Annotated[_Cat | _Dog, Field(discriminator="kind")], ...] = ()
    pet: Annotated[_Cat | _Dog, Field(discriminator="kind")] = _Dog()


def test_keys_are_read_through_optional_list_and_discriminated_sections():
    keys = config_keys(_Root)
    assert keys == [
        ConfigKey("name", "str", "required", "", ""),
        ConfigKey("inner.depth", "int", "2", "how deep", ""),
        ConfigKey("maybe.depth", "int", "2", "how deep", ""),
        ConfigKey("pets[].kind", "'cat' | 'dog'", "required", "which kind of section this is", ""),
        ConfigKey("pets[].lives", "int", "9", "", "kind=cat"),
        ConfigKey("pets[].bark", "str | None", "None", "", "kind=dog"),
        ConfigKey("pet.kind", "'cat' | 'dog'", "'dog'", "which kind of section this is", ""),
        ConfigKey("pet.lives", "int", "9", "", "kind=cat"),
        ConfigKey("pet.bark", "str | None", "None", "", "kind=dog"),
    ]
    root = _Root.model_validate({"name": "n", "pets": [{"kind": "cat"}, {"kind": "dog", "bark": "w"}], "maybe": {}})
    cat, dog = root.pets
    assert isinstance(cat, _Cat) and isinstance(dog, _Dog) and isinstance(root.pet, _Dog) and root.maybe is not None
    assert (cat.lives, dog.bark, root.pet.bark, root.maybe.depth) == (9, "w", None, 2)
    assert render_key_list(keys).splitlines()[:3] == ["inner.depth", "maybe.depth", "name"]
    assert "| `pet.lives` | `int` | `9` | kind=cat |  |" in render_markdown(keys)

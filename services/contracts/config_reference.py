"""Every config key, read from the pydantic models: the committed key list and docs/config.md are generated here.

    python -m services.contracts.config_reference --write    # (make config-keys) after adding or removing a key
    python -m services.contracts.config_reference --check    # exit 1 if either committed file is stale

tests/test_config_keys.py fails while the committed files differ from the models, so a key is added or removed on
purpose: the diff of tests/config_keys.txt shows it in review.
"""

from __future__ import annotations

import argparse
import sys
import types
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from services.contracts.config import TandemConfig

REPO = Path(__file__).resolve().parents[2]
KEY_LIST = REPO / "tests" / "config_keys.txt"
CONFIG_DOC = REPO / "docs" / "config.md"
WRITE_COMMAND = "python -m services.contracts.config_reference --write  (make config-keys)"


@dataclass(frozen=True)
class ConfigKey:
    key: str  # dotted; `[]` marks a list of sections (services.rollout[].port)
    type: str
    default: str
    description: str
    only_when: str  # "engine=sglang" for a key of one variant of a section; "" for every variant


def config_keys(model: type[BaseModel] = TandemConfig, prefix: str = "", only_when: str = "") -> list[ConfigKey]:
    keys: list[ConfigKey] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        variants, is_list = _sections(field.annotation)
        if not variants:
            keys.append(ConfigKey(dotted, _type_name(field.annotation), _default(field), _describe(field), only_when))
            continue
        inner = f"{dotted}[]." if is_list else f"{dotted}."
        discriminator, values = _discriminator(variants)
        if discriminator:
            kind = " | ".join(repr(v) for v in values.values())
            default = getattr(field.default, discriminator, None) if isinstance(field.default, BaseModel) else None
            shown = "required" if default is None else repr(default)
            keys.append(ConfigKey(inner + discriminator, kind, shown, "which kind of section this is", only_when))
        for variant in variants:
            tag = " and ".join(
                t for t in (only_when, f"{discriminator}={values[variant]}" if discriminator else "") if t
            )
            keys += [k for k in config_keys(variant, inner, tag) if k.key != inner + discriminator]
    return _merge_variants(keys)


def _merge_variants(keys: list[ConfigKey]) -> list[ConfigKey]:
    """A key every variant of a section has, with one type and default, is one row with no condition."""
    by_key: dict[str, list[ConfigKey]] = {}
    for k in keys:
        by_key.setdefault(k.key, []).append(k)
    out: list[ConfigKey] = []
    for rows in by_key.values():
        if len(rows) > 1 and len({(r.type, r.default, r.description) for r in rows}) == 1:
            out.append(ConfigKey(rows[0].key, rows[0].type, rows[0].default, rows[0].description, ""))
        else:
            out += rows
    return out


def _sections(annotation: object) -> tuple[list[type[BaseModel]], bool]:
    """The section models an annotation holds (Optional, unions and tuples unwrapped), and whether it is a list."""
    origin = get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], False
    if origin is Annotated:
        return _sections(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        found = [m for arg in get_args(annotation) for m in _sections(arg)[0]]
        return found, False
    if origin in (tuple, list) and get_args(annotation):
        found, _ = _sections(get_args(annotation)[0])
        return found, bool(found)
    return [], False


def _discriminator(variants: list[type[BaseModel]]) -> tuple[str, dict[type[BaseModel], object]]:
    """The key that tells a section's variants apart (each variant's one Literal value), e.g. weights.transport."""
    if len(variants) < 2:
        return "", {}
    common = set.intersection(*(set(v.model_fields) for v in variants))
    for name in sorted(common):
        annotations = [v.model_fields[name].annotation for v in variants]
        if all(get_origin(a) is Literal and len(get_args(a)) == 1 for a in annotations):
            return name, {v: get_args(a)[0] for v, a in zip(variants, annotations, strict=True)}
    return "", {}


def _type_name(annotation: object) -> str:
    if annotation is types.NoneType:
        return "None"
    if isinstance(annotation, type):
        return annotation.__name__
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return str(annotation).replace("typing.", "")


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, BaseModel):
        return value.__class__.__name__
    return repr(value)


def _describe(field: FieldInfo) -> str:
    return " ".join((field.description or "").split())


def render_key_list(keys: list[ConfigKey]) -> str:
    lines = sorted({f"{k.key}  [{k.only_when}]" if k.only_when else k.key for k in keys})
    return "\n".join(lines) + "\n"


def render_markdown(keys: list[ConfigKey]) -> str:
    head = [
        "# Config keys",
        "",
        "Every key of a run's YAML (and of `--set key=value`), generated from the pydantic models in",
        "services/contracts/*config*.py by `make config-keys`",
        "(`python -m services.contracts.config_reference --write`): do not edit by hand. `[]` marks a list of",
        "sections; *only when* names the variant of a section that has the key (rollout by `engine`, weights by",
        "`transport`, tracing.trackers by `type`).",
        "",
    ]
    body: list[str] = []
    section = None
    for k in keys:
        top = k.key.split(".")[0].split("[")[0] if "." in k.key else ""
        if top != section:
            section = top
            body += ["", f"## {top or 'top level'}", "", "| key | type | default | only when | description |"]
            body.append("|---|---|---|---|---|")
        cells = (f"`{k.key}`", f"`{k.type}`", f"`{k.default}`", k.only_when, k.description)
        body.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(head + body[1:]) + "\n"


def stale_files() -> list[Path]:
    keys = config_keys()
    wanted = {KEY_LIST: render_key_list(keys), CONFIG_DOC: render_markdown(keys)}
    return [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help=f"write {KEY_LIST.name} and docs/{CONFIG_DOC.name}")
    action.add_argument("--check", action="store_true", help="exit 1 if either is stale")
    args = parser.parse_args(argv)
    if args.write:
        keys = config_keys()
        KEY_LIST.write_text(render_key_list(keys))
        CONFIG_DOC.write_text(render_markdown(keys))
        print(f"wrote {KEY_LIST.relative_to(REPO)} ({len(keys)} keys) and {CONFIG_DOC.relative_to(REPO)}")
        return 0
    stale = stale_files()
    for path in stale:
        print(f"{path.relative_to(REPO)} is stale; run: {WRITE_COMMAND}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

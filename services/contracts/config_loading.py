"""Loading a run configuration: YAML, `--set` overrides, paths relative to the YAML file, and one error message
naming every bad key (the sections themselves are in services/contracts/config.py)."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from services.contracts.config import CHAT_TEMPLATE_MODES, ConfigError, TandemConfig
from services.contracts.files import PRIVATE_FILE_MODE, write_atomic
from services.contracts.untyped import JsonObject, JsonValue


def parse_override(item: str) -> tuple[list[str], JsonValue]:
    """`a.b=c` -> (["a", "b"], value parsed as YAML, so numbers, booleans and lists work)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set trainer.lr=3e-4")
    parts = key.strip().split(".")
    if any(not p.strip() or p != p.strip() for p in parts):
        raise ConfigError(f"--set {item!r}: {key.strip()!r} is not a dotted key like trainer.lr")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key.strip()}: value {raw!r} is not valid YAML ({_yaml_problem(exc)})") from None
    return key.strip().split("."), value


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: where and what (PyYAML's own message spans several lines with a source excerpt)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}" + (f" ({context})" if context else "")


def apply_overrides(data: JsonObject, overrides: list[str], *, base_dir: Path | None = None) -> JsonObject:
    """`--set` values; a relative file path among them is relative to base_dir (the shell's working directory)."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:  # absent, or an empty `section:` in the YAML
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {'.'.join(path)}: {'.'.join(path[: i + 1])} is not a section")
            node = child
        node[path[-1]] = value
    # Paths from the YAML are absolute by now, so this only touches the relative ones just set.
    return resolve_paths(data, base_dir) if base_dir is not None else data


def _section_type(annotation: Any) -> Any:
    """The Section class a field holds (also in tuple[ServiceAddress, ...] and X | None), or a tagged union of
    them (its Annotated form); None for a plain value."""
    if (isinstance(annotation, type) and issubclass(annotation, BaseModel)) or _variants(annotation):
        return annotation
    return next(filter(None, (_section_type(arg) for arg in get_args(annotation))), None)


def _field_type(field: FieldInfo) -> Any:
    """A field's type as written: pydantic keeps a tagged union's discriminator beside the annotation."""
    return Annotated[field.annotation, field] if field.discriminator else field.annotation


def _variants(annotation: Any) -> dict[str, type[BaseModel]]:
    """A tagged union's variants by each value of its discriminator (rollout: {native: ..., sglang: ...}), else {}."""
    if get_origin(annotation) is not Annotated:
        return {}
    union, *metadata = get_args(annotation)
    key = next((getattr(m, "discriminator", None) for m in metadata if getattr(m, "discriminator", None)), None)
    if not isinstance(key, str):
        return {}
    return {tag: model for model in get_args(union) for tag in get_args(model.model_fields[key].annotation)}


@dataclass(frozen=True)
class _Place:
    """Where an error's loc points: the key as the user writes it (a variant's tag left out), the Section holding
    the last part, and the variant chosen on the way (tag key, tag, the union's variants by tag)."""

    key: str
    model: type[BaseModel] | None
    variant: tuple[str, str, dict[str, type[BaseModel]]] | None = None


def _place(loc: tuple[Any, ...]) -> _Place:
    model: Any = TandemConfig
    shown: list[str] = []
    variant = None
    pending: dict[str, type[BaseModel]] = {}
    for i, part in enumerate(loc):
        if pending and part in pending:  # pydantic puts the chosen variant's tag in the loc
            variant, model, pending = (_tag_key(model), str(part), pending), pending[part], {}
            continue
        shown.append(str(part))
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return _Place(key=".".join(shown + [str(p) for p in loc[i + 1 :]]), model=None, variant=variant)
        model = _section_type(_field_type(model.model_fields[part]))
        pending = _variants(model)
    return _Place(
        key=".".join(shown),
        model=model if isinstance(model, type) and issubclass(model, BaseModel) else None,
        variant=variant,
    )


def _tag_key(annotation: Any) -> str:
    return next(m.discriminator for m in get_args(annotation)[1:] if getattr(m, "discriminator", None))


def _unknown_key(place: _Place, name: str) -> str:
    """An extra key: the variant it belongs to when it is another variant's, else the near miss or the known keys."""
    known = sorted(place.model.model_fields) if place.model else []
    if place.variant is not None:
        tag_key, tag, variants = place.variant
        owners = sorted({t for t, model in variants.items() if name in model.model_fields})
        if owners:
            return f"a key of {place.key}.{tag_key} {' or '.join(owners)}, not {tag}"
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else "known keys: " + ", ".join(known)
    return f"unknown key ({hint})"


QUOTE = "'"


def _bad_tag(ctx: JsonObject) -> str:
    """pydantic's tag error in the words of a Literal's: Input should be 'a', 'b' or 'c' (got 'x')."""
    first, _, last = str(ctx["expected_tags"]).rpartition(", ")
    return f"Input should be {first} or {last} (got {ctx['tag']!r})"


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        place = _place(tuple(err["loc"]))
        key, msg = place.key, err["msg"]
        if err["type"] == "extra_forbidden":
            msg = _unknown_key(_place(tuple(err["loc"])[:-1]), str(err["loc"][-1]))
        elif err["type"] == "missing":
            msg = "required section is missing" if place.model else "required key is missing"
        elif err["type"] in ("union_tag_invalid", "union_tag_not_found"):  # the variant key of a section
            ctx = err.get("ctx", {})
            key = f"{key}.{str(ctx.get('discriminator', '')).strip(QUOTE)}"
            msg = _bad_tag(ctx) if err["type"] == "union_tag_invalid" else "required key is missing"
        elif err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        elif "input" in err:
            msg = f"{msg} (got {err['input']!r})"
        # Cross-section rules name their keys themselves.
        lines.append(f"  {key}: {msg}" if key else f"  {msg}")
    return f"invalid configuration in {source}:\n" + "\n".join(lines)


def resolve_paths(data: JsonObject, base_dir: Path) -> JsonObject:
    """Relative file paths in the YAML are relative to the YAML file's directory; so is the file of a
    `path/to/file.py:name` plug-in (reward, environment)."""
    for where in (*_PATH_KEYS, *_PLUGIN_KEYS):
        node: JsonValue = data
        for part in where[:-1]:  # the section, and a subsection (algorithm.distillation)
            node = node.get(part) if isinstance(node, dict) else None
        key = where[-1]
        value = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or not isinstance(value, str) or not value:
            continue
        if where in _PLUGIN_KEYS:
            node[key] = _resolve_reward_file(value, base_dir)
        elif not os.path.isabs(value) and value not in _KEYWORDS.get(where, ()):
            node[key] = str((base_dir / value).resolve())
    _resolve_reward_models(data, base_dir)
    rollout = data.get("rollout")
    api = rollout.get("openai_api") if isinstance(rollout, dict) else None
    if isinstance(api, dict) and isinstance(api.get("tool_parser"), str):
        api["tool_parser"] = _resolve_reward_file(api["tool_parser"], base_dir)
    return data


TEMPLATE_FILE_SUFFIXES = (".j2", ".jinja", ".jinja2", ".txt")  # a judge's template naming a file, not Jinja text


def _resolve_reward_models(data: JsonObject, base_dir: Path) -> None:
    """reward.models.*: the model and tokenizer directories, a template file and a file parser, relative to the YAML."""
    section = data.get("reward")
    models = section.get("models") if isinstance(section, dict) else None
    if not isinstance(models, dict):
        return
    for model in models.values():
        if not isinstance(model, dict):
            continue
        for key in ("path", "tokenizer_path"):
            value = model.get(key)
            if isinstance(value, str) and value and not os.path.isabs(value):
                model[key] = str((base_dir / value).resolve())
        template = model.get("template")
        if isinstance(template, str) and template.strip().endswith(TEMPLATE_FILE_SUFFIXES) and "\n" not in template:
            model["template"] = str((base_dir / template.strip()).resolve())
        parser = model.get("parser")
        if isinstance(parser, str) and parser:
            model["parser"] = _resolve_reward_file(parser, base_dir) if ".py:" in parser else parser


_KEYWORDS: dict[tuple[str, ...], tuple[str, ...]] = {("data", "chat_template"): CHAT_TEMPLATE_MODES}  # not paths
_PATH_KEYS: tuple[tuple[str, ...], ...] = (
    ("model", "path"),
    ("model", "tokenizer_path"),
    ("data", "train_path"),
    ("data", "eval_path"),
    ("data", "chat_template"),
    ("loop", "save_trigger_sentinel"),
    ("trainer", "checkpoint_dir"),
    ("weights", "disk_dir"),
    ("algorithm", "distillation", "teacher_path"),
)
_PLUGIN_KEYS = (("rollout", "reward"), ("rollout", "environment"), ("rollout", "agent"))


def _resolve_reward_file(spec: str, base_dir: Path) -> str:
    """`dir/file.py:fn` -> `/abs/dir/file.py:fn`; built-in names and `module:function` stay as they are (the
    same rule services.rollout.rewards applies: a target naming a .py file or holding a slash is a file)."""
    target, sep, attr = spec.strip().rpartition(":")
    if not sep or not (target.endswith(".py") or "/" in target) or os.path.isabs(target):
        return spec
    return f"{(base_dir / target).resolve()}:{attr}"


def _defaults_to_a_section(key: str) -> bool:
    field = TandemConfig.model_fields[key]
    return field.default is not None and bool(_section_type(_field_type(field)))


def config_from_dict(data: JsonObject, source: str = "config") -> TandemConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid configuration in {source}: the top level must be a mapping of sections")
    # An empty `section:` in YAML is null: treat it as a section left at its defaults (a section that is off unless
    # given, `reward:`, stays off).
    data = {
        k: ({} if v is None and _defaults_to_a_section(k) else v) if k in TandemConfig.model_fields else v
        for k, v in data.items()
    }
    try:
        return TandemConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None


def load_config(path: str | os.PathLike[str], overrides: list[str] | None = None) -> TandemConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"invalid configuration in {path}: the top level must be a mapping of sections")
    data = resolve_paths(data, path.parent.resolve())
    data = apply_overrides(data, overrides or [], base_dir=Path.cwd())
    return config_from_dict(data, source=str(path))


def dump_config(config: TandemConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def write_resolved_config(config: TandemConfig, run_dir: Path) -> Path:
    """RUN_DIR/config.yaml, which services, `tandem ctl` and restarts read: replaced atomically, and readable by its
    owner only (it may hold the token and passwords)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_atomic(run_dir / "config.yaml", dump_config(config), mode=PRIVATE_FILE_MODE)

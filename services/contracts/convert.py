"""Frozen dataclasses <-> protobuf messages, field by field, by name: the one mapping at every gRPC edge.

A dataclass pairs with a message when both have the same field names and each field's annotation fits the
message field's kind:

| dataclass annotation             | message field                                                   |
| -------------------------------- | --------------------------------------------------------------- |
| int, float, bool, str, bytes     | a scalar of that kind (any integer width; float or double)      |
| Literal["a", "b"]                | string (a value outside the Literal is refused on the way in)   |
| an IntEnum                       | an enum with the same numbers, names ending in the member names |
| a dataclass                      | a message field, paired the same way                            |
| X | None                         | a field with presence: a message, `optional`, or a oneof member  |
| tuple[X, ...]                    | repeated X                                                      |
| dict[K, V]                       | map<K, V>                                                       |

So a new RPC field costs two edits: the .proto and the dataclass (docs/architecture.md, "Adding a field").
A pair that does not fit raises MessageMismatch naming every field that differs, at the first conversion (and in
tests/test_rpc_convert.py, which pairs every message of every service). A value the dataclass refuses (its
`__post_init__`, a Literal) raises ValueError naming the message and the field: bad input, not a crash.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message

T = TypeVar("T")
M = TypeVar("M", bound=Message)
FD = FieldDescriptor

_INTS = frozenset(
    {
        FD.TYPE_INT32,
        FD.TYPE_INT64,
        FD.TYPE_UINT32,
        FD.TYPE_UINT64,
        FD.TYPE_SINT32,
        FD.TYPE_SINT64,
        FD.TYPE_FIXED32,
        FD.TYPE_FIXED64,
        FD.TYPE_SFIXED32,
        FD.TYPE_SFIXED64,
    }
)
_SCALARS: dict[type, frozenset[int]] = {
    int: _INTS,
    float: frozenset({FD.TYPE_FLOAT, FD.TYPE_DOUBLE}),
    bool: frozenset({FD.TYPE_BOOL}),
    str: frozenset({FD.TYPE_STRING}),
    bytes: frozenset({FD.TYPE_BYTES}),
}


class MessageMismatch(TypeError):
    """A dataclass and a message that do not pair field by field: a programming error the tests catch."""


def to_message(value: object, message_type: type[M]) -> M:
    """The message of `message_type` holding the dataclass `value`'s fields."""
    plan = _plan(type(value), typing.cast(Descriptor, message_type.DESCRIPTOR))
    return typing.cast(M, plan.to_message(value))


def from_message(message: Message, cls: type[T]) -> T:
    """The dataclass `cls` made from `message`'s fields; ValueError naming the field when `cls` refuses a value."""
    plan = _plan(cls, typing.cast(Descriptor, message.DESCRIPTOR))
    return typing.cast(T, plan.from_message(message))


def mismatches(cls: type, descriptor: Descriptor) -> list[str]:
    """Every way in which `cls` and the message of `descriptor` do not pair (empty: they do)."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return [f"{cls!r} is not a dataclass (message {descriptor.full_name})"]
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    problems = []
    only_here = [n for n in names if n not in descriptor.fields_by_name]
    only_there = [f.name for f in descriptor.fields if f.name not in names]
    if only_here:
        problems.append(f"{cls.__name__} has fields {only_here} that {descriptor.full_name} lacks")
    if only_there:
        problems.append(f"{descriptor.full_name} has fields {only_there} that {cls.__name__} lacks")
    for name in names:
        if name in descriptor.fields_by_name:
            field = descriptor.fields_by_name[name]
            problems += [f"{cls.__name__}.{name}: {p}" for p in _field_problems(hints[name], field)]
    return problems


# ---- one field -----------------------------------------------------------------------------------------------


def _field_problems(hint: Any, field: FieldDescriptor) -> list[str]:
    shape, inner = _shape(hint)
    is_map = field.type == FD.TYPE_MESSAGE and _message_type(field).GetOptions().map_entry
    match shape:
        case "map":
            if not is_map:
                return [f"dict, but {field.full_name} is no map"]
            entry = _message_type(field).fields_by_name
            return _value_problems(inner[0], entry["key"]) + _value_problems(inner[1], entry["value"])
        case "repeated":
            if not field.is_repeated or is_map:
                return [f"tuple, but {field.full_name} is not a repeated field"]
        case "optional":
            if field.is_repeated or not field.has_presence:
                return [
                    f"X | None, but {field.full_name} cannot be told unset from zero "
                    "(declare it `optional` or in a oneof, or drop the None)"
                ]
        case _:
            if field.is_repeated:
                return [f"{hint!r} is single, but {field.full_name} is repeated (use tuple[X, ...] or dict)"]
            if field.containing_oneof is not None:
                return [f"{field.full_name} has presence (oneof {field.containing_oneof.name}): annotate it X | None"]
    return _value_problems(inner, field)


def _shape(hint: Any) -> tuple[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        return "optional", next(a for a in args if a is not type(None))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return "repeated", args[0]
    if origin is dict:
        return "map", args
    return "single", hint


def _value_problems(hint: Any, field: FieldDescriptor) -> list[str]:
    """Whether one value of type `hint` fits one value of `field` (an element, for repeated fields)."""
    if typing.get_origin(hint) is typing.Literal:
        kinds = {type(a) for a in typing.get_args(hint)}
        if len(kinds) != 1 or field.type not in _SCALARS.get(kinds.pop(), frozenset()):
            return [f"{hint!r} does not fit {field.full_name} ({_kind(field)})"]
        return []
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        if field.type != FD.TYPE_ENUM:
            return [f"enum {hint.__name__}, but {field.full_name} is {_kind(field)}"]
        wire = _enum_values(field)
        ours = {m.value: m.name for m in hint}
        if set(wire) != set(ours) or any(not wire[n].endswith(name) for n, name in ours.items()):
            return [f"enum {hint.__name__} {ours} differs from {_kind(field)} {wire}"]
        return []
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if field.type != FD.TYPE_MESSAGE:
            return [f"dataclass {hint.__name__}, but {field.full_name} is {_kind(field)}"]
        return mismatches(hint, _message_type(field))
    if hint in _SCALARS:
        if field.type not in _SCALARS[hint]:
            return [f"{hint.__name__}, but {field.full_name} is {_kind(field)}"]
        return []
    return [f"{hint!r} has no protobuf form (scalars, Literal, IntEnum, dataclass, X | None, tuple, dict)"]


def _message_type(field: FieldDescriptor) -> Descriptor:
    return typing.cast(Descriptor, field.message_type)


def _enum_values(field: FieldDescriptor) -> dict[int, str]:
    return {v.number: v.name for v in typing.cast(EnumDescriptor, field.enum_type).values}


def _kind(field: FieldDescriptor) -> str:
    if field.type == FD.TYPE_MESSAGE:
        return f"message {_message_type(field).full_name}"
    if field.type == FD.TYPE_ENUM:
        return f"enum {typing.cast(EnumDescriptor, field.enum_type).full_name}"
    return next(k.__name__ for k, types_ in _SCALARS.items() if field.type in types_)


# ---- the plan of one pair ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Field:
    name: str
    shape: str  # "single" | "optional" | "repeated" | "map"
    out: Callable[[Any], Any]  # one dataclass value -> its message value
    into: Callable[[Any], Any]  # one message value -> its dataclass value


@dataclass(frozen=True)
class _Plan:
    cls: type
    message_class: type[Message]
    fields: tuple[_Field, ...]
    oneofs: tuple[tuple[str, tuple[str, ...]], ...]  # (name, its fields) of each oneof of two fields or more

    def to_message(self, value: object) -> Message:
        for group, names in self.oneofs:
            chosen = [n for n in names if getattr(value, n) is not None]
            if len(chosen) > 1:
                raise ValueError(f"{self.cls.__name__}: oneof {group} takes one field, got {', '.join(chosen)}")
        kwargs: dict[str, Any] = {}
        for f in self.fields:
            v = getattr(value, f.name)
            match f.shape:
                case "optional":
                    if v is not None:
                        kwargs[f.name] = f.out(v)
                case "repeated":
                    kwargs[f.name] = [f.out(x) for x in v]
                case "map":
                    kwargs[f.name] = {k: f.out(x) for k, x in v.items()}
                case _:
                    kwargs[f.name] = f.out(v)
        try:
            return self.message_class(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{self.cls.__name__} -> {self.message_class.DESCRIPTOR.full_name}: {exc}") from None

    def from_message(self, message: Message) -> object:
        if message.DESCRIPTOR is not self.message_class.DESCRIPTOR:
            raise TypeError(f"expected {self.message_class.DESCRIPTOR.full_name}, got {message.DESCRIPTOR.full_name}")
        kwargs: dict[str, Any] = {}
        for f in self.fields:
            v = getattr(message, f.name)
            match f.shape:
                case "optional":
                    kwargs[f.name] = f.into(v) if message.HasField(f.name) else None
                case "repeated":
                    kwargs[f.name] = tuple(f.into(x) for x in v)
                case "map":
                    kwargs[f.name] = {k: f.into(x) for k, x in v.items()}
                case _:
                    kwargs[f.name] = f.into(v)
        try:
            return self.cls(**kwargs)
        except ValueError as exc:  # the dataclass's own checks (__post_init__)
            raise ValueError(f"{self.message_class.DESCRIPTOR.full_name}: {exc}") from None


def _same(value: Any) -> Any:
    return value


_PLANS: dict[tuple[type, Descriptor], _Plan] = {}  # built once per pair (a race builds the same plan twice)


def _plan(cls: type, descriptor: Descriptor) -> _Plan:
    plan = _PLANS.get((cls, descriptor))
    if plan is None:
        plan = _PLANS[cls, descriptor] = _build_plan(cls, descriptor)
    return plan


def _build_plan(cls: type, descriptor: Descriptor) -> _Plan:
    problems = mismatches(cls, descriptor)
    if problems:
        raise MessageMismatch(f"{cls.__name__} <-> {descriptor.full_name}: " + "; ".join(problems))
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        field = descriptor.fields_by_name[f.name]
        shape, inner = _shape(hints[f.name])
        if shape == "map":
            inner, field = inner[1], _message_type(field).fields_by_name["value"]
        out, into = _value_codec(inner, field, where=f"{descriptor.full_name}.{f.name}")
        fields.append(_Field(f.name, shape, out, into))
    oneofs = tuple((o.name, tuple(f.name for f in o.fields)) for o in descriptor.oneofs if len(o.fields) > 1)
    return _Plan(cls, message_factory.GetMessageClass(descriptor), tuple(fields), oneofs)


def _value_codec(hint: Any, field: FieldDescriptor, *, where: str) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """How one value crosses: out to the message, into the dataclass (both checked by mismatches already)."""
    if typing.get_origin(hint) is typing.Literal:
        allowed = typing.get_args(hint)

        def literal(value: Any) -> Any:
            if value not in allowed:
                raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(repr, allowed))}")
            return value

        return _same, literal
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        members = {m.value: m for m in hint}

        def member(number: int) -> enum.IntEnum:
            if number not in members:
                raise ValueError(f"{where}: {number} is no {hint.__name__} (a newer peer?)")
            return members[number]

        return int, member
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        nested = _message_type(field)
        return (lambda v: _plan(type(v), nested).to_message(v)), (lambda m: _plan(hint, nested).from_message(m))
    return _same, _same

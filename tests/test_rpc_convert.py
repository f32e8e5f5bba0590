"""The one mapping between the `*_calls` dataclasses and the tandem.v1 messages (services/contracts/convert.py).

Every request and reply of every service in the tandem.v1 protos must have a dataclass in
services/rpc/messages.py that pairs with it field by field, and must cross in both directions with every field
set. A new service's message without a dataclass, or a field added on one side only, fails here."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import itertools
import pkgutil
import types
import typing
from typing import Any, Literal

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

from services.contracts.convert import MessageMismatch, from_message, mismatches, to_message
from services.contracts.gen.tandem import v1 as tandem_v1
from services.contracts.trainer_calls import TrainRequest
from services.rpc.messages import MESSAGE_DATACLASSES


def service_messages() -> dict[str, Descriptor]:
    """Every request and reply type of every service in the generated tandem.v1 modules, by full name."""
    found: dict[str, Descriptor] = {}
    for info in pkgutil.iter_modules(tandem_v1.__path__):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"{tandem_v1.__name__}.{info.name}")
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                found[method.input_type.full_name] = method.input_type
                found[method.output_type.full_name] = method.output_type
    return found


MESSAGES = service_messages()


def test_the_services_are_found():
    assert {"tandem.v1.TrainRequest", "tandem.v1.GenerateRequest", "tandem.v1.RunStatus"} <= set(MESSAGES)


def test_every_row_of_the_table_is_a_service_message():
    """A row for a message no service sends any more is dead."""
    assert set(MESSAGE_DATACLASSES) <= set(MESSAGES)


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_each_service_message_has_a_dataclass_that_pairs(name: str):
    cls = MESSAGE_DATACLASSES.get(name)
    assert cls is not None, f"{name} has no dataclass in services/rpc/messages.py"
    assert mismatches(cls, MESSAGES[name]) == []


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_each_service_message_crosses_both_ways_with_every_field_set(name: str):
    cls, descriptor = MESSAGE_DATACLASSES[name], MESSAGES[name]
    message_class = message_factory.GetMessageClass(descriptor)
    value = sample(cls)
    message = to_message(value, message_class)
    assert unset_fields(message) == []  # each field carries the value's (non-zero) content
    wire = message_class.FromString(message.SerializeToString())
    assert from_message(wire, cls) == value  # dataclass -> message -> bytes -> dataclass
    assert to_message(from_message(wire, cls), message_class) == wire  # message -> dataclass -> message


def unset_fields(message: Message, prefix: str = "") -> list[str]:
    """The fields of `message`, nested ones too, left at their zero value."""
    unset = []
    listed = {f.name: v for f, v in message.ListFields()}
    for field in message.DESCRIPTOR.fields:
        if field.name not in listed:
            unset.append(prefix + field.name)
        elif (
            field.type == field.TYPE_MESSAGE and not typing.cast(Descriptor, field.message_type).GetOptions().map_entry
        ):
            items = listed[field.name] if field.is_repeated else [listed[field.name]]
            for item in items:
                unset += unset_fields(item, f"{prefix}{field.name}.")
    return unset


_counter = itertools.count(1)
F = descriptor_pb2.FieldDescriptorProto


def sample(hint: Any) -> Any:
    """A value of `hint` with every field set and no two numbers alike (floats exact in 32 bits)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return args[-1]
    if origin in (typing.Union, types.UnionType):
        return sample(next(a for a in args if a is not type(None)))
    if origin is tuple:
        return (sample(args[0]), sample(args[0]))
    if origin is dict:
        first, second = next(_counter), next(_counter)
        return {f"k{first}": sample(args[1]), f"k{second}": sample(args[1])}
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        return list(hint)[-1]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{f.name: sample(hints[f.name]) for f in dataclasses.fields(hint)})
    n = next(_counter)
    return {int: n, float: n + 0.5, bool: True, str: f"s{n}", bytes: bytes([n % 256, 0, 255])}[hint]


# ---- the converter's rules, on messages built here -----------------------------------------------------------


def build_messages(fields_of: dict[str, list[tuple[str, int, int, str]]]) -> dict[str, Any]:
    """Message classes of a throwaway proto3 file (package probe.v1) of scalar fields: message name -> rows of
    (field, number, type, how), how "" (plain), "repeated", or "oneof:NAME"."""
    file = descriptor_pb2.FileDescriptorProto(name=f"probe_{next(_counter)}.proto", package="probe.v1", syntax="proto3")
    for name, rows in fields_of.items():
        msg = file.message_type.add(name=name)
        for field_name, number, kind, how in rows:
            label = F.LABEL_REPEATED if how == "repeated" else F.LABEL_OPTIONAL
            f = msg.field.add(name=field_name, number=number, type=kind, label=label)
            if how.startswith("oneof:"):
                group = how.split(":", 1)[1]
                if group not in [o.name for o in msg.oneof_decl]:
                    msg.oneof_decl.add(name=group)
                f.oneof_index = [o.name for o in msg.oneof_decl].index(group)
    return {name: message_class(descriptor_pool.DescriptorPool(), file, name) for name in fields_of}


def message_class(pool: descriptor_pool.DescriptorPool, file: descriptor_pb2.FileDescriptorProto, name: str) -> Any:
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{file.package}.{name}"))


class Color(enum.IntEnum):
    UNSPECIFIED = 0
    RED = 1
    BLUE = 2


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    label: str = ""


@dataclasses.dataclass(frozen=True)
class Shape:
    color: Color
    blob: bytes
    points: tuple[Point, ...]
    origin: Point | None
    weight: float | None  # proto3 optional
    kind: Literal["line", "ring"]
    named: dict[str, Point]


def test_enums_bytes_nested_repeated_optional_and_literals_cross_both_ways():
    shape_class = _shape_class_with_map()
    value = Shape(
        color=Color.BLUE,
        blob=b"\x00\xff",
        points=(Point(1, "a"), Point(2)),
        origin=None,
        weight=0.0,
        kind="ring",
        named={"p": Point(3, "c")},
    )
    msg: Any = to_message(value, shape_class)
    assert msg.color == 2 and msg.blob == b"\x00\xff" and [p.x for p in msg.points] == [1, 2]
    assert not msg.HasField("origin") and msg.HasField("weight") and msg.weight == 0.0  # optional: zero is set
    assert msg.named["p"].label == "c"
    assert from_message(msg, Shape) == value
    msg.ClearField("weight")
    msg.origin.x = 7
    back = from_message(msg, Shape)
    assert back.weight is None and back.origin == Point(7)


def _shape_class_with_map() -> Any:
    file = descriptor_pb2.FileDescriptorProto(name=f"probe_{next(_counter)}.proto", package="probe.v1", syntax="proto3")
    color = file.enum_type.add(name="Color")
    for i, value in enumerate(("COLOR_UNSPECIFIED", "COLOR_RED", "COLOR_BLUE")):
        color.value.add(name=value, number=i)
    point = file.message_type.add(name="Point")
    point.field.add(name="x", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    point.field.add(name="label", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    shape = file.message_type.add(name="Shape")
    entry = shape.nested_type.add(name="NamedEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL, type_name=".probe.v1.Point")
    add = shape.field.add
    add(name="color", number=1, type=F.TYPE_ENUM, label=F.LABEL_OPTIONAL, type_name=".probe.v1.Color")
    add(name="blob", number=2, type=F.TYPE_BYTES, label=F.LABEL_OPTIONAL)
    add(name="points", number=3, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED, type_name=".probe.v1.Point")
    add(name="origin", number=4, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL, type_name=".probe.v1.Point")
    shape.oneof_decl.add(name="_weight")
    add(name="weight", number=5, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL, proto3_optional=True, oneof_index=0)
    add(name="kind", number=6, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    add(name="named", number=7, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED, type_name=".probe.v1.Shape.NamedEntry")
    return message_class(descriptor_pool.DescriptorPool(), file, "Shape")


def test_a_value_the_dataclass_refuses_is_a_value_error_naming_the_field():
    shape_class = _shape_class_with_map()
    msg: Any = to_message(Shape(Color.RED, b"", (), None, None, "line", {}), shape_class)
    msg.kind = "square"
    with pytest.raises(ValueError, match=r"probe\.v1\.Shape\.kind: 'square' is not one of 'line', 'ring'"):
        from_message(msg, Shape)
    msg.kind = "line"
    msg.color = 9  # an open enum keeps numbers it does not know (a newer peer)
    with pytest.raises(ValueError, match=r"probe\.v1\.Shape\.color: 9 is no Color"):
        from_message(msg, Shape)


@dataclasses.dataclass(frozen=True)
class Either:
    number: int | None = None
    text: str | None = None


def test_a_oneof_crosses_as_optional_fields_and_two_set_are_refused():
    either = build_messages(
        {"Either": [("number", 1, F.TYPE_INT64, "oneof:choice"), ("text", 2, F.TYPE_STRING, "oneof:choice")]}
    )["Either"]
    msg: Any = to_message(Either(text=""), either)
    assert msg.WhichOneof("choice") == "text"
    assert from_message(msg, Either) == Either(text="")
    assert from_message(either(number=0), Either) == Either(number=0)
    with pytest.raises(ValueError, match=r"oneof choice.*number, text"):
        to_message(Either(number=1, text="a"), either)


def test_a_mismatch_names_every_field_that_differs():
    messages = build_messages(
        {"Probe": [("a", 1, F.TYPE_INT64, ""), ("b", 2, F.TYPE_STRING, ""), ("c", 3, F.TYPE_INT64, "repeated")]}
    )

    @dataclasses.dataclass(frozen=True)
    class Probe:
        a: str  # wrong kind
        c: int  # single, the message's is repeated
        d: int = 0  # not in the message

    problems = mismatches(Probe, messages["Probe"].DESCRIPTOR)
    assert problems == [
        "Probe has fields ['d'] that probe.v1.Probe lacks",
        "probe.v1.Probe has fields ['b'] that Probe lacks",
        "Probe.a: str, but probe.v1.Probe.a is int",
        "Probe.c: <class 'int'> is single, but probe.v1.Probe.c is repeated (use tuple[X, ...] or dict)",
    ]
    with pytest.raises(MessageMismatch, match=r"Probe <-> probe\.v1\.Probe: Probe has fields \['d'\]"):
        to_message(Probe(a="x", c=1), messages["Probe"])


def test_none_for_a_proto3_scalar_without_presence_is_a_mismatch():
    messages = build_messages({"Plain": [("seed", 1, F.TYPE_INT64, "")]})

    @dataclasses.dataclass(frozen=True)
    class Plain:
        seed: int | None

    (problem,) = mismatches(Plain, messages["Plain"].DESCRIPTOR)
    assert "cannot be told unset from zero" in problem


def test_a_new_field_costs_the_proto_and_the_dataclass_only():
    """TrainRequest with one more field in the .proto (`priority = 99`): the dataclass as it is does not pair (the
    test above fails for the real message), and the dataclass with the field added pairs and crosses both ways,
    with no other edit (no server, no client, no table row)."""
    file = descriptor_pb2.FileDescriptorProto()
    tandem_v1.trainer_pb2.DESCRIPTOR.CopyToProto(file)
    request = next(m for m in file.message_type if m.name == "TrainRequest")
    request.field.add(name="priority", number=99, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    file.name = f"probe_{next(_counter)}.proto"
    pool = descriptor_pool.DescriptorPool()
    common = descriptor_pb2.FileDescriptorProto()
    tandem_v1.common_pb2.DESCRIPTOR.CopyToProto(common)
    pool.Add(common)
    grown = message_class(pool, file, "TrainRequest")

    assert mismatches(TrainRequest, grown.DESCRIPTOR) == [
        "tandem.v1.TrainRequest has fields ['priority'] that TrainRequest lacks"
    ]
    with_field = dataclasses.make_dataclass(
        "TrainRequest",
        [("priority", int, dataclasses.field(default=0))],
        bases=(TrainRequest,),
        frozen=True,
        namespace={"__module__": TrainRequest.__module__},
    )
    value = with_field(rollout_id=4, entry_ids=("1-0",), priority=7)
    msg: Any = to_message(value, grown)
    assert msg.priority == 7 and msg.rollout_id == 4
    assert from_message(grown.FromString(msg.SerializeToString()), with_field) == value

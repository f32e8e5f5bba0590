"""Request generators for the fuzz tests (tests/test_fuzz_services.py): random bytes, truncated valid
messages, fields sent with the wrong wire type or invalid UTF-8, and valid messages with one field set to an
extreme (negative, huge, NaN, very long, very many). Everything is derived from the service descriptors, so
an RPC added to a .proto is fuzzed without touching the tests."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf import descriptor, message, message_factory

FD = descriptor.FieldDescriptor
# A field's descriptor: google.protobuf's stubs type the python and the upb implementations apart, and fields
# iterate as either, so the helpers take what they are given.
Field = Any
# A proper answer to bad input; OK is fine too (the input happened to be valid). Never UNKNOWN or INTERNAL,
# and never a dead server. UNAUTHENTICATED/PERMISSION_DENIED answer requests from a caller who is not allowed.
ACCEPTABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}

_INTS = {
    FD.TYPE_INT32: (-1, -(2**31), 2**31 - 1),
    FD.TYPE_SINT32: (-1, -(2**31), 2**31 - 1),
    FD.TYPE_INT64: (-1, -(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-1, -(2**63), 2**63 - 1),
    FD.TYPE_UINT32: (2**32 - 1,),
    FD.TYPE_UINT64: (2**64 - 1,),
}
_FLOATS = (-1.0, float("nan"), float("inf"), -1e308)
_STRINGS = ("\x00", "../../../../../../etc/passwd", "x" * 100_000, "\u202e💥" * 500)


def _extremes(field: Field) -> tuple[Any, ...]:
    if field.type in _INTS:
        return _INTS[field.type]
    if field.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return _FLOATS
    if field.type == FD.TYPE_STRING:
        return _STRINGS
    if field.type == FD.TYPE_BYTES:
        return (b"\xff" * 4096,)
    if field.type == FD.TYPE_BOOL:
        return (True,)
    if field.type == FD.TYPE_ENUM:
        return (len(field.enum_type.values) + 7,)
    return ()


def _is_map(field: Field) -> bool:
    return field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _set(msg: message.Message, field: Field, value: Any) -> None:
    if field.is_repeated:
        getattr(msg, field.name).append(value)
    else:
        setattr(msg, field.name, value)


def extreme_variants(base: message.Message, *, depth: int = 0) -> Iterator[tuple[str, message.Message]]:
    """`base` with one field (or one field of a nested message) set to an extreme, one variant at a time."""
    fields: list[Field] = list(base.DESCRIPTOR.fields)
    for field in fields:
        if _is_map(field):
            if field.message_type.fields_by_name["value"].type != FD.TYPE_STRING:
                continue
            many, huge = _copy(base), _copy(base)
            getattr(many, field.name).update({f"k{i}": "v" for i in range(2000)})
            getattr(huge, field.name)["\x00" + "k" * 50_000] = "v" * 100_000
            yield f"{field.name}{{2000 keys}}", many
            yield f"{field.name}{{huge key}}", huge
            continue
        if field.type == FD.TYPE_MESSAGE:
            if depth == 0:
                for what, nested in extreme_variants(message_factory.GetMessageClass(field.message_type)(), depth=1):
                    m = _copy(base)
                    if field.is_repeated:
                        getattr(m, field.name).add().CopyFrom(nested)
                    else:
                        getattr(m, field.name).CopyFrom(nested)
                    yield f"{field.name}.{what}", m
            if field.is_repeated:
                m = _copy(base)
                items = getattr(m, field.name)
                template = items[0] if len(items) else None
                for i in range(100_000):
                    item = items.add()
                    if template is not None:
                        item.CopyFrom(template)
                    if "group_id" in item.DESCRIPTOR.fields_by_name:
                        item.group_id = i
                yield f"{field.name}[100000]", m
            continue
        for value in _extremes(field):
            m = _copy(base)
            _set(m, field, value)
            yield f"{field.name}={str(value)[:24]}", m
        if field.is_repeated and field.type == FD.TYPE_STRING:
            m = _copy(base)
            getattr(m, field.name).extend(f"{i}-{i}" for i in range(20_000))
            yield f"{field.name}[20000]", m


def _copy(msg: message.Message) -> message.Message:
    out = type(msg)()
    out.CopyFrom(msg)
    return out


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def wrong_wire_types(request_type: descriptor.Descriptor) -> Iterator[tuple[str, bytes]]:
    """Each field sent with every wire type but its own, and string fields with invalid UTF-8."""
    for field in request_type.fields:
        for wire, payload in ((0, _varint(2**40)), (1, b"\x01" * 8), (2, _varint(3) + b"abc"), (5, b"\x01" * 4)):
            yield f"{field.name}/wire{wire}", _varint(field.number << 3 | wire) + payload
        if field.type == FD.TYPE_STRING:
            yield f"{field.name}/bad-utf8", _varint(field.number << 3 | 2) + _varint(4) + b"\xff\xfe\xc3\x28"
    yield "unknown-field", _varint(999 << 3 | 2) + _varint(2) + b"zz"
    yield "bad-length", _varint(1 << 3 | 2) + _varint(2**31)


def random_inputs(base: message.Message, *, seed: int, count: int = 24) -> Iterator[tuple[str, bytes]]:
    rng = random.Random(seed)
    for i in range(count):
        yield f"random#{i}", bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 96)))
    valid = base.SerializeToString()
    for _ in range(min(len(valid), 12)):
        cut = rng.randint(1, max(1, len(valid) - 1))
        yield f"truncated@{cut}", valid[:cut]


def all_inputs(
    method: descriptor.MethodDescriptor, base: message.Message | None, seed: int
) -> Iterator[tuple[str, bytes]]:
    cls = message_factory.GetMessageClass(method.input_type)
    base = base if base is not None else cls()
    yield "valid-base", base.SerializeToString()
    yield "empty", b""
    yield from random_inputs(base, seed=seed)
    yield from wrong_wire_types(method.input_type)
    for what, variant in extreme_variants(base):
        yield what, variant.SerializeToString()


def decodes(method: descriptor.MethodDescriptor, data: bytes) -> bool:
    try:
        message_factory.GetMessageClass(method.input_type).FromString(data)
        return True
    except message.DecodeError:
        return False


def call_raw(
    channel: grpc.Channel, method: descriptor.MethodDescriptor, data: bytes, *, timeout_s: float
) -> tuple[grpc.StatusCode, str]:
    """Sends raw request bytes; returns (status, details). A server stream is read to its end (or deadline)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if method.server_streaming:  # a few messages show it serves; a live stream never ends by itself
            stream = channel.unary_stream(path, request_serializer=None, response_deserializer=None)(
                data, timeout=timeout_s
            )
            for i, _ in enumerate(stream):
                if i == 2:
                    stream.cancel()
                    break
        else:
            channel.unary_unary(path, request_serializer=None, response_deserializer=None)(data, timeout=timeout_s)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""

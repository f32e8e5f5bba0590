"""The commands rank 0 relays to every trainer rank: one frozen dataclass each, and their codec (a JSON header and
raw byte payloads over `dist.CommandRelay`; nothing is pickled). ranks.py executes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch
from google.protobuf.message import DecodeError

from services.contracts.gen.tandem.v1 import common_pb2
from services.contracts.untyped import JsonObject, JsonValue
from services.contracts.wire import WireError, array_from_proto, array_to_proto
from services.trainer.batching import TrainBatch


@dataclass(frozen=True)
class Train:
    """One optimizer step on `batch` (the entries' samples, stale ones already removed)."""

    rollout_id: int
    entry_ids: tuple[str, ...]
    batch: TrainBatch


@dataclass(frozen=True)
class Save:
    directory: str
    rollout_id: int
    export_hf: bool
    extra_state: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Load:
    directory: str


@dataclass(frozen=True)
class WeightChecksums:
    """The checksums of the exported weights, per tensor or (by_bucket) per bucket of the prepared plan (a
    collective under ZeRO-3; rank 0 gets them)."""

    by_bucket: bool = False


@dataclass(frozen=True)
class PublishWeights:
    version: int


@dataclass(frozen=True)
class Offload:
    pass


@dataclass(frozen=True)
class Onload:
    pass


@dataclass(frozen=True)
class Shutdown:
    """Ranks > 0 leave `serve`."""


Command = Train | Save | Load | WeightChecksums | PublishWeights | Offload | Onload | Shutdown


class CommandError(ValueError):
    """A relayed header or payload list that is not a command this codec writes."""


# ---- codec ------------------------------------------------------------------------------------------

_KIND = "cmd"  # the header key naming the command: the only place it is spelled
_BATCH_FIELDS = tuple(f.name for f in fields(TrainBatch))


def encode_batch(batch: TrainBatch) -> tuple[list[str], list[bytes]]:
    names = [name for name in _BATCH_FIELDS if getattr(batch, name) is not None]
    return names, [array_to_proto(getattr(batch, name).numpy()).SerializeToString() for name in names]


def decode_batch(names: Sequence[str], payloads: Sequence[bytes]) -> TrainBatch:
    if len(names) != len(payloads):
        raise CommandError(f"train: {len(names)} batch fields but {len(payloads)} payloads")
    unknown = sorted(set(names) - set(_BATCH_FIELDS))
    if unknown:
        raise CommandError(f"train: unknown batch fields {unknown}")
    arrays = {}
    for name, raw in zip(names, payloads, strict=True):
        msg = common_pb2.TensorData()
        msg.ParseFromString(raw)
        arrays[name] = torch.from_numpy(array_from_proto(msg, what=name).copy())
    try:
        return TrainBatch(**arrays)
    except TypeError as exc:  # a required field is missing
        raise CommandError(f"train: {exc}") from None


def encode(command: Command) -> tuple[JsonObject, list[bytes]]:
    """(JSON-serialisable header, payloads) of a command."""
    match command:
        case Train(rollout_id=rollout_id, entry_ids=entry_ids, batch=batch):
            names, payloads = encode_batch(batch)
            return {_KIND: "train", "rollout_id": rollout_id, "fields": names, "entry_ids": list(entry_ids)}, payloads
        case Save():
            return {
                _KIND: "save",
                "dir": command.directory,
                "rollout_id": command.rollout_id,
                "export_hf": command.export_hf,
                "extra_state": dict(command.extra_state),
            }, []
        case Load(directory=directory):
            return {_KIND: "load", "dir": directory}, []
        case WeightChecksums(by_bucket=by_bucket):
            return {_KIND: "weights", "mode": "checksums", "by_bucket": by_bucket}, []
        case PublishWeights(version=version):
            return {_KIND: "weights", "mode": "publish", "version": version}, []
        case Offload():
            return {_KIND: "offload"}, []
        case Onload():
            return {_KIND: "onload"}, []
        case Shutdown():
            return {_KIND: "shutdown"}, []
    raise TypeError(f"not a trainer command: {command!r}")


def _field(header: JsonObject, key: str, kind: type) -> JsonValue:
    if key not in header:
        raise CommandError(f"relayed command {header.get(_KIND)!r} lacks {key!r}")
    value = header[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CommandError(
            f"relayed command {header.get(_KIND)!r}: {key!r} must be {kind.__name__}, got {type(value).__name__}"
        )
    return value


def _strings(header: JsonObject, key: str) -> list[str]:
    values = _field(header, key, list)
    if not all(isinstance(v, str) for v in values):
        raise CommandError(f"relayed command {header.get(_KIND)!r}: {key!r} must hold strings")
    return values


def decode(header: JsonValue, payloads: Sequence[bytes] = ()) -> Command:
    """The command a header and its payloads encode; CommandError names what is wrong with a malformed one."""
    if not isinstance(header, dict):
        raise CommandError(f"a relayed command header must be a JSON object, got {type(header).__name__}")
    kind = header.get(_KIND)
    if kind != "train" and payloads:
        raise CommandError(f"relayed command {kind!r} carries no payloads, got {len(payloads)}")
    match kind:
        case "train":
            return _decode_train(header, payloads)
        case "save":
            return _decode_save(header)
        case "load":
            return Load(directory=_field(header, "dir", str))
        case "weights":
            return _decode_weights(header)
        case "offload":
            return Offload()
        case "onload":
            return Onload()
        case "shutdown":
            return Shutdown()
    raise CommandError(f"relayed header {repr(header)[:200]} names no trainer command")


def _decode_train(header: JsonObject, payloads: Sequence[bytes]) -> Train:
    try:
        batch = decode_batch(_strings(header, "fields"), payloads)
    except (WireError, DecodeError) as exc:
        raise CommandError(f"train: {exc}") from None
    return Train(
        rollout_id=_field(header, "rollout_id", int), entry_ids=tuple(_strings(header, "entry_ids")), batch=batch
    )


def _decode_save(header: JsonObject) -> Save:
    extra = _field(header, "extra_state", dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise CommandError("relayed command 'save': 'extra_state' must map strings to strings")
    return Save(
        directory=_field(header, "dir", str),
        rollout_id=_field(header, "rollout_id", int),
        export_hf=_field(header, "export_hf", bool),
        extra_state=dict(extra),
    )


def _decode_weights(header: JsonObject) -> WeightChecksums | PublishWeights:
    match header.get("mode"):
        case "checksums":
            return WeightChecksums(by_bucket=_field(header, "by_bucket", bool))
        case "publish":
            return PublishWeights(version=_field(header, "version", int))
    raise CommandError(f"relayed command 'weights': unknown mode {header.get('mode')!r}")

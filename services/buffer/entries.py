"""What a rollout-buffer entry is, its errors, and how a stream entry's fields become a `BufferEntry`.

Fields (all bytes): rollout_id, policy_version, producer, nbytes, checksum (of the whole payload), trace (JSON
carrier), and either `payload` or `chunks` = N with `chunk_prefix`, the payload then in keys `<chunk_prefix>:<i>`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import cast

import redis

from services.contracts.untyped import RedisReply
from services.contracts.wire import RolloutBatchData, WireError, decode_batch, payload_checksum


class BufferError(RuntimeError):
    pass


class BufferFullError(BufferError, TimeoutError):
    pass


class EntryNotFoundError(BufferError, KeyError):
    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class BufferEntry:
    entry_id: str
    batch: RolloutBatchData
    rollout_id: int
    policy_version: int
    trace_context: dict[str, str]
    producer: str
    nbytes: int


@dataclass(frozen=True)
class DeadLetter:
    entry_id: str
    reason: str


Rows = list[tuple[bytes, dict[bytes, bytes]]]  # XRANGE's answer on a binary client (redis-py types it loosely)

# What decoding a corrupted entry raises (the consumer dead-letters it with the message).
DECODE_ERRORS = (WireError, ValueError, UnicodeDecodeError)


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def rows(response: RedisReply) -> Rows:
    return cast(Rows, response or [])


def messages(response: RedisReply) -> Rows:
    """The (id, fields) pairs of an XREADGROUP answer over one stream."""
    return [m for _stream, msgs in response or [] for m in msgs]


def decode_entry(client: redis.Redis, entry_id: str, fields: dict[bytes, bytes]) -> BufferEntry:
    """The entry, its payload checked against its length and checksum; raises one of DECODE_ERRORS."""
    payload = _payload(client, fields)
    expected_len = int(fields.get(b"nbytes", b"-1"))
    if expected_len != len(payload):
        raise WireError(f"payload is {len(payload)} bytes, entry says {expected_len}")
    expected = fields.get(b"checksum", b"").decode()
    if payload_checksum(payload) != expected:
        raise WireError(f"checksum mismatch (entry says {expected!r}, payload is {payload_checksum(payload)})")
    batch = decode_batch(payload)
    trace = json.loads(fields.get(b"trace", b"{}").decode() or "{}")
    if not isinstance(trace, dict):
        raise WireError("trace context is not a JSON object")
    return BufferEntry(
        entry_id=entry_id,
        batch=batch,
        rollout_id=batch.rollout_id,
        policy_version=batch.policy_version,
        trace_context={str(k): str(v) for k, v in trace.items()},
        producer=batch.producer,
        nbytes=len(payload),
    )


def _payload(client: redis.Redis, fields: dict[bytes, bytes]) -> bytes:
    if b"payload" in fields:
        return fields[b"payload"]
    if b"chunks" not in fields or b"chunk_prefix" not in fields:
        raise WireError("entry has neither payload nor chunks")
    n, prefix = int(fields[b"chunks"]), fields[b"chunk_prefix"].decode()
    parts = cast(list[bytes | None], client.mget([f"{prefix}:{i}" for i in range(n)]) if n else [])
    missing = [i for i, p in enumerate(parts) if p is None]
    if missing:
        raise WireError(f"{len(missing)} of {n} chunks are missing (chunk {missing[0]}: {prefix}:{missing[0]})")
    return b"".join(p for p in parts if p is not None)

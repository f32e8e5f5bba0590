"""The rollout buffer: one Redis stream per run, one consumer group per trainer role.

Entry layout (all fields bytes):
    rollout_id, policy_version, producer, nbytes, checksum (of the whole payload), trace (JSON carrier),
    and either `payload` (small batches) or `chunks` = N with the payload in N string keys
    `<stream>:chunk:<uuid>:<i>` (each below Redis' 512 MB bulk limit), written in the same MULTI as the XADD.

Life of an entry: `put` (blocks while `max_buffered_batches` entries wait) → `get`/`read` by a trainer role
(the entry is pending in that group until `ack`) → `ack` once the optimizer step that used it is committed.
The entry (and its chunks) is deleted when every role's group has acknowledged it, so XLEN is the number
of batches still waiting for someone. Pending entries of a dead consumer are taken over (XAUTOCLAIM)
after `claim_idle_ms`. An entry that fails its checksum or does not decode goes to `<stream>:dead` with the
reason (chunks kept), is removed from the live stream, and is reported — the consumer carries on.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field

import redis

from services.common.wire import RolloutBatchData, WireError, decode_batch, encode_batch, payload_checksum

log = logging.getLogger(__name__)


class BufferError(RuntimeError):
    pass


class BufferFullError(BufferError, TimeoutError):
    pass


class EntryNotFoundError(BufferError, KeyError):
    pass


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


@dataclass
class BufferStats:
    dead_lettered: list[DeadLetter] = field(default_factory=list)
    claimed: int = 0


# Acknowledge for one group; delete the entry and its chunks once all groups have acknowledged.
_ACK_SCRIPT = """
local stream, acks = KEYS[1], KEYS[2]
local group, ngroups = ARGV[1], tonumber(ARGV[2])
local done = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  if redis.call('XACK', stream, group, id) == 1 then
    done = done + 1
    if redis.call('HINCRBY', acks, id, 1) >= ngroups then
      local entry = redis.call('XRANGE', stream, id, id)
      if #entry == 1 then
        local fields = entry[1][2]
        local nchunks, prefix = 0, nil
        for j = 1, #fields, 2 do
          if fields[j] == 'chunks' then nchunks = tonumber(fields[j + 1]) end
          if fields[j] == 'chunk_prefix' then prefix = fields[j + 1] end
        end
        for c = 0, nchunks - 1 do redis.call('DEL', prefix .. ':' .. c) end
      end
      redis.call('XDEL', stream, id)
      redis.call('HDEL', acks, id)
    end
  end
end
return done
"""

# XADD only while fewer than ARGV[1] entries wait, so concurrent producers cannot overshoot the bound.
_BOUNDED_XADD_SCRIPT = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return false end
local fields = {}
for i = 2, #ARGV do fields[#fields + 1] = ARGV[i] end
return redis.call('XADD', KEYS[1], '*', unpack(fields))
"""


def connect(url: str, *, password: str | None = None, timeout_s: float = 30.0) -> redis.Redis:
    """A binary-safe client; `rediss://` URLs get TLS from redis-py."""
    return redis.Redis.from_url(url, password=password, socket_timeout=timeout_s, socket_connect_timeout=10.0,
                                health_check_interval=30, retry_on_timeout=False)


def stream_key(prefix: str, run_name: str) -> str:
    return f"{prefix}:{run_name}:rollouts"


class RolloutBuffer:
    """A producer and/or consumer handle on one run's stream.

    `groups` are all trainer roles that must acknowledge an entry before it is deleted; `group` is the one
    this handle consumes as (None for a producer-only handle).
    """

    def __init__(self, client: redis.Redis, stream: str, *, groups: tuple[str, ...] = ("actor",),
                 group: str | None = None, consumer: str = "consumer-0", max_buffered_batches: int = 4,
                 chunk_bytes: int = 64 << 20, claim_idle_ms: int = 60_000, inline_max_bytes: int = 1 << 20):
        if group is not None and group not in groups:
            raise BufferError(f"consumer group {group!r} is not one of the run's roles {groups}")
        self.client = client
        self.stream = stream
        self.dead_stream = f"{stream}:dead"
        self.acks_key = f"{stream}:acks"
        self.groups = groups
        self.group = group
        self.consumer = consumer
        self.max_buffered_batches = max_buffered_batches
        self.chunk_bytes = int(chunk_bytes)
        self.inline_max_bytes = min(inline_max_bytes, self.chunk_bytes)
        self.claim_idle_ms = claim_idle_ms
        self.stats = BufferStats()
        self._held: dict[str, BufferEntry] = {}   # delivered to us, not yet acked nor handed out by read()
        self._read_own_pending = True              # first read re-delivers what this consumer had pending
        self._ack = client.register_script(_ACK_SCRIPT)
        self._bounded_xadd = client.register_script(_BOUNDED_XADD_SCRIPT)
        self.ensure_groups()

    def ensure_groups(self) -> None:
        for g in self.groups:
            try:
                self.client.xgroup_create(self.stream, g, id="0", mkstream=True)
            except redis.exceptions.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # ---- producer ---------------------------------------------------------------------------------

    def put(self, batch: RolloutBatchData, *, trace_context: dict[str, str] | None = None,
            timeout_s: float = 300.0) -> str:
        return self.put_payload(encode_batch(batch), rollout_id=batch.rollout_id,
                                policy_version=batch.policy_version, producer=batch.producer,
                                trace_context=trace_context, timeout_s=timeout_s)

    def put_payload(self, payload: bytes, *, rollout_id: int, policy_version: int, producer: str = "",
                    trace_context: dict[str, str] | None = None, timeout_s: float = 300.0) -> str:
        fields: dict[str, bytes | str | int] = {
            "rollout_id": rollout_id, "policy_version": policy_version, "producer": producer,
            "nbytes": len(payload), "checksum": payload_checksum(payload),
            "trace": json.dumps(trace_context or {})}
        chunk_keys: list[str] = []
        if len(payload) <= self.inline_max_bytes:
            fields["payload"] = payload
        else:
            prefix = f"{self.stream}:chunk:{uuid.uuid4().hex}"
            view = memoryview(payload)
            chunk_keys = [f"{prefix}:{i}" for i in range(0, (len(payload) + self.chunk_bytes - 1) // self.chunk_bytes)]
            fields.update(chunks=len(chunk_keys), chunk_prefix=prefix)
        deadline = time.monotonic() + timeout_s
        chunks_written = False
        while True:
            if self.client.xlen(self.stream) < self.max_buffered_batches:
                if chunk_keys and not chunks_written:
                    self._write_chunks(chunk_keys, view)
                    chunks_written = True
                entry_id = self._bounded_xadd(keys=[self.stream], args=[
                    self.max_buffered_batches, *[x for kv in fields.items() for x in kv]])
                if entry_id is not None:
                    return entry_id.decode()
            if time.monotonic() >= deadline:
                if chunks_written:
                    self.client.delete(*chunk_keys)
                raise BufferFullError(
                    f"rollout buffer {self.stream} stayed full ({self.max_buffered_batches} batches waiting, "
                    f"redis.max_buffered_batches) for {timeout_s:.1f}s: is the trainer consuming?")
            time.sleep(0.02)

    def _write_chunks(self, keys: list[str], view: memoryview) -> None:
        pipe = self.client.pipeline(transaction=True)
        for i, key in enumerate(keys):
            pipe.set(key, view[i * self.chunk_bytes:(i + 1) * self.chunk_bytes].tobytes())
        pipe.execute()

    # ---- consumer ---------------------------------------------------------------------------------

    def _require_group(self) -> str:
        if self.group is None:
            raise BufferError("this buffer handle is producer-only (no consumer group given)")
        return self.group

    def get(self, count: int = 1, *, block_ms: int = 1000) -> list[BufferEntry]:
        """Up to `count` entries for this consumer: ones held from earlier reads, then own pending
        (after a restart), then stale ones of dead consumers, then new ones. Each stays pending until ack."""
        group = self._require_group()
        out = list(self._held.values())[:count]
        for e in out:
            del self._held[e.entry_id]
        if len(out) < count and self._read_own_pending:
            out += self._deliver(self.client.xreadgroup(group, self.consumer, {self.stream: "0"},
                                                        count=count - len(out)))
            if len(out) < count:
                self._read_own_pending = False
        if len(out) < count:
            out += self.claim_stale(count=count - len(out))
        if len(out) < count:
            out += self._deliver(self.client.xreadgroup(group, self.consumer, {self.stream: ">"},
                                                        count=count - len(out), block=block_ms or None))
        return out

    def read(self, entry_ids: list[str], *, timeout_s: float = 300.0) -> list[BufferEntry]:
        """Exactly these entries, in this order (what the coordinator named in a Train call)."""
        self._require_group()
        wanted = list(dict.fromkeys(entry_ids))
        for entry_id in wanted:
            if entry_id not in self._held and not self.client.xrange(self.stream, entry_id, entry_id):
                dead = [d for d in self.stats.dead_lettered if d.entry_id == entry_id]
                reason = f" (dead-lettered: {dead[0].reason})" if dead else ""
                raise EntryNotFoundError(f"entry {entry_id} is not in stream {self.stream}{reason}")
        self._claim_ids([i for i in wanted if i not in self._held])
        deadline = time.monotonic() + timeout_s
        while any(i not in self._held for i in wanted):
            missing = [i for i in wanted if i not in self._held]
            if any(d.entry_id in missing for d in self.stats.dead_lettered):
                bad = next(d for d in self.stats.dead_lettered if d.entry_id in missing)
                raise EntryNotFoundError(f"entry {bad.entry_id} was dead-lettered: {bad.reason}")
            if time.monotonic() >= deadline:
                raise BufferError(f"entries {missing} not delivered to group {self.group} within {timeout_s}s")
            for e in self.get(count=len(missing) + len(self._held), block_ms=200):
                self._held[e.entry_id] = e
        return [self._held.pop(i) for i in wanted]

    def _claim_ids(self, entry_ids: list[str]) -> None:
        """Takes over named entries pending at another consumer of our group (e.g. a dead trainer)."""
        if not entry_ids:
            return
        raw = self.client.xclaim(self.stream, self.group, self.consumer, min_idle_time=0, message_ids=entry_ids)
        for e in self._deliver([[self.stream.encode(), raw]]):
            self._held[e.entry_id] = e

    def claim_stale(self, *, count: int = 16) -> list[BufferEntry]:
        group = self._require_group()
        _, raw, *_ = self.client.xautoclaim(self.stream, group, self.consumer, min_idle_time=self.claim_idle_ms,
                                            start_id="0-0", count=count)
        entries = self._deliver([[self.stream.encode(), raw]])
        self.stats.claimed += len(entries)
        return entries

    def ack(self, entry_ids: list[str]) -> int:
        group = self._require_group()
        if not entry_ids:
            return 0
        for i in entry_ids:
            self._held.pop(i, None)
        return int(self._ack(keys=[self.stream, self.acks_key], args=[group, len(self.groups), *entry_ids]))

    def _deliver(self, response) -> list[BufferEntry]:
        out = []
        for _stream, messages in response or []:
            for raw_id, fields in messages:
                if fields is None:      # deleted while pending (XCLAIM/XAUTOCLAIM can return these)
                    continue
                entry = self._decode_entry(raw_id.decode(), fields)
                if entry is not None:
                    out.append(entry)
        return out

    def _decode_entry(self, entry_id: str, fields: dict[bytes, bytes]) -> BufferEntry | None:
        try:
            payload = self._payload(entry_id, fields)
            expected = fields.get(b"checksum", b"").decode()
            if payload_checksum(payload) != expected:
                raise WireError(f"checksum mismatch (entry says {expected}, payload is {payload_checksum(payload)})")
            batch = decode_batch(payload)
            trace = json.loads(fields.get(b"trace", b"{}").decode() or "{}")
            return BufferEntry(entry_id=entry_id, batch=batch, rollout_id=batch.rollout_id,
                               policy_version=batch.policy_version,
                               trace_context={str(k): str(v) for k, v in trace.items()},
                               producer=batch.producer, nbytes=len(payload))
        except (WireError, ValueError, UnicodeDecodeError) as exc:
            self._dead_letter(entry_id, fields, str(exc))
            return None

    def _payload(self, entry_id: str, fields: dict[bytes, bytes]) -> bytes:
        if b"payload" in fields:
            return fields[b"payload"]
        if b"chunks" not in fields or b"chunk_prefix" not in fields:
            raise WireError("entry has neither payload nor chunks")
        n, prefix = int(fields[b"chunks"]), fields[b"chunk_prefix"].decode()
        parts = self.client.mget([f"{prefix}:{i}" for i in range(n)])
        if any(p is None for p in parts):
            raise WireError(f"{sum(p is None for p in parts)} of {n} chunks are missing")
        return b"".join(parts)

    def _dead_letter(self, entry_id: str, fields: dict[bytes, bytes], reason: str) -> None:
        log.error("rollout entry %s in %s is corrupted, moved to %s: %s", entry_id, self.stream,
                  self.dead_stream, reason)
        dead_fields = {**fields, b"original_id": entry_id.encode(), b"reason": reason.encode(),
                       b"dead_at_ns": str(time.time_ns()).encode()}
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.dead_stream, dead_fields)
        for g in self.groups:
            pipe.xack(self.stream, g, entry_id)
        pipe.xdel(self.stream, entry_id)
        pipe.hdel(self.acks_key, entry_id)
        pipe.execute()
        self.stats.dead_lettered.append(DeadLetter(entry_id=entry_id, reason=reason))

    # ---- introspection ----------------------------------------------------------------------------

    def backlog(self) -> int:
        """Batches in the stream not yet acknowledged by every role."""
        return int(self.client.xlen(self.stream))

    def pending(self) -> int:
        info = self.client.xpending(self.stream, self._require_group())
        return int(info["pending"])

    def dead_letters(self) -> list[tuple[str, dict[bytes, bytes]]]:
        return [(i.decode(), f) for i, f in self.client.xrange(self.dead_stream)]

"""The rollout buffer: one Redis stream per run, one consumer group per trainer role.

Entry layout (all fields bytes):
    rollout_id, policy_version, producer, nbytes, checksum (of the whole payload), trace (JSON carrier),
    and either `payload` (small batches) or `chunks` = N and `chunk_prefix` with the payload in N string
    keys `<stream>:chunk:<uuid>:<i>` (each at most `chunk_bytes`, below Redis' 512 MB bulk limit).
    Chunks are written first with an expiry; the XADD script checks they all exist and makes them
    persistent atomically with the XADD, so a producer that dies in between leaves nothing behind.

Life of an entry: `put` (blocks while `max_buffered_batches` entries wait) → `get`/`read` by a trainer role
(the entry is pending in that group until `ack`) → `ack` once the optimizer step that used it is committed.
The entry (and its chunks) is deleted when every role's group has acknowledged it, so XLEN is the number
of batches still waiting for someone. Pending entries of a dead consumer are taken over (XAUTOCLAIM)
after `claim_idle_ms`; a restarted consumer with the same name first gets its own pending entries back.
An entry that fails its checksum or does not decode goes to `<stream>:dead` with the reason (chunks kept),
is removed from the live stream, and is reported — the consumer carries on.

A handle never hands out the same entry twice: entries it delivered and that are not acknowledged yet are
skipped by later `get` calls (ask for them again by id with `read`).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from services.buffer import scripts
from services.contracts.config import RedisConfig, TimeoutsConfig
from services.contracts.wire import RolloutBatchData, WireError, decode_batch, encode_batch, payload_checksum

log = logging.getLogger(__name__)


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


@dataclass
class _Put:
    """One put in progress: the XADD script's keys (stream, put key, chunk keys...) and arguments, and whether
    its chunk keys were written without an entry owning them yet (to delete if the put gives up)."""

    keys: list[str]
    args: list[bytes | str | int]
    chunk_keys: list[str]
    view: memoryview
    chunk_ttl_s: int
    chunks_written: bool = False


@dataclass
class BufferStats:
    dead_lettered: list[DeadLetter] = field(default_factory=list)
    claimed: int = 0


_REDIS, _TIMEOUTS = RedisConfig(), TimeoutsConfig()   # defaults of a handle built without a config

# The longest single blocking XREADGROUP: well below the client's socket timeout.
_BLOCK_SLICE_MS = 5_000
_HEALTH_CHECK_EVERY_S = 30   # redis-py pings a connection idle this long before using it
_FULL_POLL_S = 0.02          # put: how often to look again while the stream is full
_UNREACHABLE_RETRY_S = 0.2   # put: pause between attempts while Redis is unreachable


def connect(url: str, *, password: str | None = None, timeout_s: float = _TIMEOUTS.redis_socket_s,
            connect_timeout_s: float = _TIMEOUTS.redis_connect_s) -> redis.Redis:
    """A binary-safe client; `rediss://` URLs get TLS from redis-py. The deadlines are
    services.timeouts.redis_socket_s (one command) and redis_connect_s; services pass their config's."""
    return redis.Redis.from_url(url, password=password, socket_timeout=timeout_s,
                                socket_connect_timeout=connect_timeout_s, health_check_interval=_HEALTH_CHECK_EVERY_S)


def redacted(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return re.sub(r"//[^@/]*@", "//***@", url or "")


def stream_key(prefix: str, run_name: str) -> str:
    return f"{prefix}:{run_name}:rollouts"


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


Rows = list[tuple[bytes, dict[bytes, bytes]]]   # XRANGE's answer on a binary client (redis-py types it loosely)


def _rows(response: Any) -> Rows:
    return cast(Rows, response or [])


def _messages(response: Any) -> Rows:
    """The (id, fields) pairs of an XREADGROUP answer over one stream."""
    return [m for _stream, msgs in response or [] for m in msgs]


class RolloutBuffer:
    """A producer and/or consumer handle on one run's stream.

    `groups` are all trainer roles that must acknowledge an entry before it is deleted; `group` is the one
    this handle consumes as (None for a producer-only handle). A handle is not thread-safe.
    """

    def __init__(self, client: redis.Redis, stream: str, *, groups: tuple[str, ...] = ("actor",),
                 group: str | None = None, consumer: str = "consumer-0",
                 max_buffered_batches: int = _REDIS.max_buffered_batches,
                 chunk_bytes: int = int(_REDIS.chunk_mb * 2**20), claim_idle_ms: int = _REDIS.claim_idle_ms,
                 inline_max_bytes: int = 1 << 20):
        groups = tuple(groups)
        if not groups:
            raise BufferError("a rollout buffer needs at least one consumer group")
        if group is not None and group not in groups:
            raise BufferError(f"consumer group {group!r} is not one of the run's roles {groups}")
        if max_buffered_batches < 1:
            raise BufferError(f"max_buffered_batches must be >= 1, got {max_buffered_batches}")
        if not 0 < int(chunk_bytes) <= 256 << 20:
            raise BufferError(f"chunk_bytes must be in (0, 256 MiB] (Redis' bulk limit is 512 MB), got {chunk_bytes}")
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
        self._held: dict[str, BufferEntry] = {}   # delivered to us, not yet handed out (read() fetched past them)
        self._outstanding: set[str] = set()       # handed out by get/read, not yet acked
        self._own_cursor: str | None = "0"         # next own-pending id to re-read after a restart; None = done
        self._ack = client.register_script(scripts.ACK)
        self._skip = client.register_script(scripts.SKIP)
        self._bounded_xadd = client.register_script(scripts.BOUNDED_XADD)
        self._dead_letter_script = client.register_script(scripts.DEAD_LETTER)
        self._delete_script = client.register_script(scripts.DELETE)
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
            timeout_s: float = _REDIS.put_timeout_s) -> str:
        """Adds one batch; blocks while `max_buffered_batches` entries wait (BufferFullError after timeout_s)."""
        return self.put_payload(encode_batch(batch), rollout_id=batch.rollout_id,
                                policy_version=batch.policy_version, producer=batch.producer,
                                trace_context=trace_context, timeout_s=timeout_s)

    def put_payload(self, payload: bytes, *, rollout_id: int, policy_version: int, producer: str = "",
                    trace_context: dict[str, str] | None = None, timeout_s: float = _REDIS.put_timeout_s) -> str:
        put = self._new_put(payload, rollout_id=rollout_id, policy_version=policy_version, producer=producer,
                            trace_context=trace_context, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    entry_id = self._try_put(put)
                    if entry_id is not None:
                        return entry_id
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                    # Redis restarting: keep trying until our deadline; an XADD that did run before the
                    # connection broke is answered from its put key, never added twice.
                    if time.monotonic() >= deadline:
                        raise
                    log.warning("rollout buffer %s: redis unreachable (%s); retrying", self.stream, exc)
                    time.sleep(_UNREACHABLE_RETRY_S)
                    continue
                if time.monotonic() >= deadline:
                    raise BufferFullError(
                        f"rollout buffer {self.stream} stayed full ({self.max_buffered_batches} batches waiting, "
                        f"redis.max_buffered_batches) for {timeout_s:.1f}s: is the trainer consuming and "
                        f"acknowledging?")
                time.sleep(_FULL_POLL_S)
        finally:
            if put.chunks_written:
                try:
                    self.client.delete(*put.chunk_keys)
                except redis.exceptions.RedisError:   # they expire anyway
                    log.warning("could not delete the chunks of an unwritten batch under %s", put.keys[1])

    def _new_put(self, payload: bytes, *, rollout_id: int, policy_version: int, producer: str,
                 trace_context: dict[str, str] | None, timeout_s: float) -> _Put:
        put_id = uuid.uuid4().hex
        fields: dict[str, bytes | str | int] = {
            "rollout_id": rollout_id, "policy_version": policy_version, "producer": producer,
            "nbytes": len(payload), "checksum": payload_checksum(payload),
            "trace": json.dumps(trace_context or {})}
        chunk_keys: list[str] = []
        if len(payload) <= self.inline_max_bytes:
            fields["payload"] = payload
        else:
            prefix = f"{self.stream}:chunk:{put_id}"
            chunk_keys = [f"{prefix}:{i}" for i in range((len(payload) + self.chunk_bytes - 1) // self.chunk_bytes)]
            fields.update(chunks=len(chunk_keys), chunk_prefix=prefix)
        # Orphaned chunks (producer died before the XADD) expire; the XADD makes them persistent.
        return _Put(keys=[self.stream, f"{self.stream}:put:{put_id}", *chunk_keys],
                    args=[self.max_buffered_batches, *[x for kv in fields.items() for x in kv]],
                    chunk_keys=chunk_keys, view=memoryview(payload), chunk_ttl_s=int(timeout_s) + 600)

    def _try_put(self, put: _Put) -> str | None:
        """Adds the entry if the stream has room (writing its chunks first); None while it is full."""
        while self.client.xlen(self.stream) < self.max_buffered_batches:
            if put.chunk_keys and not put.chunks_written:
                self._write_chunks(put.chunk_keys, put.view, put.chunk_ttl_s)
                put.chunks_written = True
            try:
                entry_id = self._bounded_xadd(keys=put.keys, args=put.args)
            except redis.exceptions.ResponseError as exc:
                if "TANDEM_CHUNK_MISSING" not in str(exc):
                    raise
                put.chunks_written = False       # expired while we waited: write them again
                continue
            if entry_id is None:
                return None
            put.chunks_written = False       # owned by the entry now
            return _s(entry_id)
        return None

    def _write_chunks(self, keys: list[str], view: memoryview, ttl_s: int) -> None:
        pipe = self.client.pipeline(transaction=True)
        for i, key in enumerate(keys):
            pipe.set(key, view[i * self.chunk_bytes:(i + 1) * self.chunk_bytes], ex=ttl_s)
        pipe.execute()

    # ---- consumer ---------------------------------------------------------------------------------

    def _require_group(self) -> str:
        if self.group is None:
            raise BufferError("this buffer handle is producer-only (no consumer group given)")
        return self.group

    def get(self, count: int = 1, *, block_ms: int = 1000) -> list[BufferEntry]:
        """Up to `count` entries for this consumer: ones held from earlier reads, then own pending
        (after a restart), then stale ones of dead consumers (idle > claim_idle_ms), then new ones.

        Waits up to `block_ms` (0 = do not wait) while nothing is available; returns as soon as something
        is. Corrupted entries are dead-lettered and skipped. Each entry stays pending until `ack`."""
        group = self._require_group()
        out = self._take_held(count)
        if len(out) < count and self._own_cursor is not None:
            out += self._read_own_pending(count - len(out))
        self._outstanding.update(e.entry_id for e in out)   # so claim_stale does not hand them out again
        if len(out) < count:
            out += self.claim_stale(count=count - len(out))
        deadline = time.monotonic() + max(block_ms, 0) / 1000.0
        while len(out) < count:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            wait = not out and remaining_ms > 0
            response = self.client.xreadgroup(group, self.consumer, {self.stream: ">"}, count=count - len(out),
                                              block=min(remaining_ms, _BLOCK_SLICE_MS) if wait else None)
            messages = _messages(response)
            if messages:
                out += self._deliver(messages)   # loop again: dead-lettered ones are topped up
                continue
            if not wait:
                break
            out += self.claim_stale(count=count - len(out))   # a consumer may have died while we waited
        self._outstanding.update(e.entry_id for e in out)
        return out

    def _take_held(self, count: int) -> list[BufferEntry]:
        out = list(self._held.values())[:count]
        for e in out:
            del self._held[e.entry_id]
        self._outstanding.update(e.entry_id for e in out)
        return out

    def _read_own_pending(self, count: int) -> list[BufferEntry]:
        """After a restart: this consumer name's pending entries, oldest first, each once."""
        cursor = self._own_cursor
        assert cursor is not None
        response = self.client.xreadgroup(self._require_group(), self.consumer, {self.stream: cursor}, count=count)
        messages = _messages(response)
        self._own_cursor = _s(messages[-1][0]) if len(messages) >= count else None
        mine = self._outstanding | set(self._held)      # already handed out or held by this handle
        return self._deliver([m for m in messages if _s(m[0]) not in mine])

    def read(self, entry_ids: list[str], *, timeout_s: float = _REDIS.get_timeout_s) -> list[BufferEntry]:
        """Exactly these entries, in this order (what the coordinator named in a Train call).

        An entry pending at another consumer of this group (e.g. a dead trainer) is taken over at once;
        one not yet delivered to the group is read (entries before it are kept for later `get` calls).
        Raises EntryNotFoundError for an id that is not in the stream (never written, already acknowledged
        by every group, dead-lettered — the reason is given) or that this group already acknowledged."""
        group = self._require_group()
        wanted = [_s(i) for i in dict.fromkeys(entry_ids)]
        for entry_id in wanted:
            if entry_id not in self._held:
                self._check_exists(entry_id)
        deadline = time.monotonic() + timeout_s
        while missing := self._not_held(wanted):
            self._claim_ids(missing)
            missing = self._not_held(missing)
            if not missing:
                break
            self._raise_if_dead_lettered(missing)
            if not self._hold_next_delivery(group):
                # Nothing left to deliver to the group: the missing ids were delivered and acknowledged
                # (or removed meanwhile); re-check so the error says which.
                self._raise_if_gone(missing, group)
            if time.monotonic() >= deadline:
                raise BufferError(f"entries {missing} not delivered to group {group} within {timeout_s}s")
        out = [self._held.pop(i) for i in wanted]
        self._outstanding.update(wanted)
        return out

    def _not_held(self, entry_ids: list[str]) -> list[str]:
        return [i for i in entry_ids if i not in self._held]

    def _raise_if_dead_lettered(self, entry_ids: list[str]) -> None:
        for d in self.stats.dead_lettered:
            if d.entry_id in entry_ids:
                raise EntryNotFoundError(f"entry {d.entry_id} of {self.stream} was dead-lettered: {d.reason}")

    def _hold_next_delivery(self, group: str) -> bool:
        """Reads the group's next undelivered entry into `_held`; False when there is none."""
        messages = _messages(self.client.xreadgroup(group, self.consumer, {self.stream: ">"}, count=1))
        for e in self._deliver(messages):
            self._held[e.entry_id] = e
        return bool(messages)

    def _raise_if_gone(self, entry_ids: list[str], group: str) -> None:
        for entry_id in entry_ids:
            self._check_exists(entry_id)
            if not self._pending_in_group(entry_id):
                raise EntryNotFoundError(f"entry {entry_id} of {self.stream} was already acknowledged "
                                         f"by group {group}")

    def _check_exists(self, entry_id: str) -> None:
        try:
            found = self.client.xrange(self.stream, entry_id, entry_id)
        except redis.exceptions.ResponseError:
            raise EntryNotFoundError(f"{entry_id!r} is not a valid stream entry id") from None
        if not found:
            reason = self._dead_reason(entry_id)
            detail = f" (dead-lettered: {reason})" if reason is not None else \
                " (never written, or acknowledged by every group and deleted)"
            raise EntryNotFoundError(f"entry {entry_id} is not in stream {self.stream}{detail}")

    def _dead_reason(self, entry_id: str) -> str | None:
        for d in self.stats.dead_lettered:
            if d.entry_id == entry_id:
                return d.reason
        for _id, fields in _rows(self.client.xrange(self.dead_stream)):
            if fields.get(b"original_id", b"").decode() == entry_id:
                return fields.get(b"reason", b"").decode(errors="replace")
        return None

    def _pending_in_group(self, entry_id: str) -> bool:
        rows = self.client.xpending_range(self.stream, self._require_group(), min=entry_id, max=entry_id, count=1)
        return bool(rows)

    def _claim_ids(self, entry_ids: list[str]) -> None:
        """Takes over named entries pending at any consumer of our group (e.g. a dead trainer, or us)."""
        if not entry_ids:
            return
        claimed = self.client.xclaim(self.stream, self._require_group(), self.consumer, min_idle_time=0,
                                     message_ids=cast(list[Any], entry_ids), justid=True)
        for e in self._fetch_and_deliver([_s(i) for i in cast(list[bytes], claimed)]):
            self._held[e.entry_id] = e

    def claim_stale(self, *, count: int = 16) -> list[BufferEntry]:
        """Takes over up to `count` entries pending at other consumers of our group for longer than
        `claim_idle_ms` (a consumer that died); they are then pending at this consumer."""
        group = self._require_group()
        mine = self._outstanding | set(self._held)
        # XAUTOCLAIM also re-claims our own idle entries; ask for enough to get past them.
        ids = self.client.xautoclaim(self.stream, group, self.consumer, min_idle_time=self.claim_idle_ms,
                                     start_id="0-0", count=count + len(mine), justid=True)
        entries = self._fetch_and_deliver([_s(i) for i in ids if _s(i) not in mine])
        for extra in entries[count:]:        # claimed already: keep them for the next get
            self._held[extra.entry_id] = extra
        entries = entries[:count]
        if entries:
            log.warning("%s/%s took over %d entries of a dead consumer: %s", group, self.consumer, len(entries),
                        [e.entry_id for e in entries])
        self.stats.claimed += len(entries)
        return entries

    def _fetch_and_deliver(self, entry_ids: list[str]) -> list[BufferEntry]:
        """Entries now pending at us, by id; ones deleted meanwhile are acknowledged away."""
        if not entry_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for i in entry_ids:
            pipe.xrange(self.stream, i, i)
        messages = [rows[0] for rows in pipe.execute() if rows]
        found = {_s(m[0]) for m in messages}
        gone = [i for i in entry_ids if i not in found]
        if gone:
            self.client.xack(self.stream, self._require_group(), *gone)
        return self._deliver(messages)

    def ack(self, entry_ids: list[str]) -> int:
        """Acknowledges for this handle's group; returns how many were pending. The entry and its chunks
        are deleted once every group has acknowledged it."""
        group = self._require_group()
        if not entry_ids:
            return 0
        ids = [_s(i) for i in entry_ids]
        for i in ids:
            self._held.pop(i, None)
            self._outstanding.discard(i)
        return int(self._ack(keys=[self.stream, self.acks_key], args=[group, len(self.groups), *ids]))

    def skip(self, entry_ids: list[str], *, group: str) -> int:
        """`group` will never train these entries: count them as acknowledged by it (once), so the bound on
        waiting batches is not held up by a role that sits out a step. Returns how many were counted."""
        if group not in self.groups:
            raise BufferError(f"consumer group {group!r} is not one of the run's roles {self.groups}")
        ids = [_s(i) for i in entry_ids]
        if not ids:
            return 0
        return int(self._skip(keys=[self.stream, self.acks_key, f"{self.stream}:skipped:{group}"],
                              args=[group, len(self.groups), *ids]))

    def discard_except(self, keep: list[str]) -> int:
        """Deletes every entry of the stream (with its chunks, from every group) except those in `keep`;
        returns how many were removed. For a resume: batches generated after the last checkpoint are dropped."""
        keep_ids = {_s(i) for i in keep}
        drop: list[str] = []
        last = "-"
        while True:
            rows = [r for r in _rows(self.client.xrange(self.stream, min=last, max="+", count=256)) if _s(r[0]) != last]
            if not rows:
                break
            drop += [_s(r[0]) for r in rows if _s(r[0]) not in keep_ids]
            last = _s(rows[-1][0])
        removed = 0
        for start in range(0, len(drop), 256):
            part = drop[start:start + 256]
            removed += int(self._delete_script(keys=[self.stream, self.acks_key],
                                               args=[len(self.groups), *self.groups, *part]))
        for i in drop:
            self._held.pop(i, None)
            self._outstanding.discard(i)
        return removed

    def delete(self, entry_ids: list[str]) -> int:
        """Deletes these entries (with their chunks, from every group): batches nobody will train."""
        ids = [_s(i) for i in entry_ids]
        if not ids:
            return 0
        for i in ids:
            self._held.pop(i, None)
            self._outstanding.discard(i)
        return int(self._delete_script(keys=[self.stream, self.acks_key], args=[len(self.groups), *self.groups, *ids]))

    def missing(self, entry_ids: list[str]) -> list[str]:
        """The ids that are not in the stream (never written, or acknowledged by every group and deleted)."""
        pipe = self.client.pipeline(transaction=False)
        for i in entry_ids:
            pipe.xrange(self.stream, i, i)
        return [_s(i) for i, rows in zip(entry_ids, pipe.execute(), strict=True) if not rows]

    def _deliver(self, messages: Rows) -> list[BufferEntry]:
        out = []
        for raw_id, fields in messages:
            if raw_id is None:
                continue
            entry_id = _s(raw_id)
            if not fields:      # deleted while pending (XREADGROUP 0 returns these empty): clean up
                self.client.xack(self.stream, self._require_group(), entry_id)
                continue
            entry = self._decode_entry(entry_id, fields)
            if entry is not None:
                out.append(entry)
        return out

    def _decode_entry(self, entry_id: str, fields: dict[bytes, bytes]) -> BufferEntry | None:
        try:
            payload = self._payload(entry_id, fields)
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
            return BufferEntry(entry_id=entry_id, batch=batch, rollout_id=batch.rollout_id,
                               policy_version=batch.policy_version,
                               trace_context={str(k): str(v) for k, v in trace.items()},
                               producer=batch.producer, nbytes=len(payload))
        except (WireError, ValueError, UnicodeDecodeError) as exc:
            self._dead_letter(entry_id, str(exc))
            return None

    def _payload(self, entry_id: str, fields: dict[bytes, bytes]) -> bytes:
        if b"payload" in fields:
            return fields[b"payload"]
        if b"chunks" not in fields or b"chunk_prefix" not in fields:
            raise WireError("entry has neither payload nor chunks")
        n, prefix = int(fields[b"chunks"]), fields[b"chunk_prefix"].decode()
        parts = cast(list[bytes | None], self.client.mget([f"{prefix}:{i}" for i in range(n)]) if n else [])
        missing = [i for i, p in enumerate(parts) if p is None]
        if missing:
            raise WireError(f"{len(missing)} of {n} chunks are missing (chunk {missing[0]}: {prefix}:{missing[0]})")
        return b"".join(p for p in parts if p is not None)

    def _dead_letter(self, entry_id: str, reason: str) -> None:
        log.error("rollout entry %s in %s is corrupted, moved to %s: %s", entry_id, self.stream,
                  self.dead_stream, reason)
        self._dead_letter_script(keys=[self.stream, self.dead_stream, self.acks_key],
                                 args=[entry_id, reason, time.time_ns(), *self.groups])
        self._held.pop(entry_id, None)
        self._outstanding.discard(entry_id)
        self.stats.dead_lettered.append(DeadLetter(entry_id=entry_id, reason=reason))

    # ---- introspection ----------------------------------------------------------------------------

    def backlog(self) -> int:
        """Batches in the stream not yet acknowledged by every role."""
        return int(self.client.xlen(self.stream))

    def pending(self) -> int:
        """Entries delivered to this handle's group (any consumer) and not yet acknowledged by it."""
        info = self.client.xpending(self.stream, self._require_group())
        return int(info["pending"])

    def dead_letters(self) -> list[tuple[str, dict[bytes, bytes]]]:
        """Entries of the dead-letter stream: (dead id, fields incl. original_id and reason)."""
        return [(_s(i), f) for i, f in _rows(self.client.xrange(self.dead_stream))]

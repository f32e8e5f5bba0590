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

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from services.buffer import scripts
from services.buffer.entries import (
    DECODE_ERRORS,
    BufferEntry,
    BufferError,
    BufferFullError,
    DeadLetter,
    EntryNotFoundError,
    Rows,
    decode_entry,
)
from services.buffer.entries import as_str as _s
from services.buffer.entries import messages as _messages
from services.buffer.entries import rows as _rows
from services.buffer.producer import StreamProducer
from services.contracts.config import RedisConfig, TimeoutsConfig
from services.contracts.wire import RolloutBatchData, encode_batch

log = logging.getLogger(__name__)

__all__ = [
    "BufferEntry",
    "BufferError",
    "BufferFullError",
    "BufferStats",
    "DeadLetter",
    "EntryNotFoundError",
    "RolloutBuffer",
    "connect",
    "redacted",
    "stream_key",
]


@dataclass
class BufferStats:
    dead_lettered: list[DeadLetter] = field(default_factory=list)
    claimed: int = 0


_REDIS, _TIMEOUTS = RedisConfig(), TimeoutsConfig()  # defaults of a handle built without a config

# The longest single blocking XREADGROUP: well below the client's socket timeout.
_BLOCK_SLICE_MS = 5_000
_PAGE = _DELETE_BATCH = 256  # entries read per XRANGE page / removed per script call
_HEALTH_CHECK_EVERY_S = 30  # redis-py pings a connection idle this long before using it


def connect(
    url: str,
    *,
    password: str | None = None,
    timeout_s: float = _TIMEOUTS.redis_socket_s,
    connect_timeout_s: float = _TIMEOUTS.redis_connect_s,
) -> redis.Redis:
    """A binary-safe client; `rediss://` URLs get TLS from redis-py. The deadlines are
    services.timeouts.redis_socket_s (one command) and redis_connect_s; services pass their config's."""
    return redis.Redis.from_url(
        url,
        password=password,
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s,
        health_check_interval=_HEALTH_CHECK_EVERY_S,
    )


def redacted(url: str | None) -> str:
    """The URL without its password, for messages and logs."""
    return re.sub(r"//[^@/]*@", "//***@", url or "")


def stream_key(prefix: str, run_name: str) -> str:
    return f"{prefix}:{run_name}:rollouts"


def _check_handle(*, groups: tuple[str, ...], group: str | None, max_buffered_batches: int, chunk_bytes: int) -> None:
    if not groups:
        raise BufferError("a rollout buffer needs at least one consumer group")
    if group is not None and group not in groups:
        raise BufferError(f"consumer group {group!r} is not one of the run's roles {groups}")
    if max_buffered_batches < 1:
        raise BufferError(f"max_buffered_batches must be >= 1, got {max_buffered_batches}")
    if not 0 < int(chunk_bytes) <= 256 << 20:
        raise BufferError(f"chunk_bytes must be in (0, 256 MiB] (Redis' bulk limit is 512 MB), got {chunk_bytes}")


def _create_groups(client: redis.Redis, stream: str, groups: tuple[str, ...]) -> None:
    for g in groups:
        try:
            client.xgroup_create(stream, g, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def _check_in_stream(client: redis.Redis, stream: str, entry_id: str, *, dead_reason: Callable[[], str | None]) -> None:
    """EntryNotFoundError, saying why where it can, unless `entry_id` is in the stream."""
    try:
        found = client.xrange(stream, entry_id, entry_id)
    except redis.exceptions.ResponseError:
        raise EntryNotFoundError(f"{entry_id!r} is not a valid stream entry id") from None
    if not found:
        reason = dead_reason()
        detail = (
            f" (dead-lettered: {reason})"
            if reason is not None
            else " (never written, or acknowledged by every group and deleted)"
        )
        raise EntryNotFoundError(f"entry {entry_id} is not in stream {stream}{detail}")


def _dead_reason(client: redis.Redis, dead_stream: str, entry_id: str) -> str | None:
    for _id, fields in _rows(client.xrange(dead_stream)):
        if fields.get(b"original_id", b"").decode() == entry_id:
            return fields.get(b"reason", b"").decode(errors="replace")
    return None


def _each_entry(client: redis.Redis, stream: str, entry_ids: list[str]) -> list[Rows]:
    """XRANGE of each id (one round trip): [] where the entry is not in the stream."""
    pipe = client.pipeline(transaction=False)
    for i in entry_ids:
        pipe.xrange(stream, i, i)
    return [_rows(found) for found in pipe.execute()]


def _all_ids(client: redis.Redis, stream: str) -> list[str]:
    ids: list[str] = []
    last = "-"
    while True:
        page = [r for r in _rows(client.xrange(stream, min=last, max="+", count=_PAGE)) if _s(r[0]) != last]
        if not page:
            return ids
        ids += [_s(r[0]) for r in page]
        last = ids[-1]


class RolloutBuffer:
    """A producer and/or consumer handle on one run's stream.

    `groups` are all trainer roles that must acknowledge an entry before it is deleted; `group` is the one
    this handle consumes as (None for a producer-only handle). A handle is not thread-safe.
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        *,
        groups: tuple[str, ...] = ("actor",),
        group: str | None = None,
        consumer: str = "consumer-0",
        max_buffered_batches: int = _REDIS.max_buffered_batches,
        chunk_bytes: int = int(_REDIS.chunk_mb * 2**20),
        claim_idle_ms: int = _REDIS.claim_idle_ms,
        inline_max_bytes: int = 1 << 20,
    ):
        groups = tuple(groups)
        _check_handle(groups=groups, group=group, max_buffered_batches=max_buffered_batches, chunk_bytes=chunk_bytes)
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
        self._held: dict[str, BufferEntry] = {}  # delivered to us, not yet handed out (read() fetched past them)
        self._outstanding: set[str] = set()  # handed out by get/read, not yet acked
        self._own_cursor: str | None = "0"  # next own-pending id to re-read after a restart; None = done
        self._ack = client.register_script(scripts.ACK)
        self._skip = client.register_script(scripts.SKIP)
        self._producer = StreamProducer(
            client,
            stream,
            max_buffered_batches=max_buffered_batches,
            chunk_bytes=self.chunk_bytes,
            inline_max_bytes=self.inline_max_bytes,
        )
        self._dead_letter_script = client.register_script(scripts.DEAD_LETTER)
        self._delete_script = client.register_script(scripts.DELETE)
        self.ensure_groups()

    def ensure_groups(self) -> None:
        _create_groups(self.client, self.stream, self.groups)

    # ---- producer ---------------------------------------------------------------------------------

    def put(
        self,
        batch: RolloutBatchData,
        *,
        trace_context: dict[str, str] | None = None,
        timeout_s: float = _REDIS.put_timeout_s,
    ) -> str:
        """Adds one batch; blocks while `max_buffered_batches` entries wait (BufferFullError after timeout_s)."""
        return self.put_payload(
            encode_batch(batch),
            rollout_id=batch.rollout_id,
            policy_version=batch.policy_version,
            producer=batch.producer,
            trace_context=trace_context,
            timeout_s=timeout_s,
        )

    def put_payload(
        self,
        payload: bytes,
        *,
        rollout_id: int,
        policy_version: int,
        producer: str = "",
        trace_context: dict[str, str] | None = None,
        timeout_s: float = _REDIS.put_timeout_s,
    ) -> str:
        """Adds an encoded batch (see `put`)."""
        return self._producer.put_payload(
            payload,
            rollout_id=rollout_id,
            policy_version=policy_version,
            producer=producer,
            trace_context=trace_context,
            timeout_s=timeout_s,
        )

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
        self._outstanding.update(e.entry_id for e in out)  # so claim_stale does not hand them out again
        if len(out) < count:
            out += self.claim_stale(count=count - len(out))
        deadline = time.monotonic() + max(block_ms, 0) / 1000.0
        while len(out) < count:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            wait = not out and remaining_ms > 0
            response = self.client.xreadgroup(
                group,
                self.consumer,
                {self.stream: ">"},
                count=count - len(out),
                block=min(remaining_ms, _BLOCK_SLICE_MS) if wait else None,
            )
            messages = _messages(response)
            if messages:
                out += self._deliver(messages)  # loop again: dead-lettered ones are topped up
                continue
            if not wait:
                break
            out += self.claim_stale(count=count - len(out))  # a consumer may have died while we waited
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
        mine = self._outstanding | set(self._held)  # already handed out or held by this handle
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
            if not self.client.xpending_range(self.stream, group, min=entry_id, max=entry_id, count=1):
                raise EntryNotFoundError(f"entry {entry_id} of {self.stream} was already acknowledged by group {group}")

    def _check_exists(self, entry_id: str) -> None:
        def why_gone() -> str | None:
            known = next((d.reason for d in self.stats.dead_lettered if d.entry_id == entry_id), None)
            return known if known is not None else _dead_reason(self.client, self.dead_stream, entry_id)

        _check_in_stream(self.client, self.stream, entry_id, dead_reason=why_gone)

    def _claim_ids(self, entry_ids: list[str]) -> None:
        """Takes over named entries pending at any consumer of our group (e.g. a dead trainer, or us)."""
        if not entry_ids:
            return
        claimed = self.client.xclaim(
            self.stream,
            self._require_group(),
            self.consumer,
            min_idle_time=0,
            message_ids=cast(list[Any], entry_ids),
            justid=True,
        )
        for e in self._fetch_and_deliver([_s(i) for i in cast(list[bytes], claimed)]):
            self._held[e.entry_id] = e

    def claim_stale(self, *, count: int = 16) -> list[BufferEntry]:
        """Takes over up to `count` entries pending at other consumers of our group for longer than
        `claim_idle_ms` (a consumer that died); they are then pending at this consumer."""
        group = self._require_group()
        mine = self._outstanding | set(self._held)
        # XAUTOCLAIM also re-claims our own idle entries; ask for enough to get past them.
        ids = self.client.xautoclaim(
            self.stream,
            group,
            self.consumer,
            min_idle_time=self.claim_idle_ms,
            start_id="0-0",
            count=count + len(mine),
            justid=True,
        )
        entries = self._fetch_and_deliver([_s(i) for i in ids if _s(i) not in mine])
        for extra in entries[count:]:  # claimed already: keep them for the next get
            self._held[extra.entry_id] = extra
        entries = entries[:count]
        if entries:
            log.warning(
                "%s/%s took over %d entries of a dead consumer: %s",
                group,
                self.consumer,
                len(entries),
                [e.entry_id for e in entries],
            )
        self.stats.claimed += len(entries)
        return entries

    def _fetch_and_deliver(self, entry_ids: list[str]) -> list[BufferEntry]:
        """Entries now pending at us, by id; ones deleted meanwhile are acknowledged away."""
        if not entry_ids:
            return []
        messages = [rows[0] for rows in _each_entry(self.client, self.stream, entry_ids) if rows]
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
        self._forget(ids)
        return int(self._ack(keys=[self.stream, self.acks_key], args=[group, len(self.groups), *ids]))

    def skip(self, entry_ids: list[str], *, group: str) -> int:
        """`group` will never train these entries: count them as acknowledged by it (once), so the bound on
        waiting batches is not held up by a role that sits out a step. Returns how many were counted."""
        if group not in self.groups:
            raise BufferError(f"consumer group {group!r} is not one of the run's roles {self.groups}")
        ids = [_s(i) for i in entry_ids]
        if not ids:
            return 0
        return int(
            self._skip(
                keys=[self.stream, self.acks_key, f"{self.stream}:skipped:{group}"],
                args=[group, len(self.groups), *ids],
            )
        )

    def discard_except(self, keep: list[str]) -> int:
        """Deletes every entry of the stream (with its chunks, from every group) except those in `keep`;
        returns how many were removed. For a resume: batches generated after the last checkpoint are dropped."""
        keep_ids = {_s(i) for i in keep}
        return self.delete([i for i in _all_ids(self.client, self.stream) if i not in keep_ids])

    def delete(self, entry_ids: list[str]) -> int:
        """Deletes these entries (with their chunks, from every group): batches nobody will train."""
        ids = [_s(i) for i in entry_ids]
        self._forget(ids)
        removed = 0
        for start in range(0, len(ids), _DELETE_BATCH):
            removed += int(
                self._delete_script(
                    keys=[self.stream, self.acks_key],
                    args=[len(self.groups), *self.groups, *ids[start : start + _DELETE_BATCH]],
                )
            )
        return removed

    def missing(self, entry_ids: list[str]) -> list[str]:
        """The ids that are not in the stream (never written, or acknowledged by every group and deleted)."""
        found = _each_entry(self.client, self.stream, entry_ids)
        return [_s(i) for i, rows in zip(entry_ids, found, strict=True) if not rows]

    def _forget(self, entry_ids: list[str]) -> None:
        """These are acknowledged or gone: no longer held or handed out by this handle."""
        for i in entry_ids:
            self._held.pop(i, None)
            self._outstanding.discard(i)

    def _deliver(self, messages: Rows) -> list[BufferEntry]:
        out = []
        for raw_id, fields in messages:
            if raw_id is None:
                continue
            entry_id = _s(raw_id)
            if not fields:  # deleted while pending (XREADGROUP 0 returns these empty): clean up
                self.client.xack(self.stream, self._require_group(), entry_id)
                continue
            entry = self._decode_entry(entry_id, fields)
            if entry is not None:
                out.append(entry)
        return out

    def _decode_entry(self, entry_id: str, fields: dict[bytes, bytes]) -> BufferEntry | None:
        try:
            return decode_entry(self.client, entry_id, fields)
        except DECODE_ERRORS as exc:
            self._dead_letter(entry_id, str(exc))
            return None

    def _dead_letter(self, entry_id: str, reason: str) -> None:
        log.error(
            "rollout entry %s in %s is corrupted, moved to %s: %s", entry_id, self.stream, self.dead_stream, reason
        )
        self._dead_letter_script(
            keys=[self.stream, self.dead_stream, self.acks_key], args=[entry_id, reason, time.time_ns(), *self.groups]
        )
        self._forget([entry_id])
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

"""The producing side of the rollout buffer: a bounded, idempotent XADD of one encoded batch.

A payload above `inline_max_bytes` goes into chunk keys first, written with an expiry; the XADD script checks they
all exist and makes them persistent atomically with the XADD, so a producer that dies in between leaves nothing
behind. A retried XADD (redis-py retries on timeouts, and Redis may restart) is answered from its put key, never
added twice.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass

import redis

from services.buffer import scripts
from services.buffer.entries import BufferFullError, as_str
from services.contracts.wire import payload_checksum

log = logging.getLogger(__name__)

_FULL_POLL_S = 0.02  # how often to look again while the stream is full
_UNREACHABLE_RETRY_S = 0.2  # pause between attempts while Redis is unreachable
_CHUNK_TTL_EXTRA_S = 600  # orphaned chunks outlive the put's deadline by this much, then expire


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


class StreamProducer:
    """Adds entries to `stream` while fewer than `max_buffered_batches` wait."""

    def __init__(
        self, client: redis.Redis, stream: str, *, max_buffered_batches: int, chunk_bytes: int, inline_max_bytes: int
    ):
        self.client = client
        self.stream = stream
        self.max_buffered_batches = max_buffered_batches
        self.chunk_bytes = chunk_bytes
        self.inline_max_bytes = inline_max_bytes
        self._bounded_xadd = client.register_script(scripts.BOUNDED_XADD)

    def put_payload(
        self,
        payload: bytes,
        *,
        rollout_id: int,
        policy_version: int,
        producer: str = "",
        trace_context: dict[str, str] | None = None,
        timeout_s: float,
    ) -> str:
        put = self._new_put(
            payload,
            rollout_id=rollout_id,
            policy_version=policy_version,
            producer=producer,
            trace_context=trace_context,
            timeout_s=timeout_s,
        )
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
                        f"acknowledging?"
                    )
                time.sleep(_FULL_POLL_S)
        finally:
            if put.chunks_written:
                try:
                    self.client.delete(*put.chunk_keys)
                except redis.exceptions.RedisError:  # they expire anyway
                    log.warning("could not delete the chunks of an unwritten batch under %s", put.keys[1])

    def _new_put(
        self,
        payload: bytes,
        *,
        rollout_id: int,
        policy_version: int,
        producer: str,
        trace_context: dict[str, str] | None,
        timeout_s: float,
    ) -> _Put:
        put_id = uuid.uuid4().hex
        fields: dict[str, bytes | str | int] = {
            "rollout_id": rollout_id,
            "policy_version": policy_version,
            "producer": producer,
            "nbytes": len(payload),
            "checksum": payload_checksum(payload),
            "trace": json.dumps(trace_context or {}),
        }
        chunk_keys: list[str] = []
        if len(payload) <= self.inline_max_bytes:
            fields["payload"] = payload
        else:
            prefix = f"{self.stream}:chunk:{put_id}"
            chunk_keys = [f"{prefix}:{i}" for i in range((len(payload) + self.chunk_bytes - 1) // self.chunk_bytes)]
            fields.update(chunks=len(chunk_keys), chunk_prefix=prefix)
        # Orphaned chunks (producer died before the XADD) expire; the XADD makes them persistent.
        return _Put(
            keys=[self.stream, f"{self.stream}:put:{put_id}", *chunk_keys],
            args=[self.max_buffered_batches, *[x for kv in fields.items() for x in kv]],
            chunk_keys=chunk_keys,
            view=memoryview(payload),
            chunk_ttl_s=int(timeout_s) + _CHUNK_TTL_EXTRA_S,
        )

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
                put.chunks_written = False  # expired while we waited: write them again
                continue
            if entry_id is None:
                return None
            put.chunks_written = False  # owned by the entry now
            return as_str(entry_id)
        return None

    def _write_chunks(self, keys: list[str], view: memoryview, ttl_s: int) -> None:
        pipe = self.client.pipeline(transaction=True)
        for i, key in enumerate(keys):
            pipe.set(key, view[i * self.chunk_bytes : (i + 1) * self.chunk_bytes], ex=ttl_s)
        pipe.execute()

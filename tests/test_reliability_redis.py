"""kill -9 of redis-server (AOF on, appendfsync always) under a loaded rollout buffer: after a restart on the
same port and data directory no entry is lost — not the ones written and never read, not the ones delivered
and unacknowledged (pending at a dead consumer or at us), not a chunked one, not one half-acknowledged by
two trainer roles — none that was fully acknowledged comes back, and producers and consumers carry on."""

from __future__ import annotations

import threading

import pytest
from test_buffer import assert_same_batch, make_batch, pending_by_consumer, start_consumer

from services.buffer.stream import RolloutBuffer, connect
from services.launcher.redis_server import EmbeddedRedis

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(60)]
GROUPS = ("actor", "critic")


def _handle(client, stream: str, **kw) -> RolloutBuffer:
    return RolloutBuffer(
        client, stream, groups=GROUPS, max_buffered_batches=6, inline_max_bytes=4096, chunk_bytes=4096, **kw
    )


def test_redis_kill_9_loses_no_pending_or_unread_entry(fresh_redis: EmbeddedRedis, stream: str):
    client = connect(fresh_redis.url)
    producer = _handle(client, stream)
    batches = [make_batch(i, resp_len=6 if i != 2 else 700) for i in range(7)]  # entry 2 is chunked
    ids = [producer.put(b, timeout_s=5) for b in batches[:6]]
    # A trainer process takes entries 0 and 1 and dies without acking; our actor trains entry 2 (acks it) and
    # holds 3; the critic acknowledges 0 and 2, so entry 2 is gone (both roles acked it), 0 half-acked.
    dead, got = start_consumer(fresh_redis.url, stream, consumer="actor-dead", count=2, groups="actor,critic")
    assert got == ids[:2]
    dead.kill()
    dead.wait()
    actor = _handle(client, stream, group="actor", consumer="actor-0", claim_idle_ms=3_600_000)
    assert [e.entry_id for e in actor.get(count=2, block_ms=0)] == ids[2:4]
    actor.ack([ids[2]])
    critic = _handle(client, stream, group="critic", consumer="critic-0")
    assert [e.entry_id for e in critic.get(count=3, block_ms=0)] == ids[:3]
    critic.ack([ids[0], ids[2]])
    ids.append(producer.put(batches[6], timeout_s=5))
    # the buffer is full (6 batches waiting): this producer stays blocked across the restart
    late: dict[str, str] = {}
    blocked_producer = _handle(connect(fresh_redis.url), stream)
    blocked = threading.Thread(target=lambda: late.update(id=blocked_producer.put(make_batch(9), timeout_s=60)))
    blocked.start()
    before = (
        client.xlen(stream),
        pending_by_consumer(client, stream, "actor"),
        pending_by_consumer(client, stream, "critic"),
        client.hgetall(f"{stream}:acks"),
    )
    assert before[:2] == (6, {"actor-dead": ids[:2], "actor-0": [ids[3]]})
    client.close()

    fresh_redis.kill()  # kill -9
    fresh_redis.start()  # same port and data directory: the AOF is replayed

    client = connect(fresh_redis.url)
    assert (
        client.xlen(stream),
        pending_by_consumer(client, stream, "actor"),
        pending_by_consumer(client, stream, "critic"),
        client.hgetall(f"{stream}:acks"),
    ) == before
    # A restarted trainer under the same consumer name gets its own pending entry first, then takes over the
    # dead consumer's, then the ones never read; every payload is intact, and entry 2 never comes back.
    actor = _handle(client, stream, group="actor", consumer="actor-0", claim_idle_ms=0)
    entries = actor.get(count=6, block_ms=0)
    assert [e.entry_id for e in entries] == [ids[3], ids[0], ids[1], ids[4], ids[5], ids[6]]
    for e in entries:
        assert_same_batch(e.batch, batches[ids.index(e.entry_id)])
    actor.ack([e.entry_id for e in entries])  # entry 0 is now acked by both roles: room for one more
    blocked.join(60)
    assert late.get("id") and late["id"] not in ids
    critic = _handle(client, stream, group="critic", consumer="critic-0")
    rest = critic.get(count=10, block_ms=0)  # its own pending 1 first, then 3..6 and the late one
    assert [e.entry_id for e in rest] == [ids[1], ids[3], ids[4], ids[5], ids[6], late["id"]]
    critic.ack([e.entry_id for e in rest])
    actor.ack([e.entry_id for e in actor.get(count=10, block_ms=0)])
    assert client.xlen(stream) == 0 and not client.keys(f"{stream}:chunk:*")  # all trained, nothing leaked
    client.close()

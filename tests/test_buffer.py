"""The Redis rollout buffer against a real redis-server (EmbeddedRedis), with real consumer processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
from conftest import HELPERS_DIR, PYTHON

from services.buffer.stream import BufferError, BufferFullError, EntryNotFoundError, RolloutBuffer, connect, stream_key
from services.contracts.sampling_spec import SamplingSpec
from services.contracts.wire import RolloutBatchData, build_batch, encode_batch, sampling_arrays
from services.launcher.redis_server import EmbeddedRedis

ARRAYS = (
    "tokens",
    "prompt_lengths",
    "response_lengths",
    "loss_mask",
    "rollout_log_probs",
    "rewards",
    "group_ids",
    "sample_versions",
    "sampling_temperature",
    "sampling_top_p",
    "sampling_top_k",
)


def make_batch(
    rollout_id: int, *, n: int = 4, resp_len: int = 6, version: int = 0, producer: str = "rollout-0"
) -> RolloutBatchData:
    rng = np.random.default_rng(rollout_id)
    prompts = [rng.integers(0, 1000, size=3 + i % 3).tolist() for i in range(n)]
    responses = [rng.integers(0, 1000, size=resp_len).tolist() for _ in range(n)]
    return build_batch(
        rollout_id=rollout_id,
        policy_version=version,
        prompts=prompts,
        responses=responses,
        log_probs=[(-rng.random(resp_len)).tolist() for _ in range(n)],
        rewards=rng.random(n).tolist(),
        group_ids=[rollout_id * 100 + i // 2 for i in range(n)],
        finish_reasons=["stop", "length"] * (n // 2) + ["stop"] * (n % 2),
        labels=[str(i) for i in range(n)],
        metadata={"k": "v"},
        producer=producer,
        sampling=SamplingSpec(temperature=0.7, top_p=0.95),
    )


def assert_same_batch(a: RolloutBatchData, b: RolloutBatchData) -> None:
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape, name
        assert np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes(), name
    assert (a.rollout_id, a.policy_version, a.finish_reasons, a.labels, a.metadata, a.producer) == (
        b.rollout_id,
        b.policy_version,
        b.finish_reasons,
        b.labels,
        b.metadata,
        b.producer,
    )


def buffer(client, stream, **kw) -> RolloutBuffer:
    kw.setdefault("groups", ("actor",))
    return RolloutBuffer(client, stream, **kw)


def start_consumer(
    url: str, stream: str, *, consumer: str, count: int, group: str = "actor", groups: str = "actor"
) -> tuple[subprocess.Popen, list[str]]:
    """A consumer process that gets `count` entries without acking; returns it (alive) and the ids it got."""
    proc = subprocess.Popen(
        [
            PYTHON,
            str(HELPERS_DIR / "buffer_consumer.py"),
            url,
            stream,
            "--group",
            group,
            "--groups",
            groups,
            "--consumer",
            consumer,
            "--count",
            str(count),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"consumer process failed: {proc.stderr.read()}")
    return proc, json.loads(line)["ids"]


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    proc.stderr.close()


def pending_by_consumer(client, stream: str, group: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for row in client.xpending_range(stream, group, min="-", max="+", count=1000):
        out.setdefault(row["consumer"].decode(), []).append(row["message_id"].decode())
    return out


def wait_idle(client, stream: str, group: str, ids: list[str], idle_ms: int, timeout_s: float = 10.0) -> None:
    """Waits (polling, no fixed sleep) until every id has been idle for at least idle_ms."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        idle = {
            r["message_id"].decode()
            for r in client.xpending_range(stream, group, min="-", max="+", count=1000, idle=idle_ms)
        }
        if set(ids) <= idle:
            return
        time.sleep(idle_ms / 4000)
    raise AssertionError(f"{ids} did not become idle for {idle_ms} ms")


def chunk_keys(client, stream: str) -> list[bytes]:
    return sorted(client.scan_iter(match=f"{stream}:chunk:*"))


# ---- ordering, pending, ack ------------------------------------------------------------------------


def test_stream_key_layout():
    assert stream_key("tandem", "run1") == "tandem:run1:rollouts"


def test_put_get_ack_in_order_without_redelivery(redis_client, stream):
    producer = buffer(redis_client, stream, max_buffered_batches=10)
    consumer = buffer(redis_client, stream, group="actor", consumer="actor-0")
    batches = [make_batch(i, version=i // 2) for i in range(5)]
    ids = [
        producer.put(b, trace_context={"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"}, timeout_s=5)
        for i, b in enumerate(batches)
    ]
    assert ids == sorted(ids, key=lambda s: tuple(map(int, s.split("-"))))
    assert producer.backlog() == 5

    got = consumer.get(count=2, block_ms=0) + consumer.get(count=2, block_ms=0) + consumer.get(count=2, block_ms=0)
    assert [e.entry_id for e in got] == ids  # in order, each once although none was acked
    assert consumer.get(count=2, block_ms=0) == []  # unacked entries are not handed out again
    for e, b in zip(got, batches, strict=True):
        assert_same_batch(e.batch, b)
        assert (e.rollout_id, e.policy_version, e.producer) == (b.rollout_id, b.policy_version, "rollout-0")
        assert e.nbytes == len(encode_batch(b))
        assert e.trace_context == {"traceparent": f"00-{e.rollout_id + 1:032x}-{e.rollout_id + 1:016x}-01"}
    assert consumer.pending() == 5

    assert consumer.ack(ids[:3]) == 3
    assert consumer.ack(ids[:3]) == 0  # acking twice is harmless
    assert consumer.pending() == 2 and consumer.backlog() == 2
    assert consumer.ack(ids[3:]) == 2
    assert consumer.pending() == 0 and consumer.backlog() == 0
    assert redis_client.exists(consumer.acks_key) == 0


def test_get_blocks_until_a_batch_arrives(redis_client, stream):
    consumer = buffer(redis_client, stream, group="actor")
    producer = buffer(redis_client, stream)
    thread = threading.Timer(0.1, lambda: producer.put(make_batch(7), timeout_s=5))
    thread.start()
    got = consumer.get(count=1, block_ms=20_000)
    thread.join()
    assert [e.rollout_id for e in got] == [7]


def test_producer_only_handle_cannot_consume(redis_client, stream):
    producer = buffer(redis_client, stream)
    with pytest.raises(BufferError, match="producer-only"):
        producer.get()
    with pytest.raises(BufferError, match="not one of the run's roles"):
        buffer(redis_client, stream, groups=("actor",), group="critic")


# ---- capacity ------------------------------------------------------------------------------------


def test_put_times_out_while_buffer_is_full(redis_client, stream):
    producer = buffer(redis_client, stream, max_buffered_batches=2, chunk_bytes=4096)
    consumer = buffer(redis_client, stream, group="actor", max_buffered_batches=2)
    producer.put(make_batch(0), timeout_s=5)
    producer.put(make_batch(1), timeout_s=5)
    assert len(consumer.get(count=2, block_ms=0)) == 2  # delivered but not acked: still counts
    with pytest.raises(BufferFullError, match=r"stayed full \(2 batches waiting, redis.max_buffered_batches\)") as err:
        producer.put(make_batch(2), timeout_s=0.2)
    assert isinstance(err.value, TimeoutError)
    big = make_batch(3, n=64, resp_len=100)  # chunked: its chunks must not be left behind
    assert len(encode_batch(big)) > 4096
    with pytest.raises(BufferFullError):
        producer.put(big, timeout_s=0.2)
    assert chunk_keys(redis_client, stream) == []
    assert producer.backlog() == 2


def test_put_unblocks_when_the_consumer_acks(redis_client, stream):
    producer = buffer(redis_client, stream, max_buffered_batches=2)
    consumer = buffer(redis_client, stream, group="actor", max_buffered_batches=2)
    first = [producer.put(make_batch(i), timeout_s=5) for i in range(2)]
    result: dict[str, object] = {}

    def blocked_put() -> None:
        try:  # its own handle: a handle is not thread-safe
            result["id"] = buffer(redis_client, stream, max_buffered_batches=2).put(make_batch(2), timeout_s=60)
        except Exception as exc:  # noqa: BLE001
            result["error"] = exc

    thread = threading.Thread(target=blocked_put)
    thread.start()
    got = consumer.get(count=2, block_ms=0)
    assert [e.entry_id for e in got] == first
    thread.join(timeout=0.3)
    assert thread.is_alive() and not result  # full: it cannot have finished, however slow the machine
    consumer.ack([first[0]])
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert "error" not in result
    assert producer.backlog() == 2
    assert [e.rollout_id for e in consumer.get(count=5, block_ms=0)] == [2]


# ---- dead consumers, restarts, re-claim --------------------------------------------------------------


def test_killed_consumer_entries_are_reclaimed_after_claim_idle_ms(redis_server, redis_client, stream):
    producer = buffer(redis_client, stream, max_buffered_batches=10)
    ids = [producer.put(make_batch(i), timeout_s=5) for i in range(3)]
    proc, taken = start_consumer(redis_server.url, stream, consumer="actor-dead", count=2)
    assert taken == ids[:2]
    kill9(proc)
    assert pending_by_consumer(redis_client, stream, "actor") == {"actor-dead": ids[:2]}

    # A consumer with a long claim_idle_ms leaves the dead one's entries alone and gets the new one.
    patient = buffer(redis_client, stream, group="actor", consumer="actor-patient", claim_idle_ms=3_600_000)
    assert [e.entry_id for e in patient.get(count=3, block_ms=0)] == [ids[2]]
    assert patient.stats.claimed == 0
    assert patient.ack([ids[2]]) == 1  # (unacked, it too would be taken over once idle > claim_idle_ms)

    # With claim_idle_ms = 100 they are taken over once idle for that long (XAUTOCLAIM), in order.
    wait_idle(redis_client, stream, "actor", ids[:2], 100)
    rescuer = buffer(redis_client, stream, group="actor", consumer="actor-rescuer", claim_idle_ms=100)
    got = rescuer.get(count=3, block_ms=0)
    assert [e.entry_id for e in got] == ids[:2]
    assert [e.rollout_id for e in got] == [0, 1]
    assert rescuer.stats.claimed == 2
    assert pending_by_consumer(redis_client, stream, "actor") == {"actor-rescuer": ids[:2]}
    assert rescuer.ack(ids[:2]) == 2
    assert producer.backlog() == 0


def test_restarted_consumer_rereads_its_own_pending_entries(redis_server, redis_client, stream):
    producer = buffer(redis_client, stream, max_buffered_batches=10)
    ids = [producer.put(make_batch(i), timeout_s=5) for i in range(3)]
    proc, taken = start_consumer(redis_server.url, stream, consumer="actor-0", count=2)
    assert taken == ids[:2]
    kill9(proc)
    # Same consumer name after the restart: its pending entries come back first, at once (no idle wait),
    # one by one without repeats, then the new entry.
    restarted = buffer(redis_client, stream, group="actor", consumer="actor-0", claim_idle_ms=3_600_000)
    order = [e.entry_id for _ in range(4) for e in restarted.get(count=1, block_ms=0)]
    assert order == ids
    assert restarted.stats.claimed == 0
    assert restarted.ack(ids) == 3 and restarted.backlog() == 0


def test_pending_entries_survive_a_redis_kill9(fresh_redis: EmbeddedRedis, stream):
    client = connect(fresh_redis.url)
    producer = buffer(client, stream, max_buffered_batches=10)
    ids = [producer.put(make_batch(i), timeout_s=5) for i in range(2)]
    assert [e.entry_id for e in buffer(client, stream, group="actor", consumer="actor-0").get(block_ms=0)] == ids[:1]
    fresh_redis.kill()
    fresh_redis.start()  # same port and data dir: the AOF is replayed
    client = connect(fresh_redis.url)
    restarted = buffer(client, stream, group="actor", consumer="actor-0")
    assert [e.entry_id for e in restarted.get(count=2, block_ms=0)] == ids
    assert restarted.ack(ids) == 2
    client.close()


# ---- read by id --------------------------------------------------------------------------------------


def test_read_exact_ids_including_one_pending_at_a_dead_consumer(redis_server, redis_client, stream):
    producer = buffer(redis_client, stream, max_buffered_batches=10)
    ids = [producer.put(make_batch(i), timeout_s=5) for i in range(5)]
    proc, taken = start_consumer(redis_server.url, stream, consumer="actor-old", count=1)
    assert taken == ids[:1]
    kill9(proc)

    reader = buffer(redis_client, stream, group="actor", consumer="actor-0", claim_idle_ms=3_600_000)
    got = reader.read([ids[3], ids[0], ids[1]], timeout_s=10)
    assert [e.entry_id for e in got] == [ids[3], ids[0], ids[1]]  # exactly these, in this order
    assert [e.rollout_id for e in got] == [3, 0, 1]
    assert_same_batch(got[1].batch, make_batch(0))
    # ids[0] was taken over from the dead consumer at once (no claim_idle_ms wait).
    assert pending_by_consumer(redis_client, stream, "actor") == {"actor-0": ids[:4]}
    # Entries read past on the way (ids[2]) are not lost: the next get hands them out, then the rest.
    assert [e.entry_id for e in reader.get(count=10, block_ms=0)] == [ids[2], ids[4]]
    # Reading again what we already hold works (a retried Train call).
    assert [e.entry_id for e in reader.read([ids[2]])] == [ids[2]]

    with pytest.raises(EntryNotFoundError, match="not in stream"):
        reader.read(["1-1"])
    with pytest.raises(EntryNotFoundError, match="not a valid stream entry id"):
        reader.read(["not-an-id"])
    assert reader.ack(ids) == 5
    with pytest.raises(EntryNotFoundError, match="acknowledged by every group"):
        reader.read([ids[0]])
    assert reader.backlog() == 0


# ---- chunked batches -----------------------------------------------------------------------------------


def big_batch(target_bytes: int) -> RolloutBatchData:
    """A batch of about target_bytes on the wire: 9 bytes per response token + 4 per prompt token."""
    rng = np.random.default_rng(1)
    n, prompt_len = 1024, 64
    resp_len = (target_bytes // n - 4 * prompt_len) // 9
    total_resp = n * resp_len
    return RolloutBatchData(
        rollout_id=42,
        policy_version=3,
        tokens=rng.integers(0, 150_000, size=n * (prompt_len + resp_len), dtype=np.int32),
        prompt_lengths=np.full(n, prompt_len, dtype=np.int32),
        response_lengths=np.full(n, resp_len, dtype=np.int32),
        loss_mask=rng.integers(0, 2, size=total_resp, dtype=np.uint8),
        rollout_log_probs=-rng.random(total_resp, dtype=np.float32),
        rewards=rng.random(n, dtype=np.float32),
        group_ids=np.arange(n, dtype=np.int64) // 8,
        sample_versions=np.full(n, 3, dtype=np.int64),
        **sampling_arrays(n, SamplingSpec(temperature=0.7)),
        finish_reasons=("length",) * n,
        producer="rollout-1",
    )


def test_100mb_batch_round_trips_bit_identical_through_chunks(redis_client, stream):
    chunk = 48 << 20
    producer = buffer(redis_client, stream, chunk_bytes=chunk)
    consumer = buffer(redis_client, stream, group="actor", chunk_bytes=chunk)
    batch = big_batch(100 << 20)
    payload_len = len(encode_batch(batch))
    assert payload_len >= 100 << 20
    entry_id = producer.put(batch, timeout_s=60)

    [(_, fields)] = redis_client.xrange(stream)
    assert b"payload" not in fields and int(fields[b"chunks"]) == 3
    keys = chunk_keys(redis_client, stream)
    assert len(keys) == 3
    sizes = [redis_client.strlen(k) for k in keys]
    assert sum(sizes) == payload_len and max(sizes) <= chunk < 512 << 20  # below proto-max-bulk-len
    assert all(redis_client.ttl(k) == -1 for k in keys)  # owned by the entry: no expiry

    [entry] = consumer.get(count=1, block_ms=0)
    assert entry.entry_id == entry_id and entry.nbytes == payload_len
    assert_same_batch(entry.batch, batch)
    consumer.ack([entry_id])
    assert chunk_keys(redis_client, stream) == [] and consumer.backlog() == 0


# ---- corruption --------------------------------------------------------------------------------------


def test_corrupted_entries_are_dead_lettered_and_the_consumer_carries_on(redis_client, stream):
    producer = buffer(redis_client, stream, max_buffered_batches=20, chunk_bytes=1024)
    consumer = buffer(redis_client, stream, group="actor", chunk_bytes=1024)
    good0 = producer.put(make_batch(0), timeout_s=5)
    flipped = producer.put(make_batch(1, n=16, resp_len=20), timeout_s=5)  # > 1024 bytes: stored as chunks
    good1 = producer.put(make_batch(2), timeout_s=5)
    garbage = producer.put_payload(b"\xff" * 64, rollout_id=3, policy_version=0, timeout_s=5)
    holed = producer.put(make_batch(4, n=16, resp_len=20), timeout_s=5)
    good2 = producer.put(make_batch(5), timeout_s=5)

    fields = dict(redis_client.xrange(stream, flipped, flipped))[flipped.encode()]
    key = fields[b"chunk_prefix"] + b":1"
    byte = redis_client.getrange(key, 10, 10)
    redis_client.setrange(key, 10, bytes([byte[0] ^ 0x01]))  # one flipped bit
    fields = dict(redis_client.xrange(stream, holed, holed))[holed.encode()]
    assert int(fields[b"chunks"]) >= 3
    redis_client.delete(fields[b"chunk_prefix"] + b":2")

    got = consumer.get(count=3, block_ms=0)  # topped up past the bad ones
    assert [e.entry_id for e in got] == [good0, good1, good2]
    assert [e.rollout_id for e in got] == [0, 2, 5]

    dead = {f[b"original_id"].decode(): f[b"reason"].decode() for _, f in consumer.dead_letters()}
    assert set(dead) == {flipped, garbage, holed}
    assert "checksum mismatch" in dead[flipped]
    assert "not a valid protobuf message" in dead[garbage]
    assert "1 of" in dead[holed] and "chunks are missing" in dead[holed]
    assert {d.entry_id for d in consumer.stats.dead_lettered} == {flipped, garbage, holed}
    assert consumer.backlog() == 3 and consumer.pending() == 3  # only the good ones are left, pending
    with pytest.raises(EntryNotFoundError, match="dead-lettered: checksum mismatch"):
        consumer.read([flipped])
    other = buffer(redis_client, stream, group="actor", consumer="actor-1")  # learns the reason from Redis
    with pytest.raises(EntryNotFoundError, match=r"dead-lettered: .*chunks are missing"):
        other.read([holed])
    assert consumer.ack([good0, good1, good2]) == 3
    assert consumer.backlog() == 0 and consumer.pending() == 0


def test_inline_entry_with_bad_checksum_is_dead_lettered(redis_client, stream):
    producer = buffer(redis_client, stream)
    consumer = buffer(redis_client, stream, group="actor")
    entry_id = producer.put(make_batch(0), timeout_s=5)
    [(_, fields)] = redis_client.xrange(stream)
    payload = bytearray(fields[b"payload"])
    payload[-3] ^= 0x80
    redis_client.xadd(stream, {**fields, b"payload": bytes(payload)})  # as a bit flip in transit would leave it
    good = producer.put(make_batch(1), timeout_s=5)
    got = consumer.get(count=5, block_ms=0)
    assert [e.entry_id for e in got] == [entry_id, good]
    [(_, dead)] = consumer.dead_letters()
    assert b"checksum mismatch" in dead[b"reason"]
    consumer.ack([entry_id, good])


# ---- two consumer groups ---------------------------------------------------------------------------------


def test_two_groups_entry_deleted_only_after_both_ack(redis_client, stream):
    groups = ("actor", "critic")
    producer = buffer(redis_client, stream, groups=groups, max_buffered_batches=2, chunk_bytes=1024)
    actor = buffer(redis_client, stream, groups=groups, group="actor", consumer="actor-0", chunk_bytes=1024)
    critic = buffer(redis_client, stream, groups=groups, group="critic", consumer="critic-0", chunk_bytes=1024)
    chunked = producer.put(make_batch(0, n=16, resp_len=20), timeout_s=5)
    inline = producer.put(make_batch(1), timeout_s=5)
    n_chunks = len(chunk_keys(redis_client, stream))
    assert n_chunks >= 2

    got = actor.get(count=2, block_ms=0)
    assert [e.entry_id for e in got] == [chunked, inline]
    assert actor.ack([chunked, inline]) == 2
    assert actor.pending() == 0 and actor.backlog() == 2  # the critic has not seen them yet
    assert len(chunk_keys(redis_client, stream)) == n_chunks
    with pytest.raises(BufferFullError):  # still counts against the bound
        producer.put(make_batch(2), timeout_s=0.2)
    with pytest.raises(EntryNotFoundError, match="already acknowledged by group actor"):
        actor.read([chunked])

    got = critic.get(count=2, block_ms=0)
    assert [e.entry_id for e in got] == [chunked, inline]
    assert_same_batch(got[0].batch, make_batch(0, n=16, resp_len=20))
    assert critic.ack([chunked]) == 1
    assert critic.backlog() == 1 and chunk_keys(redis_client, stream) == []  # deleted with its chunks
    assert critic.ack([inline]) == 1
    assert critic.backlog() == 0 and redis_client.exists(critic.acks_key) == 0
    producer.put(make_batch(2), timeout_s=5)  # room again


def test_trace_context_round_trips_as_w3c_carrier(redis_client, stream):
    from opentelemetry import propagate, trace
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")  # a local provider: the global one stays untouched
    with tracer.start_as_current_span("rl.sample") as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        expected = span.get_span_context()
    producer = buffer(redis_client, stream)
    consumer = buffer(redis_client, stream, group="actor")
    producer.put(make_batch(0), trace_context=carrier, timeout_s=5)
    producer.put(make_batch(1), timeout_s=5)  # no context: an empty carrier
    first, second = consumer.get(count=2, block_ms=0)
    assert first.trace_context == carrier and "traceparent" in carrier
    linked = trace.get_current_span(propagate.extract(first.trace_context)).get_span_context()
    assert (linked.trace_id, linked.span_id) == (expected.trace_id, expected.span_id)
    assert second.trace_context == {}
    consumer.ack([first.entry_id, second.entry_id])


# ---- resume -------------------------------------------------------------------------------------------------


def test_discard_except_drops_other_entries_with_their_chunks(redis_client, stream):
    groups = ("actor", "critic")
    producer = buffer(redis_client, stream, groups=groups, max_buffered_batches=10, chunk_bytes=1024)
    actor = buffer(redis_client, stream, groups=groups, group="actor")
    ids = [producer.put(make_batch(i, n=16, resp_len=20), timeout_s=5) for i in range(3)]
    actor.get(count=3, block_ms=0)  # pending in one group
    assert producer.discard_except([ids[1]]) == 2
    assert [i.decode() for i, _ in redis_client.xrange(stream)] == [ids[1]]
    assert pending_by_consumer(redis_client, stream, "actor") == {"consumer-0": [ids[1]]}
    prefix = dict(redis_client.xrange(stream))[ids[1].encode()][b"chunk_prefix"]
    assert chunk_keys(redis_client, stream) and all(k.startswith(prefix) for k in chunk_keys(redis_client, stream))


def test_a_retried_xadd_does_not_add_the_batch_twice(redis_client, stream):
    """redis-py retries a command after a socket timeout; the put script is keyed by a per-put id, so a
    retry of an XADD that did land returns the first entry id instead of a duplicate batch."""
    producer = buffer(redis_client, stream, max_buffered_batches=1)
    keys = [stream, f"{stream}:put:retry-test"]
    args: list[int | str | bytes] = [1, "rollout_id", 0, "payload", b"x"]
    first = producer._producer._bounded_xadd(keys=keys, args=args)
    assert producer._producer._bounded_xadd(keys=keys, args=args) == first  # also when the buffer is now full
    assert redis_client.xlen(stream) == 1

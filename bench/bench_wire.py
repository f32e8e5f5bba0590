"""Encode / decode speed of the rollout-batch wire format (services/contracts/wire.py).

    python bench/bench_wire.py [--tokens 1048576] [--samples 1024] [--repeat 5]

A batch of `--tokens` tokens (prompt + response, 1/4 prompt) over `--samples` samples; prints a table
of the median time and MB/s of each step. One decode of a 1M-token batch must stay well under a second.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from services.contracts.sampling_spec import SamplingSpec
from services.contracts.wire import RolloutBatchData, decode_batch, encode_batch, payload_checksum, sampling_arrays

T = TypeVar("T")


def make_batch(total_tokens: int, samples: int) -> RolloutBatchData:
    rng = np.random.default_rng(0)
    per = total_tokens // samples
    prompt_len = per // 4
    resp_len = per - prompt_len
    n_resp = samples * resp_len
    return RolloutBatchData(
        rollout_id=1,
        policy_version=1,
        tokens=rng.integers(0, 150_000, size=samples * per, dtype=np.int32),
        prompt_lengths=np.full(samples, prompt_len, np.int32),
        response_lengths=np.full(samples, resp_len, np.int32),
        loss_mask=np.ones(n_resp, np.uint8),
        rollout_log_probs=-rng.random(n_resp, dtype=np.float32),
        rewards=rng.random(samples, dtype=np.float32),
        group_ids=np.arange(samples, dtype=np.int64) // 8,
        sample_versions=np.ones(samples, np.int64),
        **sampling_arrays(samples, SamplingSpec()),
        finish_reasons=("stop",) * samples,
        labels=tuple(str(i % 10) for i in range(samples)),
        producer="bench",
    )


def timed(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    times: list[float] = []
    out = fn()  # a warm-up, and `out` is of the function's type before the timed calls
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    batch = make_batch(args.tokens, args.samples)
    payload = encode_batch(batch)
    mb = len(payload) / 1e6
    rows = []
    t, _ = timed(lambda: encode_batch(batch), args.repeat)
    rows.append(("encode (validate + serialize)", t))
    t, _ = timed(lambda: decode_batch(payload), args.repeat)
    rows.append(("decode (parse + validate)", t))
    t, _ = timed(lambda: payload_checksum(payload), args.repeat)
    rows.append(("crc32 checksum", t))
    t, out = timed(lambda: decode_batch(encode_batch(batch)), args.repeat)
    rows.append(("encode + decode", t))
    assert out.tokens.tobytes() == batch.tokens.tobytes()

    print(
        f"wire format: {batch.tokens.shape[0]:,} tokens, {batch.num_samples} samples, "
        f"{batch.num_response_tokens:,} response tokens, payload {mb:.1f} MB; median of {args.repeat}"
    )
    print(f"| {'step':<30} | {'ms':>9} | {'MB/s':>9} |")
    print(f"|{'-' * 32}|{'-' * 11}|{'-' * 11}|")
    for name, seconds in rows:
        print(f"| {name:<30} | {seconds * 1e3:9.2f} | {mb / seconds:9.0f} |")


if __name__ == "__main__":
    main()

"""Trainer throughput: training tokens/s of TrainerService.train (Redis read + GRPO step under DeepSpeed).

    python bench/bench_trainer.py [--presets tiny small] [--zero 1 3] [--precision fp32 bf16]
                                  [--samples 64] [--response-len 32] [--steps 5] [--threads 2] [--device cpu]

Each row is one trainer (1 rank) on a random-init model from `tandem init-model` presets, fed fixed
batches of `samples` sequences (prompt 8-16 tokens, response `response-len`, cut to fit the model's
positions) through a real redis-server.
"tok/s" counts prompt + response tokens of a step / the step's wall time (median over steps, after one
untimed warm-up step); "train s" is the trainer's own perf/train_update_s (forward, backward, step).

    python bench/bench_trainer.py --offload [--presets small] [--zero 1] [--precision bf16] --device cuda

--offload: the time of Offload and Onload (DeepSpeedBackend.offload/onload, 5 cycles after one step): DeepSpeed's
offload_states as is (it runs gc.collect() three times) next to the same with the process' start-up objects
frozen (gc.freeze(), as the backend does), and what one full gc.collect() costs in that process.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.contracts.trainer_calls import TrainRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.buffer.stream import RolloutBuffer, connect, stream_key
from services.contracts.config_loading import config_from_dict
from services.contracts.sampling_spec import SamplingSpec
from services.contracts.wire import build_batch
from services.launcher.redis_server import EmbeddedRedis
from services.modelinit.init_model import init_model
from services.trainer.builder import build_trainer
from services.trainer.parts import TrainerParts
from services.trainer.service import TrainerService
from services.trainer.training import ModelLimits, RolloutSource


def make_batch(*, rollout_id: int, samples: int, response_len: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, vocab, size=int(rng.integers(8, 17))).tolist() for _ in range(samples)]
    responses = [rng.integers(4, vocab, size=response_len).tolist() for _ in range(samples)]
    return build_batch(
        rollout_id=rollout_id,
        policy_version=0,
        prompts=prompts,
        responses=responses,
        log_probs=[[-3.0] * response_len for _ in range(samples)],
        rewards=rng.integers(0, 2, size=samples).astype(float).tolist(),
        group_ids=[i // 8 for i in range(samples)],
        finish_reasons=["length"] * samples,
        sampling=SamplingSpec(),
    )


def start_trainer(
    *, model_dir: Path, run_dir: Path, redis_url: str, name: str, trainer: dict
) -> tuple[TrainerService, TrainerParts, RolloutBuffer]:
    """A one-rank TrainerService on its own stream, its parts, and a producer that feeds it."""

    config = config_from_dict(
        {
            "run_name": f"bench-{name}-{time.monotonic_ns()}",
            "model": {"path": str(model_dir)},
            "data": {"train_path": str(run_dir / "unused.jsonl")},
            "trainer": {"lr": 1e-4, **trainer},
            "redis": {"url": redis_url, "max_buffered_batches": 64},
        }
    )
    built = build_trainer(config, run_dir=run_dir)
    producer = RolloutBuffer(
        connect(redis_url),
        stream_key(config.redis.stream_prefix, config.run_name),
        groups=("actor",),
        max_buffered_batches=64,
    )
    return TrainerService(built), built, producer


def limits_of(built: TrainerParts) -> ModelLimits:
    """The model's vocabulary and context, as the trainer's Redis side checks batches against them."""
    assert isinstance(built.rollouts, RolloutSource)
    return built.rollouts.limits


def bench_one(
    *,
    model_dir: Path,
    run_dir: Path,
    redis_url: str,
    zero: int,
    precision: str,
    device: str,
    samples: int,
    response_len: int,
    steps: int,
    token_budget: int,
) -> dict[str, float]:
    service, built, producer = start_trainer(
        model_dir=model_dir,
        run_dir=run_dir,
        redis_url=redis_url,
        name=f"z{zero}-{precision}",
        trainer={"device": device, "zero_stage": zero, "precision": precision, "micro_batch_tokens": token_budget},
    )
    vocab = limits_of(built).vocab_size
    response_len = min(response_len, (limits_of(built).max_positions or 1 << 30) - 16)  # prompts are up to 16 tokens
    wall, train, tokens = [], [], 0
    try:
        for step in range(steps + 1):
            batch = make_batch(rollout_id=step, samples=samples, response_len=response_len, vocab=vocab, seed=step)
            entry = producer.put(batch)
            started = time.perf_counter()
            reply = service.train(TrainRequest(rollout_id=step, entry_ids=(entry,)))
            if step:  # the first step pays one-off costs (allocator, optimizer state)
                wall.append(time.perf_counter() - started)
                train.append(reply.metrics["perf/train_update_s"])
                tokens = int(reply.metrics["tokens"])
        params = sum(math.prod(s.shape) for s in service.weight_specs())  # full shapes, also under ZeRO-3
    finally:
        service.close()
    wall_s, train_s = statistics.median(wall), statistics.median(train)
    return {
        "params": params,
        "tokens": tokens,
        "wall_s": wall_s,
        "train_s": train_s,
        "tok_s": tokens / wall_s,
        "response_len": response_len,
    }


def bench_offload(
    *, model_dir: Path, run_dir: Path, redis_url: str, zero: int, precision: str, device: str, cycles: int = 5
) -> list[dict[str, Any]]:
    import gc

    service, built, producer = start_trainer(
        model_dir=model_dir,
        run_dir=run_dir,
        redis_url=redis_url,
        name="offload",
        trainer={"device": device, "zero_stage": zero, "precision": precision},
    )
    rows: list[dict[str, Any]] = []
    try:
        batch = make_batch(rollout_id=0, samples=16, response_len=16, vocab=limits_of(built).vocab_size, seed=0)
        service.train(TrainRequest(rollout_id=0, entry_ids=(producer.put(batch),)))  # optimizer states exist from here
        for frozen in (False, True):
            if not frozen:
                gc.unfreeze()  # the backend froze its start-up objects; measure the collections without that
            else:
                gc.collect()
                gc.freeze()
            off, on = [], []
            for _ in range(cycles):
                t = time.perf_counter()
                built.backend.offload()
                off.append(time.perf_counter() - t)
                t = time.perf_counter()
                built.backend.onload()
                on.append(time.perf_counter() - t)
            mode = "start-up objects frozen" if frozen else "DeepSpeed as is"
            rows.append(
                {
                    "mode": mode,
                    "first_s": off[0],
                    "offload_s": statistics.median(off[1:]),
                    "onload_s": statistics.median(on),
                }
            )
        gc.unfreeze()
        t = time.perf_counter()
        gc.collect()
        rows.append(
            {
                "mode": "gc.collect(), nothing frozen",
                "first_s": time.perf_counter() - t,
                "offload_s": float("nan"),
                "onload_s": float("nan"),
            }
        )
    finally:
        service.close()
    return rows


def offload_main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis", appendonly=False) as redis:
        model_dir = init_model(Path(tmp) / args.presets[0], preset=args.presets[0])
        rows = bench_offload(
            model_dir=model_dir,
            run_dir=Path(tmp) / "run",
            redis_url=redis.url,
            zero=args.zero[0],
            precision=args.precision[0],
            device=args.device,
        )
    print(
        f"\n# bench_trainer --offload {datetime.date.today()} device={args.device} preset={args.presets[0]} "
        f"ZeRO-{args.zero[0]} {args.precision[0]}; first offload, then medians of cycles 2-5\n"
    )
    print(f"| {'offload path':30} | first offload ms | offload ms | onload ms |")
    print(f"|{'-' * 32}|------------------|------------|-----------|")
    for r in rows:
        print(
            f"| {r['mode']:30} | {r['first_s'] * 1e3:16.1f} | {r['offload_s'] * 1e3:10.1f} | "
            f"{r['onload_s'] * 1e3:9.1f} |"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--zero", nargs="+", type=int, default=[1, 3])
    parser.add_argument("--precision", nargs="+", default=["fp32"])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--offload", action="store_true", help="time Offload/Onload instead of training")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.offload:
        return offload_main(args)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis", appendonly=False) as redis:
        for preset in args.presets:
            model_dir = init_model(Path(tmp) / preset, preset=preset)
            for zero in args.zero:
                for precision in args.precision:
                    r = bench_one(
                        model_dir=model_dir,
                        run_dir=Path(tmp) / f"run-{preset}-{zero}-{precision}",
                        redis_url=redis.url,
                        zero=zero,
                        precision=precision,
                        device=args.device,
                        samples=args.samples,
                        response_len=args.response_len,
                        steps=args.steps,
                        token_budget=args.token_budget,
                    )
                    rows.append((preset, zero, precision, r))
    print(
        f"\n# bench_trainer {datetime.date.today()} device={args.device} threads={args.threads} "
        f"samples={args.samples} response_len={args.response_len} token_budget={args.token_budget} "
        f"steps={args.steps}"
    )
    print(
        f"{'model':<7}{'params':>11}{'ZeRO':>6}{'prec':>6}{'resp':>6}{'tok/step':>10}{'step s':>9}{'train s':>9}"
        f"{'tok/s':>10}"
    )
    for preset, zero, precision, r in rows:
        print(
            f"{preset:<7}{r['params']:>11,}{zero:>6}{precision:>6}{r['response_len']:>6}{r['tokens']:>10}"
            f"{r['wall_s']:>9.3f}{r['train_s']:>9.3f}{r['tok_s']:>10.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tokens/s of the native rollout engine next to plain Hugging Face `model.generate`, same model and batch.

    python bench/bench_native_engine.py                                   # tiny + small presets, CPU
    python bench/bench_native_engine.py --preset qwen2-0.5b --device cuda --dtype bfloat16 \\
        --batch 64 256 --prompt-len 64 --new-tokens 128                   # a GPU-sized random-init model

Both sides sample (temperature 1, no top-k/top-p) exactly --new-tokens tokens per sequence (EOS ignored,
so both do the same work); the native engine also returns per-token log-probs, HF generate here does not.
Random-init weights (no download). Prints one row per batch size with the ratio native / HF; "first call"
is the native engine's first generate at that batch (static cache allocation and CUDA graph capture included),
not counted in its tokens/s. `--profile` (static paths, a GPU): the decode step alone (its runner replayed at 8 slots
of the generation and over the whole cache, at the generate's batch and cache length) against generate's wall time
per token step, and torch.profiler tables of three replays in --out (what a step's kernels are: the gap to SGLang).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.contracts.sampling_spec import SamplingSpec
from services.contracts.untyped import HFCausalLM
from services.modelinit.init_model import PRESETS, init_model
from services.rollout.engines.native.engine import NativeEngine, resolve_device

sys.path.insert(0, str(Path(__file__).resolve().parent))
from op_counts import profile_tables, profiler  # a sibling under bench/

# A Qwen2-0.5B-shaped config (494M parameters), built locally: the size FACTS.md measured HF generate at.
QWEN2_05B: dict[str, Any] = dict(
    vocab_size=151_936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    bos_token_id=151_643,
    eos_token_id=151_645,
    pad_token_id=151_643,
)


def build_model_dir(preset: str, root: Path) -> Path:
    if preset in PRESETS:
        return init_model(root / preset, preset=preset)
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**QWEN2_05B)
    # random init is much faster on a GPU than on the host's cores
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(root / preset)
    del model
    return root / preset


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_native(engine: NativeEngine, prompts: list[list[int]], new_tokens: int, seed: int) -> float:
    opts = SamplingSpec(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=seed)
    sync(engine.device)
    start = time.perf_counter()
    outs = engine.generate(prompts, opts)
    sync(engine.device)
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return time.perf_counter() - start


def time_hf(model, prompts: list[list[int]], new_tokens: int, pad_id: int, seed: int) -> float:
    device = model.device
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    torch.manual_seed(seed)
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
    sync(device)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - start


def bench_model(model_dir: Path, args: argparse.Namespace) -> list[tuple]:
    """HF generate once per batch size; the native engine once per decode mode, each next to it."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    hf: HFCausalLM = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    hf = hf.to(device).eval()
    engines = [
        NativeEngine(
            model_dir,
            device=str(device),
            dtype=args.dtype,
            max_batch_size=max(args.batch),
            decode=mode,
            fused_kernels=args.fused_kernels,
        )
        for mode in args.decode
    ]
    vocab = engines[0].vocab_size
    low = 4 if vocab > 8 else 0  # skip special tokens of the local tokenizer
    pad = engines[0].pad_token_id
    rows = []
    for batch in args.batch:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(low, vocab, (batch, args.prompt_len), generator=gen).tolist()
        for r in range(args.warmup):
            time_hf(hf, prompts, args.new_tokens, pad, seed=r)
        plain = statistics.median(time_hf(hf, prompts, args.new_tokens, pad, seed=10 + r) for r in range(args.repeats))
        tokens = batch * args.new_tokens
        for engine in engines:
            first = time_native(engine, prompts, args.new_tokens, seed=0)  # cache allocation / capture / compile
            for r in range(args.warmup):
                time_native(engine, prompts, args.new_tokens, seed=r + 1)
            native = statistics.median(
                time_native(engine, prompts, args.new_tokens, seed=10 + r) for r in range(args.repeats)
            )
            rows.append(
                (
                    model_dir.name,
                    engine.decode_mode,
                    batch,
                    tokens,
                    tokens / native,
                    tokens / plain,
                    plain / native,
                    first,
                )
            )
            if args.profile and engine._runners is not None:
                profile_step(engine, batch, native / args.new_tokens, args)
    return rows


def profile_step(engine: NativeEngine, batch: int, token_step_s: float, args: argparse.Namespace) -> None:
    """The decode step alone at the bucket generate used beside generate's seconds per token step: 30 replays (wall
    time between two device syncs) at 8 slots spread over the generation, their mean (a step attends over the slots
    written so far, a window of the cache), and at the cache's last slot (the whole cache); the profiler's tables of
    three replays at the middle of the generation."""
    assert engine._runners is not None
    runner = engine._runners.get(batch, args.prompt_len + args.new_tokens)
    device = engine.device
    tokens = torch.zeros(runner.batch, dtype=torch.long, device=device)
    positions = torch.full((runner.batch,), args.prompt_len, dtype=torch.long, device=device)

    def replay_s(slot: int, times: int = 30) -> float:
        runner.step(tokens, positions, slot)  # its view's graph captured outside the timing
        sync(device)
        start = time.perf_counter()
        for _ in range(times):
            runner.step(tokens, positions, slot)
        sync(device)
        return (time.perf_counter() - start) / times

    with torch.inference_mode():
        slots = [args.prompt_len + k * args.new_tokens // 8 for k in range(8)]
        step_s = statistics.mean(replay_s(slot) for slot in slots)
        whole_s = replay_s(runner.length - 1)
        middle = args.prompt_len + args.new_tokens // 2
        runner.step(tokens, positions, middle)
        sync(device)
        with profiler(device) as p:
            for _ in range(3):
                runner.step(tokens, positions, middle)
            sync(device)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile_native_{engine.decode_mode}_b{batch}_L{runner.length}.txt"
    path.write_text(profile_tables(p))
    print(
        f"[profile {engine.decode_mode} batch {batch}, cache {runner.batch} x {runner.length}] generate "
        f"{1000 * token_step_s:.2f} ms a token step; the decode step alone {1000 * step_s:.2f} ms "
        f"({step_s / token_step_s:.0%}; mean over 8 slots of the generation), {1000 * whole_s:.2f} ms over the "
        f"whole cache; tables (3 replays at slot {middle}) in {path}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", nargs="+", default=["tiny", "small"], choices=[*PRESETS, "qwen2-0.5b"])
    parser.add_argument("--model", type=Path, default=None, help="an existing model directory instead of presets")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--fused-kernels",
        default="off",
        choices=["auto", "on", "off"],
        help="model.fused_kernels for the native engine (Triton RMSNorm/SwiGLU in its decode)",
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--profile", action="store_true", help="the decode step alone and its profiler tables")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "runs" / "native_engine"),
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        default=["auto"],
        choices=["auto", "dynamic", "static", "graph", "compile"],
        help="native engine decode path(s), one row each (auto: graph on CUDA, dynamic on CPU)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        dirs = [args.model] if args.model else [build_model_dir(p, Path(tmp)) for p in args.preset]
        for d in dirs:
            rows += bench_model(d, args)
    device = resolve_device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} threads"
    print(
        f"\nnative engine vs HF generate — {where}, {args.dtype}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, median of {args.repeats}"
    )
    print(
        f"| {'model':<12} | decode  | {'batch':>5} | {'tokens':>7} | {'native tok/s':>12} | {'HF tok/s':>9} | "
        f"{'native/HF':>9} | first call s |"
    )
    print("|--------------|---------|-------|---------|--------------|-----------|-----------|--------------|")
    for name, mode, batch, tokens, native, plain, ratio, first in rows:
        print(
            f"| {name:<12} | {mode:<7} | {batch:>5} | {tokens:>7} | {native:>12,.0f} | {plain:>9,.0f} | "
            f"{ratio:>9.2f} | {first:>12.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

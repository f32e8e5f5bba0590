"""What stop strings cost the native engine: tokens/s without them and with them, same model, prompts and seeds.

    python bench/bench_stop_strings.py                       # qwen2.5-0.5b over a tiny body (its real tokenizer), CPU
    python bench/bench_stop_strings.py --preset qwen2.5-0.5b --body full --device cuda --dtype bfloat16 \\
        --decode graph --batch 64 256 --new-tokens 128        # on a GPU

The stop strings are chosen not to occur, so every row generates the same tokens with and without them and the
difference is the check alone: "####" (only tokens holding '#' are decoded), "\\n\\n\\n" (ends in whitespace: every
token is a candidate, the worst case). "first call s" is the first generate with the strings (the engine builds its
table of candidate tokens from the text of every vocabulary entry), not counted in the tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.contracts.sampling import SamplingSpec
from services.rollout.engines.native import NativeEngine
from services.rollout.model_init import init_model
from services.rollout.tokenizer import Texts, load_tokenizer

CASES = {"none": (), "hashes": ("####",), "newlines": ("\n\n\n",)}


def timed(engine: NativeEngine, prompts: list[list[int]], opts: SamplingSpec) -> tuple[float, int]:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    start = time.perf_counter()
    outs = engine.generate(prompts, opts)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--body", default="tiny", help="tiny, or full for the preset's own body")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--decode", nargs="+", default=["dynamic", "static"])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        path = init_model(Path(tmp) / "m", preset=args.preset, body=None if args.body == "full" else args.body)
        texts = Texts(load_tokenizer(path))
        for mode in args.decode:
            engine = NativeEngine(path, device=args.device, dtype=args.dtype, decode=mode, detokenizer=texts,
                                  max_batch_size=max(args.batch))
            for batch in args.batch:
                gen = torch.Generator().manual_seed(batch)
                prompts = torch.randint(0, 150_000, (batch, 16), generator=gen).tolist()
                base = SamplingSpec(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=1)
                timed(engine, prompts, base)                                   # warm-up
                speeds = {}
                for name, stop in CASES.items():
                    opts = replace(base, stop=stop)
                    first = timed(engine, prompts, opts)[0]
                    runs = [timed(engine, prompts, opts) for _ in range(args.repeats)]
                    speeds[name] = (statistics.median(tokens / s for s, tokens in runs), first)
                rows.append((mode, batch, speeds))
    print(f"\nnative engine with and without stop strings — {args.preset} ({args.body} body), {args.device}, "
          f"{args.dtype}, {args.new_tokens} new tokens, median of {args.repeats}")
    print("| decode  | batch | tok/s none | tok/s #### | ratio | tok/s \\n\\n\\n | ratio | "
          "first call s (####, \\n\\n\\n) |")
    print("|---------|-------|------------|------------|-------|--------------|-------|---------------------------|")
    for mode, batch, s in rows:
        none, hashes, newlines = s["none"][0], s["hashes"][0], s["newlines"][0]
        firsts = f"{s['hashes'][1]:.2f}, {s['newlines'][1]:.2f}"
        print(f"| {mode:<7} | {batch:>5} | {none:>10,.0f} | {hashes:>10,.0f} | {hashes / none:>5.2f} | "
              f"{newlines:>12,.0f} | {newlines / none:>5.2f} | {firsts:>25} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

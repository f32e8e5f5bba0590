"""What stop strings cost the native engine: the check per decode step, and tokens/s with and without them.

    python bench/bench_stop_strings.py                       # qwen2.5-0.5b over a tiny body (its real tokenizer), CPU
    python bench/bench_stop_strings.py --body full --device cuda --dtype bfloat16 --decode graph \\
        --batch 64 256 --new-tokens 128                       # on a GPU

Two stop strings that random tokens do not produce, so every run generates the same tokens with and without them:
"####" (only rows whose new token holds '#' are decoded) and "\\n\\n\\n" (it ends in whitespace: every token is a
candidate and every row is decoded, the worst case). Table 1 times `StopStrings.scan` alone for one step over
random tokens, and the one-time table of candidate tokens (the text of every vocabulary entry). Table 2 times whole
generate calls: the check against the model's own step.
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

from services.contracts.sampling_spec import SamplingSpec
from services.modelinit.init_model import init_model
from services.rollout.chat_template import ChatTemplate
from services.rollout.engines.native.engine import NativeEngine
from services.rollout.engines.native.stop_strings import StopStringTables
from services.rollout.tokenizer import Texts, load_tokenizer

CASES = {"####": ("####",), "newlines": ("\n\n\n",)}
LABELS = {"####": "####", "newlines": "\\n\\n\\n"}


def texts_of(path: Path) -> Texts:
    """The run's tokenizer as the rollout service holds it (its own chat template)."""
    tokenizer = load_tokenizer(path)
    return Texts(tokenizer, ChatTemplate(tokenizer, source=f"the chat template of the tokenizer at {path}"))


def scan_table(texts: Texts, vocab: int, device: torch.device, batches: list[int], steps: int = 100) -> None:
    tables = StopStringTables(texts, vocab_size=vocab, device=device)
    print(f"\nStopStrings.scan per decode step, {device}, random tokens, median of {steps} steps")
    print("| stop | table build s | " + " | ".join(f"batch {b} ms" for b in batches) + " |")
    print("|------|---------------|" + "|".join("-" * (len(f"batch {b} ms") + 2) for b in batches) + "|")
    for name, stop in CASES.items():
        start = time.perf_counter()
        stops = tables.for_request(stop)
        build = time.perf_counter() - start
        cells = []
        for batch in batches:
            tokens = torch.randint(0, vocab, (batch, steps), device=device)
            lengths = torch.full((batch,), steps, device=device)
            times = []
            for step in range(steps):
                start = time.perf_counter()
                stops.scan(tokens, lengths, step, step + 1)
                times.append(time.perf_counter() - start)
            cells.append(f"{statistics.median(times) * 1e3:.3f}")
        print(f"| {LABELS[name]} | {build:.2f} | " + " | ".join(cells) + " |")


def timed(engine: NativeEngine, prompts: list[list[int]], opts: SamplingSpec) -> float:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    start = time.perf_counter()
    outs = engine.generate(prompts, opts)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def generate_table(path: Path, texts: Texts, args: argparse.Namespace) -> None:
    print(
        f"\nnative engine tokens/s with and without stop strings — {args.preset} ({args.body} body), {args.device}, "
        f"{args.dtype}, {args.new_tokens} new tokens, median of {args.repeats}"
    )
    print("| decode  | batch | none | #### | ratio | \\n\\n\\n | ratio |")
    print("|---------|-------|------|------|-------|--------|-------|")
    for mode in args.decode:
        engine = NativeEngine(
            path, device=args.device, dtype=args.dtype, decode=mode, detokenizer=texts, max_batch_size=max(args.batch)
        )
        for batch in args.batch:
            prompts = torch.randint(0, 150_000, (batch, 16), generator=torch.Generator().manual_seed(batch)).tolist()
            base = SamplingSpec(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=1)
            for stop in ((), *CASES.values()):  # warm-up; builds the candidate tables
                timed(engine, prompts, replace(base, stop=stop))
            speed = {
                name: statistics.median(timed(engine, prompts, replace(base, stop=stop)) for _ in range(args.repeats))
                for name, stop in (("none", ()), *CASES.items())
            }
            none, hashes, newlines = speed["none"], speed["####"], speed["newlines"]
            print(
                f"| {mode:<7} | {batch:>5} | {none:,.0f} | {hashes:,.0f} | {hashes / none:.2f} | {newlines:,.0f} | "
                f"{newlines / none:.2f} |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--body", default="tiny", help="tiny, or full for the preset's own body")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--decode", nargs="+", default=["dynamic", "static"])
    parser.add_argument("--batch", type=int, nargs="+", default=[8])
    parser.add_argument("--scan-batch", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        path = init_model(Path(tmp) / "m", preset=args.preset, body=None if args.body == "full" else args.body)
        texts = texts_of(path)
        vocab = NativeEngine(path, device=args.device, dtype=args.dtype).vocab_size
        scan_table(texts, vocab, torch.device(args.device), args.scan_batch)
        generate_table(path, texts, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

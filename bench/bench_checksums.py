"""What `weights.check_weight_update_equal` costs: the checksums of a model's weights, one tensor at a time (how
they were computed until 2026-12-05) next to packs (prefix sums over concatenated words, services/weights/layout.py),
both with one host sync at the end.

    python bench/bench_checksums.py [--device cuda] [--presets q05 q05_narrow] [--repeats 5] [--sync-ms 19.5]

A verified sync computes them once on the trainer (its prepare) and once on each engine after the copy, so
"share of a sync" is 2 x ms / --sync-ms (the q05 cuda_ipc sync measured inside a run, bench/RESULTS.md).
The tensors are the bf16 parameters of a Qwen2 body (bench_train_step's shapes), random values, on --device.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_train_step import SHAPES

from services.weights import checksums


def model_tensors(preset: str, device: torch.device) -> list[torch.Tensor]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=22, tie_word_embeddings=False, **SHAPES[preset])
    with torch.device("meta"):
        shapes = [p.shape for p in Qwen2ForCausalLM(cfg).parameters()]
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
            for shape in shapes]


def per_tensor(tensors: list[torch.Tensor]) -> list[str]:
    return checksums._hex_pairs([checksums._word_sums(checksums._words(t)) for t in tensors])


def packed(tensors: list[torch.Tensor]) -> list[str]:
    return checksums.tensor_checksums(tensors)


def timed(fn: Callable[[list[torch.Tensor]], list[str]], tensors: list[torch.Tensor], repeats: int) -> float:
    fn(tensors)   # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(tensors)   # ends in a host sync: the hex needs the sums
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--presets", nargs="+", default=["q05", "q05_narrow"], choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sync-ms", type=float, default=19.5, help="a sync without checksums, for the share")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for preset in args.presets:
        tensors = model_tensors(preset, device)
        assert per_tensor(tensors) == packed(tensors)   # the same checksums
        old, new = timed(per_tensor, tensors, args.repeats), timed(packed, tensors, args.repeats)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        rows.append((preset, len(tensors), nbytes / 1e9, old, new))
    print(f"\n# bench_checksums {datetime.date.today()} device={args.device} (medians of {args.repeats})\n")
    print("| preset | tensors | GB | per tensor ms | packed ms | speed-up | packed share of a sync "
          f"({args.sync_ms:g} ms, both sides) |")
    print("|---|---|---|---|---|---|---|")
    for preset, count, gb, old, new in rows:
        print(f"| {preset} | {count} | {gb:.3f} | {old:.2f} | {new:.2f} | {old / new:.1f}x | "
              f"{2 * new / args.sync_ms * 100:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

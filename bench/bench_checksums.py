"""What `weights.check_weight_update_equal` costs: the checksums of a model's weights one tensor at a time (how they
were computed until 2026-12-05), in packs (prefix sums over concatenated words, until issue 32), and per bucket
(services/weights/checksums.py, what a verified sync computes now), side by side, each ending in one host sync.

    python bench/bench_checksums.py [--device cuda] [--presets q05 q15 qwen2.5-0.5b] [--repeats 5] [--bucket-mb 64]
        [--sync-ms 19.5] [--profile]

Per bucket is measured over a native engine's FlatParams (each bucket summed where it lies; a trainer whose
weights are views of one flat buffer in spec order is the same) and over separate tensors (each bucket concatenated
once first); on a CUDA device with Triton that is the one-pass kernel (services/weights/bucket_kernel.py), and the
torch path (block and column sums, two passes) is measured beside it. A verified sync computes its checksums once
on the trainer (its prepare) and once on each engine after the copy, so "share of a sync" is 2 x ms / --sync-ms (the
q05 cuda_ipc sync measured inside a run, bench/RESULTS.md). The tensors are the bf16 parameters of a Qwen2 body
(bench_train_step's shapes, or a real model's: `qwen2.5-0.5b` has the 151,936-token vocabulary, tied), random
values, on --device. `--profile` splits the per-bucket flat path's milliseconds on a GPU: the kernels' device time
(torch.profiler) against the wall time of the call, and the bytes over the device time (issue 39 asks whether
the kernel is bound by its reads, its integer arithmetic or the host's launches).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from real_shapes import REAL_SHAPES
from train_step_variants import SHAPES

from services.weights import bucket_kernel, checksums
from services.weights.layout import Layout, plan_layout, specs_from_tensors
from services.weights.transports.cuda_ipc import flat_views


def model_tensors(preset: str, device: torch.device) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from services.modelinit.init_model import build_family_config

    if preset in REAL_SHAPES:  # named_parameters lists a tied head once, as the weight sync sends it
        cfg = build_family_config(preset)
    else:
        cfg = Qwen2Config(vocab_size=22, tie_word_embeddings=False, **SHAPES[preset])
    with torch.device("meta"):
        shapes = [(name, p.shape) for name, p in AutoModelForCausalLM.from_config(cfg).named_parameters()]
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        name: torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
        for name, shape in shapes
    }


def per_tensor(tensors: dict[str, torch.Tensor], _layout: Layout) -> list[str]:
    return checksums._hex_pairs([checksums._word_sums(checksums._words(t)) for t in tensors.values()])


def packed(tensors: dict[str, torch.Tensor], _layout: Layout) -> list[str]:
    return checksums.tensor_checksums(list(tensors.values()))


def per_bucket(tensors: dict[str, torch.Tensor], layout: Layout) -> list[str]:
    return checksums.bucket_checksums(layout, tensors)


def per_bucket_torch(tensors: dict[str, torch.Tensor], layout: Layout) -> list[str]:
    """The torch path (block and column sums) where the one-pass kernel would run."""
    usable = bucket_kernel.usable
    bucket_kernel.usable = lambda words: False
    try:
        return checksums.bucket_checksums(layout, tensors)
    finally:
        bucket_kernel.usable = usable


def timed(
    fn: Callable[[dict[str, torch.Tensor], Layout], list[str]],
    tensors: dict[str, torch.Tensor],
    layout: Layout,
    repeats: int,
) -> float:
    fn(tensors, layout)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(tensors, layout)  # ends in a host sync: the hex needs the sums
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(preset: str, device: torch.device, *, bucket_mb: float, repeats: int, profile: bool) -> dict[str, Any]:
    tensors = model_tensors(preset, device)
    layout = plan_layout(specs_from_tensors(tensors.items()), bucket_bytes=int(bucket_mb * 2**20))
    _flat, flat = flat_views(layout, device)  # a FlatParams, as a native engine holds its weights
    for name, view in flat.items():
        view.copy_(tensors[name])
    assert per_tensor(tensors, layout) == packed(tensors, layout)  # the same checksums
    assert per_bucket(flat, layout) == per_bucket(tensors, layout)  # wherever the bytes lie
    row = {"preset": preset, "tensors": len(tensors), "buckets": len(layout.buckets), "gb": layout.total_bytes / 1e9}
    row["per_tensor"] = timed(per_tensor, tensors, layout, repeats)
    row["packed"] = timed(packed, tensors, layout, repeats)
    row["bucket_flat"] = timed(per_bucket, flat, layout, repeats)
    row["bucket_separate"] = timed(per_bucket, tensors, layout, repeats)
    kernel = bucket_kernel.usable(next(iter(flat.values())).reshape(-1)[:1].view(torch.uint8))
    if kernel:  # the one-pass kernel ran above: the torch path beside it
        assert per_bucket_torch(flat, layout) == per_bucket(flat, layout)
    row["bucket_torch"] = timed(per_bucket_torch, flat, layout, repeats) if kernel else None
    row["device_ms"] = device_ms(per_bucket, flat, layout) if profile and device.type == "cuda" else None
    return row


def device_ms(fn: Callable[[dict[str, torch.Tensor], Layout], list[str]], tensors: Any, layout: Layout) -> float:
    """The GPU time of one call's kernels (ms): what is left of its wall time is the host's (launches, Python)."""
    from torch.profiler import ProfilerActivity, profile

    fn(tensors, layout)  # warm-up
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(tensors, layout)
    return sum(e.device_time_total for e in prof.key_averages()) / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--presets", nargs="+", default=["q05", "q05_narrow"], choices=[*sorted(SHAPES), *REAL_SHAPES])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="weights.bucket_mb (the default)")
    parser.add_argument("--sync-ms", type=float, default=19.5, help="a sync without checksums, for the share")
    parser.add_argument("--profile", action="store_true", help="the flat per-bucket path's kernel time (a GPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = [
        measure(p, device, bucket_mb=args.bucket_mb, repeats=args.repeats, profile=args.profile) for p in args.presets
    ]
    print(
        f"\n# bench_checksums {datetime.date.today()} device={args.device} bucket_mb={args.bucket_mb:g} "
        f"(medians of {args.repeats})\n"
    )
    print(
        "| preset | tensors | buckets | GB | per tensor ms | packed ms | per bucket, flat ms | per bucket, "
        "separate ms | per bucket, flat, torch path ms | per bucket (flat) share of a sync "
        f"({args.sync_ms:g} ms, both sides) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        torch_path = "– (the same: no kernel here)" if r["bucket_torch"] is None else f"{r['bucket_torch']:.2f}"
        print(
            f"| {r['preset']} | {r['tensors']} | {r['buckets']} | {r['gb']:.3f} | {r['per_tensor']:.2f} | "
            f"{r['packed']:.2f} | {r['bucket_flat']:.2f} | {r['bucket_separate']:.2f} | {torch_path} | "
            f"{2 * r['bucket_flat'] / args.sync_ms * 100:.1f}% |"
        )
    profiled = [r for r in rows if r["device_ms"] is not None]
    if profiled:
        print(
            "\n| preset | per bucket, flat: wall ms | kernels' device ms | host ms (the rest) | GB/s of device time |"
        )
        print("|---|---|---|---|---|")
        for r in profiled:
            wall, dev = r["bucket_flat"], r["device_ms"]
            print(f"| {r['preset']} | {wall:.2f} | {dev:.2f} | {wall - dev:.2f} | {r['gb'] / (dev / 1e3):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The native engine's sampling step at a real vocabulary (151,936): milliseconds per call of the sampling
distribution's log-probs, before issue 31 (whole-row sort for top-p, one mask per filter: tests/scoring_reference.py)
and now (services/tensors/sampling_dist.py: the nucleus sought within the top-k when top-k is set, the support kept as
a threshold), and of the whole draw (`sample_next`: log-probs + the draw). Then the draw alone, from the same
probabilities: `torch.multinomial` against the inverse CDF `sample_next` uses on the CPU (`sampling.draw`).

    python bench/bench_sampling.py [--device cpu] [--batch 16 64] [--vocab 151936] [--repeats 5]

Logits are random normal x 3 in float32 (bf16 on a GPU, as the engine's are), one row per sequence of the batch.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # scoring_reference: the old functions

from scoring_reference import table_log_probs

from services.contracts.sampling_spec import SamplingSpec
from services.rollout.engines.native.sampler import draw, sample_next
from services.tensors.sampling_dist import sampling_log_probs

SPECS = {
    "T=1": SamplingSpec(temperature=1.0),
    "top_p=0.9": SamplingSpec(temperature=0.7, top_p=0.9),
    "top_k=50": SamplingSpec(temperature=0.7, top_k=50),
    "top_k=50,top_p=0.9": SamplingSpec(temperature=0.7, top_k=50, top_p=0.9),
}


def timed_ms(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)  # the least disturbed run: on a shared box the median carries the other sessions' load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    rows, draws = [], []
    for batch in args.batch:
        logits = (torch.randn(batch, args.vocab, generator=gen, device=device) * 3).to(dtype)
        for name, spec in SPECS.items():
            before = timed_ms(lambda x=logits, s=spec: table_log_probs(x, s), device, args.repeats)
            now = timed_ms(lambda x=logits, s=spec: sampling_log_probs(x, s), device, args.repeats)
            drawn = timed_ms(lambda x=logits, s=spec: sample_next(x, s, gen), device, args.repeats)
            same = torch.equal(
                torch.isfinite(table_log_probs(logits, spec)), torch.isfinite(sampling_log_probs(logits, spec))
            )
            rows.append((batch, name, before, now, drawn, same))
            print(rows[-1], flush=True)
        probs = torch.softmax(logits.float(), dim=-1)
        multinomial = timed_ms(lambda p=probs: torch.multinomial(p, 1, generator=gen), device, args.repeats)
        inverse_cdf = timed_ms(lambda p=probs: draw(p, gen), device, args.repeats)
        draws.append((batch, multinomial, inverse_cdf))
    print(
        f"\n# bench_sampling {datetime.date.today()} device={args.device} vocab={args.vocab} (best of {args.repeats})\n"
    )
    print(
        "| batch | sampling | log-probs before ms | log-probs now ms | before / now | sample_next ms | same support |"
    )
    print("|---|---|---|---|---|---|---|")
    for batch, name, before, now, drawn, same in rows:
        print(f"| {batch} | {name} | {before:.1f} | {now:.1f} | {before / now:.2f}x | {drawn:.1f} | {same} |")
    print("\n| batch | torch.multinomial ms | sampling.draw ms | ratio |\n|---|---|---|---|")
    for batch, multinomial, inverse_cdf in draws:
        print(f"| {batch} | {multinomial:.1f} | {inverse_cdf:.1f} | {multinomial / inverse_cdf:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

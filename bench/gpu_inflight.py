"""Issue 33's bench: generation that never waits, on long-tailed response lengths at Qwen2.5-0.5B's shape (one GPU).

    python bench/gpu_inflight.py [--steps 8] [--only VARIANT ...] [--out DIR]    # runs, one summary JSON each
    python bench/gpu_inflight.py --report [--out DIR]                            # the side-by-side table
    python bench/gpu_inflight.py --config examples/digit_max.yaml --digits 2 --lengths 4 64 --steps 4 \
        --set rollout.sampling.max_new_tokens=64 --set rollout.max_context_length=128 --set loop.max_staleness=3 \
        --set rollout.reward=examples/digit_max_long/reward.py:reward        # the same on the CPU (a smoke test)

examples/qwen05_gpu.yaml (random-init Qwen2.5-0.5B shape and vocabulary, 64 prompts x 8 samples, ~252-token
prompts, trainer and native engine sharing the GPU over CUDA IPC) with every training row's response forced to its
own lognormal length in 16..2048 tokens (examples/digit_max_long/generate_data.py --lengths 16 2048: median ~47, a
tail to ~1,000+), run each way:
  sync              generate, train, sync: the batch waits for its longest sample and the trainer for the batch
  one_step_off      async: the next batch generates while this one trains; the sync drains that generation
  inflight_keep     async with rollout.inflight_update keep: the sync lands between two decode steps
  stream_keep       loop.mode streaming + continuous batching + inflight keep: groups stream as they finish, rows of
                    finished samples go to waiting ones (on a GPU one static cache, a CUDA-graph replay a token)
  stream_recompute  the same with inflight recompute (the KV of running samples recomputed after each sync)
Per run: tokens/s (response tokens over the summed step time; and without the checkpoint save that ends every run,
the same ~10 s in each), the engine's GPU-busy fraction (its forward passes'
wall time, RolloutState.engine_busy_s, over the same), median weight-sync ms, stale drops, and the training reward
against the samples trained so far (the same number of samples for every run). Goal (issue 33): in-flight >= 1.5x
the tokens/s of one_step_off with a reward curve per sample within noise of it.
The runs of one call must fit its limit: gpu_suite.py splits them over the stages inflight_a/_b/_c; each writes
DIR/inflight_<variant>.json, and `--report` (stage inflight_report) prints the table of all found.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_run import REPO, run_one

CONFIG = REPO / "examples" / "qwen05_gpu.yaml"
COMMON = [
    "rollout.sampling.max_new_tokens=2048",
    "rollout.max_context_length=2304",
    "loop.max_staleness=2",
    "loop.eval_interval=null",
]
STREAM = ["loop.mode=streaming", "rollout.continuous_batching=true", "redis.max_buffered_batches=128"]
VARIANTS = {
    "sync": ["loop.mode=sync"],
    "one_step_off": ["loop.mode=async"],
    "inflight_keep": ["loop.mode=async", "rollout.inflight_update=keep"],
    "stream_keep": [*STREAM, "rollout.inflight_update=keep"],
    "stream_recompute": [*STREAM, "rollout.inflight_update=recompute"],
}
BUSY = re.compile(r"engine busy ([\d.]+) s of ([\d.]+) s")


def long_tailed_data(work: Path, *, lengths: list[int], digits: int) -> list[str]:
    out = work / "data"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "examples/digit_max_long/generate_data.py"),
            "--lengths",
            *map(str, lengths),
            "--digits",
            str(digits),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    return [f"data.train_path={out / 'train.jsonl'}", f"data.eval_path={out / 'eval.jsonl'}"]


def summarize(name: str, result: dict) -> dict:
    steps = result["steps"]
    step_s = sum(s["perf/step_time_s"] for s in steps)
    save_s = sum(s.get("perf/save_time_s", 0.0) for s in steps)  # inside a step's time: the run's final checkpoint
    tokens = sum(s.get("rollout/response_tokens", 0.0) for s in steps)
    busy = BUSY.findall((result["run_dir"] / "logs" / "rollout-0.log").read_text(errors="replace"))
    samples, curve = 0.0, []
    for s in steps:
        samples += s.get("rollout/num_samples", 0.0)
        curve.append((samples, s["rollout/reward_mean"]))
    syncs = [s["perf/weight_sync_time_s"] for s in steps if "perf/weight_sync_time_s" in s]
    return {
        "name": name,
        "steps": len(steps),
        "wall_s": result["wall_s"],
        "step_s": step_s,
        "save_s": save_s,
        "tokens": tokens,
        "tokens_per_s": tokens / step_s if step_s else 0.0,
        "engine_busy_s": float(busy[-1][0]) if busy else None,
        "sync_ms": 1000 * statistics.median(syncs) if syncs else None,
        "stale_dropped": sum(s.get("rollout/stale_dropped", 0.0) for s in steps),
        "inflight_token_frac": statistics.mean(s.get("rollout/inflight_token_frac", 0.0) for s in steps),
        "curve": curve,
    }


def report(summaries: list[dict]) -> str:
    names = [s["name"] for s in summaries]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    base = next((s for s in summaries if s["name"] == "one_step_off"), None)
    row("steps", [str(s["steps"]) for s in summaries])
    row("tokens/s (response tokens / summed step time)", [f"{s['tokens_per_s']:.0f}" for s in summaries])
    if base is not None:
        row("x one_step_off", [f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}" for s in summaries])
    # every run ends with the same checkpoint save (~10 s at q05), which is neither mode's throughput
    unsaved = [s["tokens"] / (s["step_s"] - s.get("save_s", 0.0)) for s in summaries]
    row("tokens/s without the checkpoint saves", [f"{t:.0f}" for t in unsaved])
    if base is not None:
        ref = unsaved[summaries.index(base)]
        row("x one_step_off, without the saves", [f"{t / ref:.2f}" for t in unsaved])
    row(
        "engine GPU-busy fraction (busy s / step s)",
        ["–" if s["engine_busy_s"] is None else f"{s['engine_busy_s'] / s['step_s']:.2f}" for s in summaries],
    )
    row("median weight sync ms", ["–" if s["sync_ms"] is None else f"{s['sync_ms']:.0f}" for s in summaries])
    row("samples dropped as stale", [f"{s['stale_dropped']:.0f}" for s in summaries])
    row("mean in-flight token fraction", [f"{s['inflight_token_frac']:.3f}" for s in summaries])
    fewest = min(s["curve"][-1][0] for s in summaries)
    for part in (0.25, 0.5, 0.75, 1.0):
        row(
            f"train reward at {part:.0%} of {fewest:.0f} samples",
            [f"{_reward_at(s['curve'], part * fewest):.3f}" for s in summaries],
        )
    return "\n".join(lines)


def _reward_at(curve: list[list[float]] | list[tuple[float, float]], samples: float) -> float:
    """The mean reward of the steps up to `samples` samples (a step's reward counts once its samples are in)."""
    upto = [r for n, r in curve if n <= samples] or [curve[0][1]]
    return statistics.mean(upto[-3:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", choices=list(VARIANTS), nargs="*", default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "runs" / "gpu_inflight")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/tandem-gpu-inflight"))
    parser.add_argument("--report", action="store_true", help="print the table of every summary in --out")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--lengths", type=int, nargs=2, default=[16, 2048])
    parser.add_argument(
        "--digits",
        type=int,
        default=126,
        help="prompt digits (126: 252 tokens with qwen05_gpu.yaml's BPE, 128 with the toy tokenizer)",
    )
    parser.add_argument("--set", action="append", default=[], help="more overrides, after the bench's own")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        data = long_tailed_data(args.work, lengths=args.lengths, digits=args.digits)
        for name in args.only:
            result = run_one(
                name,
                [*COMMON, *data, *VARIANTS[name], *args.set],
                steps=args.steps,
                work=args.work,
                config=args.config.resolve(),
            )
            (args.out / f"inflight_{name}.json").write_text(json.dumps(summarize(name, result)))
            shutil.copy(result["run_dir"] / "metrics.jsonl", args.out / f"inflight_metrics_{name}.jsonl")
    found = {json.loads(p.read_text())["name"]: json.loads(p.read_text()) for p in args.out.glob("inflight_*.json")}
    table = report([found[n] for n in VARIANTS if n in found])
    print(table)
    (args.out / "gpu_inflight.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Full `tandem run`s on one GPU: trainer and native engine share the device, weights move by CUDA IPC.

    python bench/gpu_run.py [--steps 60] [--out DIR] [--config examples/digit_max_gpu.yaml] [--only RUN ...]

Runs a GPU example (examples/digit_max_gpu.yaml unless --config) three ways:
  async         one step off-policy: generation of step i+1 overlaps training of step i
  sync_offload  sync mode, trainer offloaded after each step and the engine's memory released while it trains
  async_t07_topp  async, sampled at temperature 0.7 with top-p 0.9 (the trainer scores that distribution)
and, when named, async with weights.check_weight_update_equal on and off (async_verified, async_unverified: the
checksums' share of the sync, perf/sync_checksum_s / perf/weight_sync_time_s, is a row of the table)
and prints, per run, the eval reward before and after, the median per-step time breakdown, the overlap ratio
step / max(generate, train) (1.0 is perfect overlap in async; sync is their sum), tokens/s, the trainer's dense
TFLOP/s, each side's peak GPU memory and (sync_offload) the GPU memory each side holds while the other works.
Run dirs go under --work; gpu_run.md and each run's metrics.jsonl are copied to --out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.contracts.files import read_json_rows  # noqa: E402 - after the path is set

CONFIG = REPO / "examples" / "digit_max_gpu.yaml"
RUNS = {
    "async": [],
    "sync_offload": ["loop.mode=sync", "loop.offload_train=true", "loop.offload_rollout=true"],
    # sampled at T=0.7 with top-p: the trainer must score that distribution (log-prob gap ~0, ratio 1)
    "async_t07_topp": ["rollout.sampling.temperature=0.7", "rollout.sampling.top_p=0.9"],
    # every sync verified by bucket checksums (issue 32: perf/sync_checksum_s <= 5% of the sync)
    "async_verified": ["weights.check_weight_update_equal=true"],
    "async_unverified": ["weights.check_weight_update_equal=false"],
}
DEFAULT_RUNS = ("async", "sync_offload", "async_t07_topp")  # the verification pair only when named
SCORING = [  # how closely the trainer's log-probs match the rollout's (bf16 on both sides)
    ("train/rollout_logprob_abs_diff", "trainer vs rollout log-prob |diff|", "{:.4f}"),
    ("train/ppo_ratio_mean", "PPO ratio mean", "{:.4f}"),
    ("train/pg_clipfrac", "clip fraction", "{:.4f}"),
]
BREAKDOWN = [  # (metric, label): the parts of a step, as the coordinator measured them
    ("perf/step_time_s", "step"),
    ("perf/rollout_wait_s", "wait for rollout"),
    ("perf/generate_time_s", "generate"),
    ("perf/train_time_s", "train"),
    ("perf/weight_sync_time_s", "weight sync"),
    ("perf/sync_checksum_s", "of the sync: checksums (trainer + slowest engine)"),
    ("perf/rollout_release_s", "engine release"),
    ("perf/rollout_resume_s", "engine resume"),
    ("perf/trainer_offload_s", "trainer offload"),
    ("perf/trainer_onload_s", "trainer onload"),
]
MEMORY = [
    ("train/gpu_gb_peak", "trainer peak GPU GiB (allocator reserved)"),
    ("rollout/gpu_gb_peak", "engine peak GPU GiB (allocator reserved)"),
    ("memory/trainer_gpu_gb_training", "trainer GPU GiB, training"),
    ("memory/trainer_gpu_gb_offloaded", "trainer GPU GiB, offloaded"),
    ("memory/rollout_gpu_gb_released", "engine GPU GiB, released"),
    ("memory/rollout_gpu_gb_freed", "engine GPU GiB freed by the release"),
]


def run_one(name: str, overrides: list[str], *, steps: int, work: Path, config: Path = CONFIG) -> dict:
    run_dir = work / config.stem / name
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [a for o in [f"loop.num_rollout={steps}", *overrides] for a in ("--set", o)]
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "run",
        str(config),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--init-model",
        *sets,
    ]
    t = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - t
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
        raise SystemExit(f"{name}: tandem run exited {proc.returncode}\n{proc.stderr[-3000:]}\n{logs}")
    rows = read_json_rows(run_dir / "metrics.jsonl")
    return {
        "name": name,
        "wall_s": wall,
        "steps": [r for r in rows if "perf/step_time_s" in r],
        "evals": [r for r in rows if "eval/reward_mean" in r],
        "run_dir": run_dir,
    }


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows[2:] if key in r]  # the first steps include CUDA-graph capture
    return statistics.median(values) if values else None


def report(results: list[dict]) -> str:
    names = [r["name"] for r in results]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("steps", [str(len(r["steps"])) for r in results])
    row("wall s (start-up included)", [f"{r['wall_s']:.1f}" for r in results])
    row("eval reward, before training", [_eval(r, 0) for r in results])
    row("eval reward, after the last step", [_eval(r, -1) for r in results])
    row(
        "train reward, first 5 → last 5 steps",
        [
            f"{statistics.mean(s['rollout/reward_mean'] for s in r['steps'][:5]):.3f} → "
            f"{statistics.mean(s['rollout/reward_mean'] for s in r['steps'][-5:]):.3f}"
            for r in results
        ],
    )
    for key, label in BREAKDOWN:
        cells = [median(r["steps"], key) for r in results]
        row(f"median {label} ms", ["–" if c is None else f"{1000 * c:.1f}" for c in cells])
    row("overlap: step / max(generate, train)", [_overlap(r["steps"]) for r in results])
    row(
        "median tokens/s (prompt + response, trained)",
        [
            f"{tokens / step_s:.0f}"
            if (tokens := median(r["steps"], "train/tokens")) and (step_s := median(r["steps"], "perf/step_time_s"))
            else "–"
            for r in results
        ],
    )
    row(
        "median trainer TFLOP/s (6 x params x tokens / train s)",
        [f"{median(r['steps'], 'perf/train_tflops') or 0:.1f}" for r in results],
    )
    row("median weight sync GB/s", [f"{median(r['steps'], 'perf/weight_sync_gbps') or 0:.1f}" for r in results])
    row("verified tensors per sync", [f"{median(r['steps'], 'weights/verified_tensors') or 0:.0f}" for r in results])
    row("median checksums / weight sync (same step)", [_checksum_share(r["steps"]) for r in results])
    for key, label, fmt in SCORING:
        cells = [median(r["steps"], key) for r in results]
        row(f"median {label}", ["–" if c is None else fmt.format(c) for c in cells])
    for key, label in MEMORY:
        cells = [median(r["steps"], key) for r in results]
        row(label, ["–" if c is None else f"{c:.3f}" for c in cells])
    return "\n".join(lines)


def _eval(result: dict, index: int) -> str:
    return f"{result['evals'][index]['eval/reward_mean']:.3f}" if result["evals"] else "– (no evals)"


def _checksum_share(steps: list[dict]) -> str:
    shares = [
        s["perf/sync_checksum_s"] / s["perf/weight_sync_time_s"]
        for s in steps[2:]
        if s.get("perf/sync_checksum_s") is not None and s.get("perf/weight_sync_time_s")
    ]
    return f"{100 * statistics.median(shares):.1f}%" if shares else "–"


def _overlap(steps: list[dict]) -> str:
    ratios = [
        s["perf/step_time_s"] / max(s["perf/generate_time_s"], s["perf/train_time_s"])
        for s in steps[2:]
        if s.get("perf/generate_time_s") and s.get("perf/train_time_s")
    ]
    return f"{statistics.median(ratios):.2f}" if ratios else "–"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "runs" / "gpu_run")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/tandem-gpu-run"), help="where the run dirs go")
    parser.add_argument("--only", choices=list(RUNS), nargs="*", default=list(DEFAULT_RUNS))
    parser.add_argument("--config", type=Path, default=CONFIG, help="the example to run (its own data and model)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = [
        run_one(name, RUNS[name], steps=args.steps, work=args.work, config=args.config.resolve()) for name in args.only
    ]
    table = report(results)
    print(table)
    (args.out / "gpu_run.md").write_text(table + "\n")
    for r in results:
        shutil.copy(r["run_dir"] / "metrics.jsonl", args.out / f"metrics_{r['name']}.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Async vs sync step time on the same config, next to the ideal overlap ratio.

    python bench/bench_async_vs_sync.py [--steps 20] [--set key=value ...]

Runs `tandem run` twice (loop.mode sync, then async) and prints mean step time (steps after the first
`--warmup` excluded), the measured ratio async/sync, and the ideal max(rollout, train) / (rollout + train)
from the sync run's own rollout and train times. On a CPU-only machine the services share cores, so
overlap is bounded by the cores available as well.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_mode(mode: str, *, steps: int, overrides: list[str], base: Path) -> list[dict]:
    run_dir = base / mode
    args = [
        sys.executable,
        "-m",
        "services.cli",
        "run",
        str(REPO / "examples" / "digit_max.yaml"),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--init-model",
        "--set",
        f"loop.mode={mode}",
        "--set",
        f"loop.num_rollout={steps}",
        "--set",
        "loop.eval_interval=null",
    ]
    for item in overrides:
        args += ["--set", item]
    subprocess.run(args, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "perf/step_time_s" in r]


def mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows if key in r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            m: run_mode(m, steps=args.steps, overrides=args.overrides, base=Path(tmp))[args.warmup :]
            for m in ("sync", "async")
        }
    sync, asyn = results["sync"], results["async"]
    rollout, train = mean(sync, "perf/rollout_time_s"), mean(sync, "perf/train_time_s")
    print(f"{'mode':<8}{'step s':>10}{'rollout s':>11}{'train s':>10}{'sync s':>9}")
    for name, rows in results.items():
        print(
            f"{name:<8}{mean(rows, 'perf/step_time_s'):>10.4f}{mean(rows, 'perf/rollout_time_s'):>11.4f}"
            f"{mean(rows, 'perf/train_time_s'):>10.4f}{mean(rows, 'perf/weight_sync_time_s'):>9.4f}"
        )
    measured = mean(asyn, "perf/step_time_s") / mean(sync, "perf/step_time_s")
    ideal = max(rollout, train) / (rollout + train)
    print(f"\nasync/sync step time: {measured:.3f}   ideal max(rollout, train)/(rollout + train): {ideal:.3f}")


if __name__ == "__main__":
    main()

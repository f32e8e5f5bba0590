"""Tracing overhead per step: exporter none vs file, as a ratio.

    python bench/bench_tracing.py [--steps 30] [--repeats 2] [--spans 20000] [--set key=value ...]

1. Whole runs: `tandem run` of examples/digit_max.yaml with tracing.exporter none and file, alternated
   `--repeats` times (none, file, none, file, ...) so drift on a shared machine hits both alike. Per exporter
   it prints the median step time (first `--warmup` steps of each run dropped), the spans written per step
   (file), and the ratio file/none of the median step times.
2. Per span: one process per exporter opens and closes `--spans` spans with three `rl.*` attributes; the
   cost per span times the spans per step, over the none step time, is the overhead tracing adds per step
   — a steadier estimate than (1) on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SPAN_LOOP = """
import sys, time
from services.telemetry import tracing
exporter, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
tracing.setup_tracing("tandem-bench", exporter=exporter, file_path=path)
for _ in range(1000):   # warm-up: imports, first file write
    with tracing.span("rl.bench", rollout_id=1, weight_version=2, tokens=3):
        pass
t = time.perf_counter()
for _ in range(n):
    with tracing.span("rl.bench", rollout_id=1, weight_version=2, tokens=3):
        pass
print((time.perf_counter() - t) / n)
"""


def run_once(exporter: str, *, steps: int, overrides: list[str], run_dir: Path) -> tuple[list[float], int]:
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
        f"tracing.exporter={exporter}",
        "--set",
        f"loop.num_rollout={steps}",
        "--set",
        "loop.eval_interval=null",
    ]
    for item in overrides:
        args += ["--set", item]
    subprocess.run(args, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    traces = run_dir / "traces.jsonl"
    spans = len(traces.read_text().splitlines()) if traces.exists() else 0
    return [r["perf/step_time_s"] for r in rows if "perf/step_time_s" in r], spans


def span_cost(exporter: str, *, spans: int, path: Path) -> float:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SPAN_LOOP), exporter, str(path), str(spans)],
        check=True,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--spans", type=int, default=20000)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    steps: dict[str, list[float]] = {"none": [], "file": []}
    per_run: dict[str, list[float]] = {"none": [], "file": []}  # each run's median: the noise between runs
    span_lines = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for exporter in steps:
                times, spans = run_once(
                    exporter, steps=args.steps, overrides=args.overrides, run_dir=Path(tmp) / f"{exporter}{i}"
                )
                steps[exporter] += times[args.warmup :]
                per_run[exporter].append(statistics.median(times[args.warmup :]))
                span_lines += spans
        costs = {e: span_cost(e, spans=args.spans, path=Path(tmp) / f"bench-{e}.jsonl") for e in steps}
    spans_per_step = span_lines / (args.repeats * args.steps)  # startup spans included: an upper bound
    median = {e: statistics.median(v) for e, v in steps.items()}
    print(f"{'exporter':<10}{'steps':>7}{'median step s':>15}{'runs min..max':>16}{'spans/step':>12}{'us/span':>10}")
    for e in steps:
        spread = f"{min(per_run[e]):.4f}..{max(per_run[e]):.4f}"
        print(
            f"{e:<10}{len(steps[e]):>7}{median[e]:>15.4f}{spread:>16}{spans_per_step if e == 'file' else 0:>12.1f}"
            f"{costs[e] * 1e6:>10.1f}"
        )
    estimated = 1 + (costs["file"] - costs["none"]) * spans_per_step / median["none"]
    print(
        f"\nmeasured step time file/none: {median['file'] / median['none']:.3f}   "
        f"estimated from span cost: {estimated:.4f}"
    )


if __name__ == "__main__":
    main()

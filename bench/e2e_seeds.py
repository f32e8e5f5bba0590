"""Each learning e2e under several sampling seeds: every asserted aggregate against its threshold, as a table.

    nice -n 10 python bench/e2e_seeds.py --seeds 1 2 3 4 5 [--tests math_chat gspo ...] [--margins FILE]
    python bench/e2e_seeds.py --table FILE         # the table of runs already recorded

Each run is `pytest -p no:xdist TEST` with TANDEM_E2E_SEED=seed (tests/tandem_runs.py: rollout.sampling.seed, and
the eval's the next), TANDEM_E2E_WARM_START (math_chat's warm start, built once: it has a seed of its own) and
TANDEM_E2E_MARGINS=FILE, where the tests' assert_above / assert_below append every value they assert with its
threshold. Runs go one at a time (the machine is shared); a run already in FILE is skipped, so
a stopped sweep goes on where it stopped. The table: one row per check, the value under each seed, the threshold,
and the smallest margin (value - threshold for `>`, threshold - value for `<`); a failed run says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LEARNING_E2ES = {
    "math_chat": "tests/test_run_math_chat_e2e.py::test_policy_learns_math_chat_in_async_mode",
    "gspo_rloo": "tests/test_run_e2e.py::"
    "test_gspo_with_rloo_and_geometric_rejection_learns_digit_max_with_two_token_answers",
    "reinforce_pp": "tests/test_run_e2e.py::test_reinforce_pp_learns_at_temperature_0_7_with_top_p_scored_on_policy",
    "dynamic_sampling": "tests/test_run_e2e.py::"
    "test_dynamic_sampling_filters_uniform_groups_keeps_the_books_and_learns",
    "lora": "tests/test_run_e2e.py::test_lora_policy_learns_digit_max",
    "inflight": "tests/test_reliability_runs.py::"
    "test_inflight_streaming_learns_long_tailed_digit_max_and_a_coordinator_kill_9_trains_every_group_once",
    "tool": "tests/test_run_tool_e2e.py::test_policy_learns_to_call_the_lookup_tool",
    "agent": "tests/test_run_agent_e2e.py::"
    "test_an_openai_client_agent_learns_to_call_the_lookup_tool_through_the_endpoint",
    "distill": "tests/test_run_distill_e2e.py::test_student_learns_the_task_from_the_teacher_alone",
    "judge": "tests/test_reward_e2e.py::test_the_policy_learns_from_the_judge_service_through_a_kill_of_it",
}


def run_one(name: str, seed: int, margins: Path, timeout_s: int) -> dict:
    env = {**os.environ, "TANDEM_E2E_SEED": str(seed), "TANDEM_E2E_MARGINS": str(margins), "PYTHONPATH": str(REPO)}
    # math_chat's warm start does not depend on the sampling seed: built by the first run, kept for the others
    env["TANDEM_E2E_WARM_START"] = str(margins.resolve().parent / "math_chat_warm_start")
    # pytest-timeout's limit (600 s in pyproject.toml) is the sweep's: at nice 10 on a busy box runs are slower
    limit, test = [f"--timeout={timeout_s}"], LEARNING_E2ES[name]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", *limit, test],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s + 60,
        )
        passed, tail = proc.returncode == 0, proc.stdout[-2000:]
    except subprocess.TimeoutExpired:
        passed, tail = False, f"timed out after {timeout_s} s"
    row = {"run": name, "seed": seed, "passed": passed, "wall_s": round(time.monotonic() - start, 1)}
    with open(margins, "a") as out:
        out.write(json.dumps(row) + "\n")
    if not passed:
        print(f"{name} seed {seed}: FAILED\n{tail}", file=sys.stderr)
    return row


def table(margins: Path) -> str:
    rows = [json.loads(line) for line in margins.read_text().splitlines() if line.strip()]
    runs = {(r["run"], r["seed"]): r for r in rows if "run" in r}
    by_test = {v.split("::")[1]: k for k, v in LEARNING_E2ES.items()}
    checks: dict[tuple[str, str, str, float], dict[int, float]] = defaultdict(dict)
    for r in rows:
        if "what" in r:
            name = by_test.get(r["test"].split("::")[-1], r["test"])
            checks[(name, r["what"], r["op"], r["threshold"])][int(r["seed"] or 0)] = r["value"]
    seeds = sorted({seed for _, seed in runs})
    lines = [
        "| e2e | check | " + " | ".join(f"seed {s}" for s in seeds) + " | threshold | min margin |",
        "|---|---|" + "---|" * len(seeds) + "---|---|",
    ]
    for (name, what, op, threshold), values in checks.items():
        margins_ = [(v - threshold) if op == ">" else (threshold - v) for v in values.values()]
        cells = [f"{values[s]:.3f}" if s in values else "-" for s in seeds]
        lines.append(f"| {name} | {what} | {' | '.join(cells)} | {op} {threshold:g} | {min(margins_):+.3f} |")
    lines.append("")
    lines.append("| e2e | " + " | ".join(f"seed {s}" for s in seeds) + " |")
    lines.append("|---|" + "---|" * len(seeds))
    for name in dict.fromkeys(run for run, _ in runs):
        cells = []
        for s in seeds:
            r = runs.get((name, s))
            cells.append("-" if r is None else f"{'pass' if r['passed'] else 'FAIL'} {r['wall_s']:.0f} s")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--tests", nargs="+", choices=sorted(LEARNING_E2ES), default=list(LEARNING_E2ES))
    parser.add_argument("--margins", type=Path, default=REPO / "runs" / "e2e_seeds.jsonl")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a run may take")
    parser.add_argument("--table", type=Path, help="only print the table of the runs in this file")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    args.margins.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if args.margins.exists():
        done = {(r["run"], r["seed"]) for r in map(json.loads, args.margins.read_text().splitlines()) if "run" in r}
    for name in args.tests:
        for seed in args.seeds:
            if (name, seed) not in done:
                row = run_one(name, seed, args.margins, args.timeout)
                print(f"{name} seed {seed}: {'pass' if row['passed'] else 'FAIL'} in {row['wall_s']} s", flush=True)
    print(table(args.margins))


if __name__ == "__main__":
    main()

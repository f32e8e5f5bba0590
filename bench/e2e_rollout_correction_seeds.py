"""The learning margins of tests/test_run_e2e.py's GSPO + RLOO + geometric-rejection run on digit_max, over sampling
seeds: the run the test makes, with `rollout.sampling.seed` set, and optionally without the rejection (the run before
issue 41) for comparison.

    python bench/e2e_rollout_correction_seeds.py --seeds 1 11 21 31 41
    python bench/e2e_rollout_correction_seeds.py --seeds 11 --no-rejection

Prints one row per run: the greedy evals (untrained, step 25, step 50), the mean training reward of the first and last
5 steps, and the fraction of sequences the rejection dropped (mean and worst step). The test asserts trained > 0.6 and
last5 > first5 + 0.15.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tandem_runs import metrics, start_run, supervisor_log

REJECTION = "algorithm.rollout_correction={rejection: geometric, low: 0.9, high: 1.1}"  # the test's


def run(base: Path, seed: int, *, rejection: bool) -> str:
    run_dir = base / f"seed{seed}"
    overrides = [
        "loop.num_rollout=50",
        "loop.eval_interval=25",
        "algorithm.policy_loss=gspo",
        "algorithm.advantage_estimator=rloo",
        "rollout.sampling.max_new_tokens=2",
        "rollout.eval_sampling.max_new_tokens=2",
        f"rollout.sampling.seed={seed}",
        *([REJECTION] if rejection else []),
    ]
    if start_run(run_dir, *overrides).wait(timeout=1200) != 0:
        return f"| {seed} | failed: {supervisor_log(run_dir)[-300:]!r} |"
    rows = metrics(run_dir)
    evals = " → ".join(f"{r['eval/reward_mean']:.2f}" for r in rows if "eval/reward_mean" in r)
    steps = [r for r in rows if "rollout/reward_mean" in r]
    first, last = (sum(r["rollout/reward_mean"] for r in part) / 5 for part in (steps[:5], steps[-5:]))
    masked = [r.get("mismatch/seq_masked_frac", 0.0) for r in steps]
    return f"| {seed} | {evals} | {first:.3f} → {last:.3f} | {sum(masked) / len(masked):.3f} / {max(masked):.3f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 11, 21, 31, 41])
    parser.add_argument("--no-rejection", action="store_true", help="the run without rollout correction")
    args = parser.parse_args()
    print("| seed | greedy eval (0, 25, 50) | reward first 5 → last 5 | seqs rejected mean / max |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            print(run(Path(tmp), seed, rejection=not args.no_rejection), flush=True)


if __name__ == "__main__":
    main()

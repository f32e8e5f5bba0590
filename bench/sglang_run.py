"""Full `tandem run`s with SGLang as the rollout engine, against the small server of bench/sglang_servers.py.

    python bench/sglang_run.py [--steps 12] [--out DIR]        # SGLANG_SERVERS names the server (the GPU suite)

Runs examples/digit_max_sglang_gpu.yaml (sync mode, T=0.7 / top-p 0.9, weights by cuda_ipc through
/update_weights_from_tensor) twice against one running server (rollout.sglang.urls, model.path = its checkpoint,
so SGLang's start-up is paid once for the whole call):
  sync_t07      as the example is;
  sync_offload  also loop.offload_train and loop.offload_rollout: SGLang releases its memory (KV cache, CUDA graphs,
                weights) while the trainer trains and takes it back around the sync (memory/rollout_gpu_gb_freed).
Prints gpu_run.py's table for both and checks, on sync_t07, that the trainer scores what SGLang reports: the
median over steps 3.. of train/rollout_logprob_abs_diff <= 0.005 and of train/ppo_ratio_mean within 1 +- 0.001
(on-policy, so any gap is the two sides' kernels). Exit 1 when a check fails, 0 with "skipped" without sglang or
a server.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_run import median, report, run_one
from sglang_servers import load

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "digit_max_sglang_gpu.yaml"
MAX_DIFF, RATIO_TOL = 0.005, 0.001


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "runs" / "sglang_run"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/tandem-sglang-run"))
    args = parser.parse_args()
    server = load().get("small", {})
    if importlib.util.find_spec("sglang") is None:
        print("skipped: the sglang package is not importable (source bench/gpu_env.sh sglang)")
        return 0
    if server.get("startup_s") is None:
        print(f"skipped: no healthy small-preset SGLang server (SGLANG_SERVERS): {server}")
        return 0
    shared = [f"model.path={server['model']}", f"rollout.sglang.urls=[{server['url']}]"]
    runs = {"sync_t07": shared, "sync_offload": [*shared, "loop.offload_train=true", "loop.offload_rollout=true"]}
    results = [
        run_one(name, overrides, steps=args.steps, work=args.work, config=CONFIG) for name, overrides in runs.items()
    ]
    table = report(results)
    print("SGLang 0.5.17 rollout engine (examples/digit_max_sglang_gpu.yaml), small preset, T=0.7 / top-p 0.9\n")
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sglang_run.md").write_text(table + "\n")
    for r in results:
        shutil.copy(r["run_dir"] / "metrics.jsonl", args.out / f"metrics_{r['name']}.jsonl")
    steps = results[0]["steps"]
    diff, ratio = median(steps, "train/rollout_logprob_abs_diff"), median(steps, "train/ppo_ratio_mean")
    worst = max(
        (s["train/rollout_logprob_abs_diff"] for s in steps if "train/rollout_logprob_abs_diff" in s), default=None
    )
    freed = median(results[1]["steps"], "memory/rollout_gpu_gb_freed")
    ok = diff is not None and ratio is not None and diff <= MAX_DIFF and abs(ratio - 1) <= RATIO_TOL
    print(
        f"\n{'PASS' if ok else 'FAIL'} sync_t07: median |diff| {diff} (<= {MAX_DIFF}; worst step {worst}), "
        f"median ratio {ratio} (1 +- {RATIO_TOL})"
    )
    print(f"sync_offload: SGLang freed {freed} GiB (median per step) while the trainer trained")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

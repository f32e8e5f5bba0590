"""Every GPU check in one call: the GPU tests, the same-GPU weight hand-off bench and the native engine bench.

    python bench/gpu_suite.py --plan [--budget-s 560] [--stages NAME ...]   # issue 39's goals, pending ones first
    python bench/gpu_suite.py --plan --dry-run      # the plan and its state, every command's arguments checked
    python bench/gpu_suite.py --absorb DIR          # a plan call's returned files -> gpu_plan.json, RESULTS.md
      (bench/gpu_plan.py: the stages in priority order, what a call carries, how finished stages are skipped)
    python bench/gpu_suite.py [--out DIR] [--quick]
        [--only handoff ipc_copy checksums train_step engine engine_compile tests offload trainer_tests run]
    python bench/gpu_suite.py --only checksums_run   # check_weight_update_equal's share of a sync in runs
    python bench/gpu_suite.py --only peer_trl        # Tandem vs TRL (bench/peer_trl.py), a call of its own
    python bench/gpu_suite.py --only sglang_smoke sglang_bench sglang_run   # SGLang 0.5.17, a call of its own
    python bench/gpu_suite.py --only inflight_a ... then inflight_b, inflight_c, inflight_report   # issue 33, one
        call each (or inflight_a inflight_b in one call when it has the time; the report reads what is found)
    python bench/gpu_suite.py --only vocab_q05 prime_rl_shape sampling   # the real vocabulary (issue 31), one call
    python bench/gpu_suite.py --only pack_ac tests trainer_tests         # packing / checkpointing, the GPU tests
    python bench/gpu_suite.py --only vocab_q15                  # the 1.5B shape, a call of its own
    python bench/gpu_suite.py --only peer_trl_vocab             # Tandem vs TRL at 151,936 tokens (carry .whl_trl)

On the device machine every command starts with `source bench/gpu_env.sh` (add `sglang` for SGLang stages), which
installs the wheels the call carries: `.whl` for these stages, `.whl .whl_trl` for peer_trl, `.sglang` +
`.whl/core/grpcio-*.whl` for the SGLang stages (bench/gpu_kit.sh). The SGLang stages share two servers that the suite
launches once before the first of them and stops after the last (bench/sglang_servers.py; its start-up has a limit of
its own and is reported as the stage "sglang_servers"); without the sglang package nothing is launched and each stage
skips.

Each stage runs as its own process with its own time limit, so one hang cannot take the others down; its
full output goes to DIR/<stage>.log and a markdown summary (command, exit code, seconds, the stage's tables
or pytest's summary) to DIR/gpu_suite.md, which is also printed last. DIR defaults to $OUT when set (the
device tool's output folder), else bench/gpu_suite_out. Exit code 0 only when every stage passed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # gpu_plan
import gpu_plan  # noqa: E402  (bench/ on the path first)

PY = sys.executable

GPU_TESTS = ["tests/test_rollout_gpu.py", "tests/test_weights_cuda.py"]


def stages(quick: bool, out: Path) -> dict[str, tuple[list[str], int, dict[str, str]]]:
    """name -> (command, time limit in seconds, extra environment)."""
    tests = sorted({*GPU_TESTS, *(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/test_*_gpu*.py"))})
    engine = list(
        gpu_plan.native_engine_command(128, "--repeats", "1" if quick else "2", "--warmup", "0" if quick else "1")
    )
    pytest = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    return {  # benches first: the limits of the later stages absorb a slow start
        "handoff": ([PY, "bench/bench_weights.py", "--handoff", "--repeats", "10", "--bucket-mb", "64"], 100, {}),
        # the copy itself: from another process's IPC allocation next to a same-process D2D, by copy method
        "ipc_copy": ([PY, "bench/bench_ipc_copy.py", "--repeats", "20"], 60, {}),
        # check_weight_update_equal's cost: checksums one tensor at a time, in packs and per bucket (issue 32)
        "checksums": ([PY, "bench/bench_checksums.py", "--presets", "q05", "q05_narrow", "q15"], 90, {}),
        # one actor step in process at q05 (issue 24): DeepSpeed ZeRO-1 next to ZeRO-0's flat AdamW, plain torch
        # (TRL's recipe) and the model's bare forward+backward, with host ops and kernel launches per step
        "train_step": (
            [
                PY,
                "bench/bench_train_step.py",
                "--presets",
                "q05",
                "--lengths",
                "1",
                "128",
                "--steps",
                "3",
                "--variants",
                "ds_z1_bf16",
                "ds_z0_bf16",
                "ds_z0_bf16pure_nocheck",
                "torch_bf16",
                "hf_fwd_bwd",
                "--out",
                str(out / "train_step"),
            ],
            240,
            {},
        ),
        "engine": ([*engine, "--decode", "dynamic", "graph"], 55, {}),
        # the sampling step at 151,936 tokens: whole-vocabulary sort (before issue 31) vs top-k prefilter (now)
        "sampling": ([PY, "bench/bench_sampling.py", "--batch", "64", "256"], 90, {}),
        "engine_compile": ([*engine, "--decode", "compile"], 95, {}),  # its first call compiles (inductor)
        "tests": ([*pytest, "--noconftest", "-o", "timeout=80", *tests], 150, {}),
        # Offload/Onload of a DeepSpeed bf16 trainer: DeepSpeed as is next to start-up objects frozen
        "offload": (
            [
                PY,
                "bench/bench_trainer.py",
                "--offload",
                "--presets",
                "small",
                "--zero",
                "1",
                "--precision",
                "bf16",
                "--device",
                "cuda",
            ],
            120,
            {},
        ),
        # the trainer's own tests on the GPU (DeepSpeed bf16/fp32, offload freeing memory, scoring under the
        # sampling distribution, keep_old_actor); needs redis-server
        "trainer_tests": (
            [
                *pytest,
                "-o",
                "timeout=100",
                "tests/test_trainer_service.py",
                "tests/test_trainer_rl.py",
                "tests/test_flat_adamw.py",
            ],
            200,
            {"TANDEM_TEST_TRAINER_DEVICE": "cuda"},
        ),
        # full `tandem run`s sharing the GPU through cuda_ipc (needs deepspeed, redis, opentelemetry)
        "run": ([PY, "bench/gpu_run.py", "--steps", "40", "--out", str(out / "run")], 450, {}),
        # real-size runs (issue 24): q05 async and sync_offload, q15 async; 128-token prompts, 256-token responses
        "real_size": (
            [
                "bash",
                "-c",
                f"{PY} bench/gpu_run.py --config examples/qwen05_gpu.yaml --steps 12 "
                f"--only async sync_offload --out {out / 'real_size_q05'} && {PY} bench/gpu_run.py "
                f"--config examples/qwen15_gpu.yaml --steps 10 --only async --out {out / 'real_size_q15'}",
            ],
            540,
            {},
        ),
        # the same in runs (issue 32): every sync verified by bucket next to none, q05 and q15; the table's row
        # "median checksums / weight sync" is the goal's figure (<= 5%). A call of its own.
        "checksums_run": (
            [
                "bash",
                "-c",
                f"{PY} bench/gpu_run.py --config examples/qwen05_gpu.yaml --steps 12 "
                f"--only async_verified async_unverified --out {out / 'checksums_q05'} && {PY} "
                f"bench/gpu_run.py --config examples/qwen15_gpu.yaml --steps 10 --only async_verified "
                f"--out {out / 'checksums_q15'}",
            ],
            540,
            {},
        ),
        # issue 31, the real vocabulary (151,936, tied embeddings; bench/real_shapes.py), 64 x 8 samples: the
        # chunked scoring head against the old path (full logits, whole-vocabulary tables), and TRL's precision.
        # Goals: peak memory <= 0.5x TRL's, MFU >= 40% at 1.5B L = 1,024 (the old path may run out of memory).
        "vocab_q05": (
            [
                PY,
                "bench/bench_train_step.py",
                "--presets",
                "qwen2.5-0.5b",
                "--lengths",
                "256",
                "1024",
                "--samples",
                "512",
                "--steps",
                "1",
                "--variants",
                "ds_z0_bf16",
                "ds_z0_bf16_old",
                "ds_z0_bf16pure",
                "--out",
                str(out / "vocab_q05"),
            ],
            540,
            {},
        ),
        "vocab_q15": (
            [
                PY,
                "bench/bench_train_step.py",
                "--presets",
                "qwen2.5-1.5b",
                "--lengths",
                "1024",
                "256",
                "--samples",
                "512",
                "--steps",
                "1",
                "--variants",
                "ds_z0_bf16",
                "ds_z0_bf16pure",
                "ds_z0_bf16_ac",
                "ds_z0_bf16_old",
                "--out",
                str(out / "vocab_q15"),
            ],
            560,
            {},
        ),
        # prime-rl's published trainer figure (benchmarks/results/BENCHMARKS.md): Qwen3-0.6B, one 16,384-token
        # sequence, one H100: 11.9k tokens/s, 11.1% MFU, 12.5 GiB peak. Goal: >= 2x the tokens/s within that peak
        "prime_rl_shape": (
            list(gpu_plan.prime_rl_command(out, "ds_z0_bf16pure_ac", "ds_z0_bf16_ac", "ds_z0_bf16pure")),
            300,
            {},
        ),
        # packed rows and activation checkpointing at mixed response lengths (uniform in [128, 1,024]): their cost
        # and saving on the GPU (sdpa masks per sample in packed rows), next to the padded plan
        "pack_ac": (
            [
                PY,
                "bench/bench_train_step.py",
                "--presets",
                "qwen2.5-0.5b",
                "--lengths",
                "1024",
                "--samples",
                "512",
                "--steps",
                "1",
                "--mixed-lengths",
                "--variants",
                "ds_z0_bf16",
                "ds_z0_bf16_packed",
                "ds_z0_bf16_ac",
                "--out",
                str(out / "pack_ac"),
            ],
            400,
            {},
        ),
        # bench/peer_trl.py's real-vocabulary case: Qwen2.5-0.5B's shape with init-model's BPE tokenizer (its preset
        # comes with issue 30), L = 256; goal >= 3x TRL end to end. Needs .whl_trl; a call of its own
        "peer_trl_vocab": (
            [PY, "bench/peer_trl.py", "--cases", "qwen2.5-0.5b_L256", "--out", str(out / "peer_trl_vocab")],
            560,
            {},
        ),
        # Tandem async/sync vs TRL's GRPOTrainer (needs .whl_trl carried; TRL is skipped in one line without it).
        # It keeps to its own --budget-s (520 s), so it only runs when named: a call of its own.
        "peer_trl": ([PY, "bench/peer_trl.py", "--out", str(out / "peer_trl")], 560, {}),
        # SGLang 0.5.17 (needs .sglang carried; each skips without it), against the servers launched for them:
        # the contract facts checked on the real server, SGLang vs native tok/s and sync ms per transport, and
        # two `tandem run`s (sync at T=0.7 / top-p 0.9 with its log-prob checks, and sync_offload)
        "sglang_smoke": ([PY, "bench/sglang_smoke.py"], 100, {}),
        "sglang_bench": ([PY, "bench/bench_sglang.py"], 200, {}),
        "sglang_run": ([PY, "bench/sglang_run.py", "--steps", "10", "--out", str(out / "sglang_run")], 240, {}),
        # issue 33: long-tailed lengths (16..2048) at the q05 shape, sync / one step off / in flight side by side
        # (bench/gpu_inflight.py); three runs' worth of stages, each within one call, then the table of all found
        **{
            f"inflight_{part}": (
                [
                    PY,
                    "bench/gpu_inflight.py",
                    "--steps",
                    "4" if quick else "8",
                    "--out",
                    str(out / "inflight"),
                    "--only",
                    *variants,
                ],
                560,
                {},
            )
            for part, variants in INFLIGHT_PARTS.items()
        },
        "inflight_report": ([PY, "bench/gpu_inflight.py", "--report", "--out", str(out / "inflight")], 30, {}),
    }


INFLIGHT_PARTS = {"a": ["sync", "one_step_off"], "b": ["inflight_keep"], "c": ["stream_keep", "stream_recompute"]}


# left out unless --only names them
OPT_IN = {
    "train_step",
    "real_size",
    "checksums_run",
    "peer_trl",
    "sglang_smoke",
    "sglang_bench",
    "sglang_run",
    "inflight_a",
    "inflight_b",
    "inflight_c",
    "inflight_report",
    "vocab_q05",
    "vocab_q15",
    "prime_rl_shape",
    "pack_ac",
    "peer_trl_vocab",
    "sampling",
}
SGLANG_STAGES = ("sglang_smoke", "sglang_bench", "sglang_run")
SGLANG_START_S = 240  # launching both servers, until healthy (kernel JIT and CUDA-graph capture included)


def run_stage(name: str, cmd: list[str], limit_s: int, out: Path, extra_env: dict[str, str]) -> dict:
    started = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra_env}
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    text = (out / f"{name}.log").read_text(errors="replace")
    print(f"[{name}] rc={rc} in {time.monotonic() - started:.0f}s", flush=True)
    return {"name": name, "cmd": cmd, "rc": rc, "seconds": time.monotonic() - started, "text": text}


def summary_lines(stage: dict) -> list[str]:
    """pytest: its result lines; benches: the table and the lines describing it."""
    lines = stage["text"].splitlines()
    if stage["name"] in SGLANG_STAGES:  # several tables and the PASS/FAIL lines: all of it but the progress lines
        keep = [ln for ln in lines if ln.startswith(("|", "PASS", "FAIL", "skipped", "SGLang", "sync_", "\nSGLang"))]
        return keep[-80:] or ["```", *lines[-30:], "```"]
    if stage["name"].endswith("tests"):
        keep = [
            ln
            for ln in lines
            if ln.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL"))
            or any(w in ln for w in (" passed", " failed", " skipped", " error"))
            or ln.startswith("E ")
        ]
        return ["```", *keep[-40:], "```"]
    first = next((i for i, ln in enumerate(lines) if ln.startswith("|")), None)
    if first is None:
        return ["```", *lines[-30:], "```"]
    head = [ln for ln in lines[max(0, first - 4) : first] if ln.strip()]
    table = [ln for ln in lines[first:] if ln.startswith("|")]
    return [*head, "", *table]


def write_summary(results: list[dict], out: Path) -> str:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    md = [
        f"# GPU suite — {datetime.date.today().isoformat()}",
        "",
        f"Device: {device}; torch {torch.__version__}; Python {sys.version.split()[0]}",
        "",
    ]
    for stage in results:
        status = "ok" if stage["rc"] == 0 else ("timed out" if stage["rc"] == 124 else f"exit {stage['rc']}")
        md += [
            f"## {stage['name']} — {status}, {stage['seconds']:.0f} s",
            "",
            "`" + " ".join(Path(c).name if c == PY else c for c in stage["cmd"]) + "`",
            "",
            *summary_lines(stage),
            "",
        ]
    text = "\n".join(md)
    (out / "gpu_suite.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "gpu_suite_out"))
    parser.add_argument("--only", nargs="+", default=None, choices=list(stages(quick=False, out=Path("."))))
    parser.add_argument("--quick", action="store_true", help="fewer repeats in the engine bench")
    parser.add_argument("--plan", action="store_true", help="issue 39's pending stages that fit (bench/gpu_plan.py)")
    parser.add_argument("--dry-run", action="store_true", help="with --plan: print it, check its commands")
    parser.add_argument("--budget-s", type=float, default=560.0, help="with --plan: seconds this call may take")
    parser.add_argument("--stages", nargs="+", default=None, help="with --plan: only these stages")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tandem-gpu-plan"), help="with --plan: bench files")
    parser.add_argument("--absorb", type=Path, default=None, metavar="DIR", help="a plan call's files, here")
    args = parser.parse_args(argv)
    if args.absorb is not None or args.plan:
        return plan_main(args)
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = args.only if args.only is not None else [n for n in stages(args.quick, args.out) if n not in OPT_IN]
    every = stages(args.quick, args.out)
    plan = [(name, *every[name]) for name in chosen]  # in the order given: the most wanted first, in case of a cut
    results: list[dict] = []
    with contextlib.ExitStack() as servers:
        for name, cmd, limit, env in plan:
            if name in SGLANG_STAGES and "SGLANG_SERVERS" not in os.environ:
                os.environ["SGLANG_SERVERS"] = str(start_sglang(servers, args.out, results))
            results.append(run_stage(name, cmd, limit, args.out, env))
            write_summary(results, args.out)  # after every stage: a call cut short still leaves its summary
    print(write_summary(results, args.out))
    return 0 if all(r["rc"] == 0 for r in results) else 1


def plan_main(args: argparse.Namespace) -> int:

    if args.absorb is not None:
        return gpu_plan.absorb(args.absorb)
    if args.dry_run:
        return gpu_plan.dry_run(args.work)
    unknown = sorted(set(args.stages or ()) - {s.name for s in gpu_plan.stages(args.work)})
    if unknown:
        print(f"--stages: no such stage: {', '.join(unknown)} (see --plan --dry-run)", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as servers:
        results: list[dict] = []

        def start_servers() -> None:
            os.environ["SGLANG_SERVERS"] = str(start_sglang(servers, args.work, results))

        return gpu_plan.run_plan(
            out=args.out,
            work=args.work,
            budget_s=args.budget_s,
            only=args.stages,
            summarize=summary_lines,
            start_servers=start_servers,
        )


def start_sglang(stack: contextlib.ExitStack, out: Path, results: list[dict]) -> Path:
    """Launches the SGLang stages' servers (stopped when `stack` closes); their start-up is a summary entry. Without
    the sglang package nothing starts and the stages skip (the file does not exist)."""
    import importlib.util

    started = time.monotonic()
    if importlib.util.find_spec("sglang") is None:
        results.append(
            {
                "name": "sglang_servers",
                "cmd": ["(none)"],
                "rc": 0,
                "seconds": 0.0,
                "text": "skipped: the sglang package is not importable (source bench/gpu_env.sh sglang)",
            }
        )
        return out / "no_sglang_servers.json"
    sys.path.insert(0, str(ROOT / "bench"))
    from sglang_servers import servers

    path = stack.enter_context(servers(Path("/tmp/tandem-sglang"), out, timeout_s=SGLANG_START_S))
    text = path.read_text()
    healthy = all(s["startup_s"] is not None for s in json.loads(text).values())
    results.append(
        {
            "name": "sglang_servers",
            "cmd": ["bench/sglang_servers.py"],
            "rc": 0 if healthy else 1,
            "seconds": time.monotonic() - started,
            "text": text,
        }
    )
    print(
        f"[sglang_servers] {'healthy' if healthy else 'NOT healthy'} in {time.monotonic() - started:.0f}s", flush=True
    )
    return path


if __name__ == "__main__":
    raise SystemExit(main())

"""Every GPU check in one call: the GPU tests, the same-GPU weight hand-off bench and the native engine bench.

    python bench/gpu_suite.py [--out DIR] [--quick]
        [--only handoff ipc_copy engine engine_compile tests offload trainer_tests run]
    python bench/gpu_suite.py --only peer_trl        # Tandem vs TRL (bench/peer_trl.py), a call of its own

On the device machine every command starts with `source bench/gpu_env.sh` (add `sglang` for SGLang stages), which
installs the wheels the call carries: `.whl` for these stages, `.whl .whl_trl` for peer_trl (bench/gpu_kit.sh).

Each stage runs as its own process with its own time limit, so one hang cannot take the others down; its
full output goes to DIR/<stage>.log and a markdown summary (command, exit code, seconds, the stage's tables
or pytest's summary) to DIR/gpu_suite.md, which is also printed last. DIR defaults to $OUT when set (the
device tool's output folder), else bench/gpu_suite_out. Exit code 0 only when every stage passed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

GPU_TESTS = ["tests/test_rollout_gpu.py", "tests/test_weights_cuda.py"]


def stages(quick: bool, out: Path) -> dict[str, tuple[list[str], int, dict[str, str]]]:
    """name -> (command, time limit in seconds, extra environment)."""
    tests = sorted({*GPU_TESTS, *(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/test_*_gpu*.py"))})
    engine = [PY, "bench/bench_native_engine.py", "--preset", "qwen2-0.5b", "--device", "cuda", "--dtype",
              "bfloat16", "--batch", "256", "--prompt-len", "64", "--new-tokens", "128",
              "--repeats", "1" if quick else "2", "--warmup", "0" if quick else "1"]
    pytest = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    return {   # benches first: the limits of the later stages absorb a slow start
        "handoff": ([PY, "bench/bench_weights.py", "--handoff", "--repeats", "10", "--bucket-mb", "64"], 100, {}),
        # the copy itself: from another process's IPC allocation next to a same-process D2D, by copy method
        "ipc_copy": ([PY, "bench/bench_ipc_copy.py", "--repeats", "20"], 60, {}),
        "engine": ([*engine, "--decode", "dynamic", "graph"], 55, {}),
        "engine_compile": ([*engine, "--decode", "compile"], 95, {}),   # its first call compiles (inductor)
        "tests": ([*pytest, "--noconftest", "-o", "timeout=80", *tests], 150, {}),
        # Offload/Onload of a DeepSpeed bf16 trainer: DeepSpeed as is next to start-up objects frozen
        "offload": ([PY, "bench/bench_trainer.py", "--offload", "--presets", "small", "--zero", "1",
                     "--precision", "bf16", "--device", "cuda"], 120, {}),
        # the trainer's own tests on the GPU (DeepSpeed bf16/fp32, offload freeing memory, scoring under the
        # sampling distribution, keep_old_actor); needs redis-server
        "trainer_tests": ([*pytest, "-o", "timeout=100", "tests/test_trainer_service.py", "tests/test_trainer_rl.py"],
                          200, {"TANDEM_TEST_TRAINER_DEVICE": "cuda"}),
        # full `tandem run`s sharing the GPU through cuda_ipc (needs deepspeed, redis, opentelemetry)
        "run": ([PY, "bench/gpu_run.py", "--steps", "40", "--out", str(out / "run")], 450, {}),
        # Tandem async/sync vs TRL's GRPOTrainer (needs .whl_trl carried; TRL is skipped in one line without it).
        # It keeps to its own --budget-s (520 s), so it only runs when named: a call of its own.
        "peer_trl": ([PY, "bench/peer_trl.py", "--out", str(out / "peer_trl")], 560, {}),
    }


OPT_IN = {"peer_trl"}   # stages left out unless --only names them (each needs most of a 10-minute call)


def run_stage(name: str, cmd: list[str], limit_s: int, out: Path, extra_env: dict[str, str]) -> dict:
    started = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra_env}
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    text = (out / f"{name}.log").read_text(errors="replace")
    print(f"[{name}] rc={rc} in {time.monotonic() - started:.0f}s", flush=True)
    return {"name": name, "cmd": cmd, "rc": rc, "seconds": time.monotonic() - started, "text": text}


def summary_lines(stage: dict) -> list[str]:
    """pytest: its result lines; benches: the table and the lines describing it."""
    lines = stage["text"].splitlines()
    if stage["name"].endswith("tests"):
        keep = [ln for ln in lines if ln.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL"))
                or any(w in ln for w in (" passed", " failed", " skipped", " error")) or ln.startswith("E ")]
        return ["```", *keep[-40:], "```"]
    first = next((i for i, ln in enumerate(lines) if ln.startswith("|")), None)
    if first is None:
        return ["```", *lines[-30:], "```"]
    head = [ln for ln in lines[max(0, first - 4):first] if ln.strip()]
    table = [ln for ln in lines[first:] if ln.startswith("|")]
    return [*head, "", *table]


def write_summary(results: list[dict], out: Path) -> str:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    md = [f"# GPU suite — {datetime.date.today().isoformat()}", "",
          f"Device: {device}; torch {torch.__version__}; Python {sys.version.split()[0]}", ""]
    for stage in results:
        status = "ok" if stage["rc"] == 0 else ("timed out" if stage["rc"] == 124 else f"exit {stage['rc']}")
        md += [f"## {stage['name']} — {status}, {stage['seconds']:.0f} s", "",
               "`" + " ".join(Path(c).name if c == PY else c for c in stage["cmd"]) + "`", "",
               *summary_lines(stage), ""]
    text = "\n".join(md)
    (out / "gpu_suite.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "gpu_suite_out"))
    parser.add_argument("--only", nargs="+", default=None,
                        choices=list(stages(quick=False, out=Path("."))))
    parser.add_argument("--quick", action="store_true", help="fewer repeats in the engine bench")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = args.only if args.only is not None else [n for n in stages(args.quick, args.out) if n not in OPT_IN]
    results = [run_stage(name, cmd, limit, args.out, env) for name, (cmd, limit, env) in
               stages(args.quick, args.out).items() if name in chosen]
    print(write_summary(results, args.out))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

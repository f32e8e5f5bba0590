"""Issue 39's GPU goals as a plan: the pending stages in priority order, as many as fit one device call.

    python bench/gpu_suite.py --plan [--budget-s 560] [--stages NAME ...]   # on the device machine
    python bench/gpu_suite.py --plan --dry-run                                # here: the plan, its arguments checked
    python bench/gpu_suite.py --absorb DIR                                    # here: DIR = the call's returned files

A stage starts only if its time limit fits what is left of --budget-s (counted from the suite's start: pass
`--budget-s $((590 - SECONDS))` after `source bench/gpu_env.sh` so its set-up counts too); a stage whose limit does
not fit is passed over for a later, smaller one. A stage whose packages are missing (TRL: carry .whl_trl; SGLang:
`source bench/gpu_env.sh sglang`, carry .sglang and .whl/core/grpcio-*.whl: gpu_kit.sh prints the paths) is passed
over too. Finished stages are skipped: the committed bench/gpu_plan.json records each stage's last result ({date,
card, status, attempts, seconds}), and a stage that failed MAX_ATTEMPTS times is left for a person to look at.

Each finished stage is written to $OUT at once (the device tool brings back at most 8 files), in three files:
plan_results.json (stage -> record: status, seconds, card, its summary in markdown, small result files it keeps),
plan_report.md (the summaries, appended) and plan_logs.txt (each stage's last log lines). The benches write
everything else under --work (not $OUT). `--absorb DIR` reads DIR/plan_results.json, updates bench/gpu_plan.json,
writes the kept files under bench/gpu_results/<group>/ and appends one dated section to bench/RESULTS.md.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
PLAN_FILE = ROOT / "bench" / "gpu_plan.json"
KEPT_DIR = ROOT / "bench" / "gpu_results"
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
RESULTS, REPORT, LOGS = "plan_results.json", "plan_report.md", "plan_logs.txt"
MAX_ATTEMPTS = 2
LOG_TAIL_LINES = 40
KEEP_LIMIT_BYTES = 256 * 1024  # a kept file larger than this is left out (the summary has its table)


@dataclass(frozen=True)
class Stage:
    """One plan stage: its commands run in order (each must pass; with `fallback`, each runs only if the one before
    failed), under one time limit for all of them."""

    name: str
    goal: str  # what it measures: the goal of issue 39 item 3 it answers
    commands: tuple[tuple[str, ...], ...]
    limit_s: int
    needs: tuple[str, ...] = ()  # importable packages it needs
    fallback: bool = False
    sglang_servers: bool = False  # the SGLang servers of gpu_suite.start_sglang must be up
    keep: tuple[str, ...] = ()  # globs under its work dir: small result files to bring back
    group: str = ""  # kept files of a group share one folder (gpu_inflight --report reads them together)


def _bench(script: str, *args: str) -> tuple[str, ...]:
    return (PY, f"bench/{script}", *args)


def _train_step(work: Path, preset: str, variants: list[str], *extra: str) -> tuple[str, ...]:
    return _bench(
        "bench_train_step.py",
        "--presets",
        preset,
        "--samples",
        "512",
        "--lengths",
        "1024",
        "--warmups",
        "1",
        *extra,
        "--variants",
        *variants,
        "--out",
        str(work / "train_step"),
    )


def _peer_trl(work: Path, length: int, budget_s: int, *extra: str) -> tuple[str, ...]:
    return _bench(
        "peer_trl.py",
        *extra,
        "--cases",
        f"qwen2.5-0.5b_L{length}",
        "--budget-s",
        str(budget_s),
        "--trl-limit-s",
        "220",
        "--tandem-limit-s",
        "200",
        "--out",
        str(work / f"peer_trl_L{length}"),
        "--work",
        str(work / "peer_trl_runs"),
    )


def native_engine_command(new_tokens: int, *extra: str) -> tuple[str, ...]:
    """The native engine against HF generate at Qwen2-0.5B's shape (its real vocabulary), batch 256, 64-token
    prompts, bf16 on the GPU."""
    return _bench(
        "bench_native_engine.py",
        "--preset",
        "qwen2-0.5b",
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--batch",
        "256",
        "--prompt-len",
        "64",
        "--new-tokens",
        str(new_tokens),
        *extra,
    )


def _sglang_vs_native(work: Path, out: str, *extra: str) -> tuple[str, ...]:
    """bench_sglang at the goal's shape (batch 256, 1,024 new tokens), one sync per transport, no NCCL attempt."""
    return _bench(
        "bench_sglang.py",
        "--batch",
        "256",
        "--prompt-len",
        "64",
        "--new-tokens",
        "1024",
        "--repeats",
        "2",
        *extra,
        "--sync-repeats",
        "1",
        "--no-nccl",
        "--out",
        str(work / out),
    )


def prime_rl_command(work: Path, *variants: str) -> tuple[str, ...]:
    """prime-rl's published trainer shape: Qwen3-0.6B, one 16,384-token sequence (11.9k tokens/s, 12.5 GiB peak)."""
    return _bench(
        "bench_train_step.py",
        "--presets",
        "qwen3-0.6b",
        "--lengths",
        "16384",
        "--samples",
        "1",
        "--steps",
        "3",
        "--warmups",
        "1",
        "--variants",
        *variants,
        "--out",
        str(work / "prime_rl_shape"),
    )


def _inflight(work: Path, *variants: str, out: str = "inflight") -> tuple[str, ...]:
    """gpu_inflight's runs of `variants`, 6 steps each, their summaries in work/out."""
    return _bench("gpu_inflight.py", "--steps", "6", "--only", *variants, "--out", str(work / out))


def stages(work: Path) -> list[Stage]:
    """Issue 39 item 3's goals, the most important first. Stages done on 2026-12-06 (bench/gpu_plan.json) stay listed:
    a finished stage is skipped, and its name keeps its record. train_q05_64k (65,536-token micro-batches) ran out of
    memory on 80 GB beside the 1/32 table and left the plan; train_q05_32k measures the larger micro-batch."""
    q05_goal = "Qwen2.5-0.5B shape, 512 x 1,024: MFU >= 35%, peak memory <= 0.5x TRL's"
    inflight_goal = "in-flight updates on the long-tailed batch: >= 1.5x one_step_off's tokens/s"
    inflight_keep = ("inflight/inflight_*.json",)
    cap = "the head's 1 GiB table cap (2026-12-06) against the 1/32-of-the-GPU table it replaced, one process each"
    return [
        # 2026-12-06, fourth session: decode steps attend over views of the cache (the slots written so far, ~1/8 at
        # a time, a graph each) and keep the scores in bf16 (softmax accumulates in fp32). The views' graphs on the
        # card first, then the three figures they move: the decode step's profile, in-flight streaming, vs SGLang
        Stage(
            "window_gpu_tests",
            "the native engine on the GPU with windowed decode views: log-probs match the teacher-forced forward",
            ((PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_rollout_gpu.py"),),
            150,
        ),
        Stage(
            "native_decode_window",
            "the native engine against SGLang at Qwen2.5-0.5B's shape, batch 256, L=1,024: >= 0.8x (graph decode over "
            "windows of the cache, bf16 scores: tokens/s and the decode step's profile; SGLang read 68,124 tokens/s "
            "in sglang_vs_native_compile)",
            (
                native_engine_command(
                    1024,
                    "--repeats",
                    "2",
                    "--warmup",
                    "1",
                    "--decode",
                    "graph",
                    "--profile",
                    "--out",
                    str(work / "native_window"),
                ),
            ),
            180,
            keep=("native_window/profile_native_graph_b256_L1152.txt",),
        ),
        Stage(
            "inflight_stream_window",
            inflight_goal + " (continuous batching's steps over windows of the cache, beside one_step_off)",
            (_inflight(work, "one_step_off", "stream_keep", out="inflight_window"),),
            300,
            keep=("inflight_window/inflight_*.json",),
        ),
        Stage(
            "sglang_vs_native_window",
            "the native engine against SGLang at Qwen2.5-0.5B's shape, batch 256, L=1,024: >= 0.8x (graph decode over "
            "windows of the cache, bf16 scores)",
            (_sglang_vs_native(work, "sglang_window", "--native-decode", "graph"),),
            360,
            needs=("sglang",),
            sglang_servers=True,
        ),
        # the head's numerics on the card first (eager, compiled, whole rows, vs the old path): the figures rest on them
        Stage(
            "head_gpu_tests",
            "the chunked head on the GPU: compiled = eager = old path, auto whole rows included; peak flat in tokens",
            ((PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_head_scoring_gpu.py"),),
            150,
        ),
        Stage("train_q05", q05_goal, (_train_step(work, "qwen2.5-0.5b", ["ds_z0_bf16"], "--steps", "2"),), 150),
        Stage(
            "peer_trl_vocab_L128",
            "Tandem vs TRL at 151,936 tokens, L=128: >= 3x TRL's tokens/s, train phase <= 0.7x TRL's, TRL's peak",
            (_peer_trl(work, 128, 300),),
            320,
            needs=("trl",),
        ),
        # the memory goals after the cap: prime-rl's shape peaked at 13.2 GiB (its limit 12.5) and the q05 low-memory
        # step at 12.75 GiB (TRL: 16.0) with the 1/32 table; the last command is the smallest q05 peak (TRL's 8k-token
        # micro-batches, 512 MiB tables). Then the q05 step's time and peak with both tables side by side
        Stage(
            "head_cap_memory",
            "prime-rl's shape within 12.5 GiB; q05 512 x 1,024 peak <= 0.5x TRL's 16.0 GiB (" + cap + ")",
            (
                prime_rl_command(work, "ds_z0_bf16pure_ac"),
                _train_step(work, "qwen2.5-0.5b", ["ds_z0_bf16pure_ac"], "--steps", "1", "--no-count-ops"),
                _train_step(work, "qwen2.5-0.5b", ["ds_z0_bf16pure_ac_8k_cap512m"], "--steps", "1", "--no-count-ops"),
            ),
            260,
        ),
        Stage(
            "head_cap_q05",
            q05_goal + " (" + cap + ")",
            (
                _train_step(work, "qwen2.5-0.5b", ["ds_z0_bf16"], "--steps", "1"),
                _train_step(work, "qwen2.5-0.5b", ["ds_z0_bf16_share32"], "--steps", "1", "--no-count-ops"),
            ),
            240,
        ),
        # the checksums' 9.0 ms in a q05 run (26.5% of the sync): the kernels' device time against the call's wall
        # time at the real shapes (290 and 338 tensors), so the fix goes where the time is (launches or the kernel)
        Stage(
            "checksums_profile",
            "check_weight_update_equal <= 5% of a sync: where its milliseconds go (kernel vs host), q05 and q15",
            (
                _bench(
                    "bench_checksums.py",
                    "--presets",
                    "qwen2.5-0.5b",
                    "qwen2.5-1.5b",
                    "--repeats",
                    "5",
                    "--sync-ms",
                    "25",
                    "--profile",
                ),
            ),
            120,
        ),
        # examples/qwen15_gpu.yaml ran out of memory at 32k-token micro-batches beside its engine (56 + 22.7 GB);
        # with activation checkpointing now: its real-size figures and the checksums' share at q15 in one run
        Stage(
            "checksums_q15",
            "check_weight_update_equal in a q15 run: <= 5% of the sync's time; examples/qwen15_gpu.yaml's real-size "
            "step time, tokens/s, peak memory",
            (
                _bench(
                    "gpu_run.py",
                    "--config",
                    "examples/qwen15_gpu.yaml",
                    "--steps",
                    "10",
                    "--only",
                    "async_verified",
                    "--out",
                    str(work / "checksums_q15"),
                    "--work",
                    str(work / "runs"),
                ),
            ),
            300,
        ),
        # the profile that explains the q05 MFU (issue 39 asks for it with every miss): top ops by device and host time
        # of one step with the capped head, brought back whole
        Stage(
            "profile_q05",
            q05_goal + " (the step's torch.profiler tables)",
            (_train_step(work, "qwen2.5-0.5b", ["ds_z0_bf16"], "--steps", "1", "--no-count-ops", "--profile"),),
            150,
            keep=("train_step/profile_ds_z0_bf16_qwen2.5-0.5b_L1024.txt",),
        ),
        Stage(
            "train_q05_32k",
            q05_goal + " (32,768-token micro-batches: half the per-layer launches)",
            (_train_step(work, "qwen2.5-0.5b", ["ds_z0_bf16_32k"], "--steps", "1", "--no-count-ops"),),
            150,
        ),
        # stream_keep ran at 0.42x one_step_off on continuous batching's dynamic path (2026-12-06); continuous
        # batching now replays the static path's CUDA graph: both modes again in one call, side by side
        Stage(
            "inflight_stream_graph",
            inflight_goal + " (continuous batching on the CUDA-graph decode step, beside one_step_off)",
            (_inflight(work, "one_step_off", "stream_keep", out="inflight_graph"),),
            420,
            keep=("inflight_graph/inflight_*.json",),
        ),
        # L=128 at 2.67x TRL (goal 3x): its generation was 0.80 s of a 1.69 s step, and decode "compile" ran 1.88x
        # the graph's tokens/s at 128 new tokens; the same comparison with rollout.decode=compile (not the default)
        Stage(
            "peer_trl_L128_compile",
            "Tandem vs TRL at 151,936 tokens, L=128: >= 3x TRL's tokens/s (rollout.decode=compile)",
            (_peer_trl(work, 128, 300, "--tandem-set", "rollout.decode=compile"),),
            320,
            needs=("trl",),
        ),
        # the native engine at 0.58x SGLang (2026-12-06), not profiled: its decode step alone (graph and compile)
        # against generate's time per token step, and the kernels of three replays; no SGLang needed
        Stage(
            "native_decode_profile",
            "the native engine against SGLang at Qwen2.5-0.5B's shape, batch 256, L=1,024: >= 0.8x (where the native "
            "decode step's time goes)",
            (
                native_engine_command(
                    1024,
                    "--repeats",
                    "1",
                    "--warmup",
                    "0",
                    "--decode",
                    "graph",
                    "compile",
                    "--profile",
                    "--out",
                    str(work / "native_engine"),
                ),
            ),
            240,
            keep=(
                "native_engine/profile_native_graph_b256_L1152.txt",
                "native_engine/profile_native_compile_b256_L1152.txt",
            ),
        ),
        # q05's peak: 8.28 GiB at 6.77 s (1 GiB head tables), 7.10 GiB at 16.2 s (8k micro-batches and 512 MiB
        # tables); the 512 MiB tables alone, at 16k micro-batches: under TRL's half (8.01) near the fast step?
        Stage(
            "q05_lowmem_cap512m",
            q05_goal + " (bf16 weights and Adam, checkpointing, 512 MiB head tables, 16k micro-batches)",
            (_train_step(work, "qwen2.5-0.5b", ["ds_z0_bf16pure_ac_cap512m"], "--steps", "2", "--no-count-ops"),),
            150,
        ),
        Stage(
            "peer_trl_vocab_L512",
            "Tandem vs TRL at 151,936 tokens, L=512: >= 3x TRL's tokens/s, train phase <= 0.7x TRL's, TRL's peak",
            (_peer_trl(work, 512, 470),),
            490,
            needs=("trl",),
        ),
        *(
            Stage(f"inflight_{v}", inflight_goal, (_inflight(work, v),), 300, keep=inflight_keep, group="inflight")
            for v in ("one_step_off", "inflight_keep", "stream_keep", "sync")
        ),
        Stage(
            "sglang_vs_native",
            "the native engine against SGLang at Qwen2.5-0.5B's shape, batch 256, L=1,024: >= 0.8x",
            (_sglang_vs_native(work, "sglang"),),
            360,
            needs=("sglang",),
            sglang_servers=True,
        ),
        # sglang_vs_native (2026-12-06) put decode "graph" at 0.58x SGLang; "compile" (fused kernels in the captured
        # step) was 1.88x graph at 128 new tokens: both beside SGLang in one process
        Stage(
            "sglang_vs_native_compile",
            "the native engine against SGLang at Qwen2.5-0.5B's shape, batch 256, L=1,024: >= 0.8x (decode graph "
            "and compile)",
            (_sglang_vs_native(work, "sglang_compile", "--native-decode", "graph", "compile"),),
            360,
            needs=("sglang",),
            sglang_servers=True,
        ),
        # done 2026-12-06 (their records stay): the q15 step, TRL's peak at 512 x 1,024, the 1/32 table's low-memory
        # and prime-rl rows, checksums and the example's real-size figures at q05 (async_unverified is the example)
        Stage(
            "train_q15",
            "Qwen2.5-1.5B shape, 512 x 1,024: MFU >= 40%",
            (
                _train_step(work, "qwen2.5-1.5b", ["ds_z0_bf16"], "--steps", "1", "--no-count-ops"),
                _train_step(work, "qwen2.5-1.5b", ["ds_z0_bf16_ac"], "--steps", "1", "--no-count-ops"),
            ),
            240,
            fallback=True,  # checkpointing only if the plain step does not fit the card
        ),
        Stage(
            "trl_peak_L1024",
            q05_goal + " (TRL's peak at the same batch)",
            (_peer_trl(work, 1024, 300, "--modes", "--steps", "3"),),
            320,
            needs=("trl",),
        ),
        Stage(
            "train_q05_lowmem",
            q05_goal + " (bf16 weights and optimizer, activation checkpointing: the smallest peak)",
            (_train_step(work, "qwen2.5-0.5b", ["ds_z0_bf16pure_ac"], "--steps", "1", "--no-count-ops"),),
            200,
        ),
        Stage(
            "prime_rl_shape",
            "prime-rl's shape (Qwen3-0.6B, one 16,384-token sequence): >= 2x its 11.9k tokens/s within 12.5 GiB",
            (prime_rl_command(work, "ds_z0_bf16pure_ac", "ds_z0_bf16pure"),),
            200,
        ),
        Stage(
            "checksums_q05",
            "check_weight_update_equal in a q05 run: <= 5% of the sync's time; examples/qwen05_gpu.yaml's real-size "
            "figures (async_unverified is the example as shipped)",
            (
                _bench(
                    "gpu_run.py",
                    "--config",
                    "examples/qwen05_gpu.yaml",
                    "--steps",
                    "12",
                    "--only",
                    "async_verified",
                    "async_unverified",
                    "--out",
                    str(work / "checksums_q05"),
                    "--work",
                    str(work / "runs"),
                ),
            ),
            360,
        ),
    ]


# ---- state --------------------------------------------------------------------------------------


def load_state(path: Path | None = None) -> dict[str, dict]:
    path = path or PLAN_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def pending_reason(stage: Stage, record: dict | None) -> str | None:
    """Why the stage is not run again (None: it is pending)."""
    if record is None:
        return None
    if record["status"] == "ok":
        return f"done {record['date']} on {record['card']}"
    if record.get("attempts", 0) >= MAX_ATTEMPTS:
        return f"{record['status']} {record['attempts']} times (last {record['date']}): for a person to look at"
    return None


def missing_packages(stage: Stage) -> list[str]:
    return [name for name in stage.needs if importlib.util.find_spec(name) is None]


def card_name() -> str:
    """The GPU's name from nvidia-smi: this process never initialises CUDA (its context would take memory the
    stages need)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown card"
    names = sorted({line.strip() for line in done.stdout.splitlines() if line.strip()})
    return ", ".join(names) or "unknown card"


# ---- running ------------------------------------------------------------------------------------


@dataclass
class PlanOutput:
    """The three files a plan call leaves in $OUT, rewritten after every stage."""

    out: Path
    records: dict[str, dict] = field(default_factory=dict)

    def add(self, name: str, record: dict, log_tail: str) -> None:
        self.records[name] = record
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / RESULTS).write_text(json.dumps(self.records, indent=1))
        with (self.out / REPORT).open("a") as f:
            f.write(stage_markdown(name, record) + "\n")
        with (self.out / LOGS).open("a") as f:
            f.write(f"===== {name}: {record['status']} in {record['seconds']:.0f} s\n{log_tail}\n")


def stage_markdown(name: str, record: dict) -> str:
    head = f"### `{name}` — {record['status']}, {record['seconds']:.0f} s, {record['card']} ({record['date']})"
    return "\n".join(
        [head, "", f"Goal: {record['goal']}", "", *(f"`{c}`" for c in record["commands"]), "", record["summary"], ""]
    )


def run_stage(stage: Stage, work: Path, card: str, summarize) -> tuple[dict, str]:
    """Runs the stage's commands (one log); returns its record and the log's tail."""
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / f"{stage.name}.log"
    started = time.monotonic()
    status, ran = "ok", []
    with log_path.open("w") as log:
        for cmd in stage.commands:
            left = stage.limit_s - (time.monotonic() - started)
            ran.append(" ".join(Path(c).name if c == PY else c for c in cmd))
            try:
                rc = subprocess.run(
                    cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=max(1.0, left)
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
            status = "ok" if rc == 0 else ("timed out" if rc == 124 else f"exit {rc}")
            log.write(f"\n[gpu_plan] {ran[-1]}: {status}\n")
            log.flush()
            if (rc == 0) == stage.fallback or rc == 124:  # fallback: stop at the first success; else at a failure
                break
    text = log_path.read_text(errors="replace")
    record = {
        "status": status,
        "seconds": time.monotonic() - started,
        "card": card,
        "date": datetime.date.today().isoformat(),
        "finished_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds"),  # its identity
        "goal": stage.goal,
        "commands": ran,
        "summary": "\n".join(summarize({"name": stage.name, "text": text})),
        "kept": _kept_files(stage, work),
        "group": stage.group or stage.name,
    }
    return record, "\n".join(text.splitlines()[-LOG_TAIL_LINES:])


def _kept_files(stage: Stage, work: Path) -> dict[str, str]:
    kept = {}
    for pattern in stage.keep:
        for path in sorted(work.glob(pattern)):
            if path.is_file() and path.stat().st_size <= KEEP_LIMIT_BYTES:
                kept[path.name] = path.read_text(errors="replace")
    return kept


def run_plan(*, out: Path, work: Path, budget_s: float, only: list[str] | None, summarize, start_servers) -> int:
    """Runs the pending stages that fit, most important first; 0 when every stage it started passed."""
    started = time.monotonic()
    state, card, output = load_state(), card_name(), PlanOutput(out)
    failed = False
    servers_up = False
    for stage in stages(work):
        if only is not None and stage.name not in only:
            continue
        reason = pending_reason(stage, state.get(stage.name))
        missing = missing_packages(stage)
        left = budget_s - (time.monotonic() - started)
        if reason is None and missing:
            reason = f"needs {', '.join(missing)} (see bench/gpu_plan.py)"
        if reason is None and stage.limit_s > left:
            reason = f"its limit {stage.limit_s} s > the {left:.0f} s left"
        if reason is not None:
            print(f"[plan] {stage.name}: skipped, {reason}", flush=True)
            continue
        if stage.sglang_servers and not servers_up:
            start_servers()
            servers_up = True
        print(f"[plan] {stage.name}: started ({stage.limit_s} s limit, {left:.0f} s left)", flush=True)
        record, tail = run_stage(stage, work, card, summarize)
        record["attempts"] = state.get(stage.name, {}).get("attempts", 0) * (record["status"] != "ok") + 1
        output.add(stage.name, record, tail)
        failed |= record["status"] != "ok"
        print(f"[plan] {stage.name}: {record['status']} in {record['seconds']:.0f} s", flush=True)
    if not output.records:
        print("[plan] nothing ran: every stage is done, waits for a package, or does not fit", flush=True)
    return 1 if failed else 0


def dry_run(work: Path) -> int:
    """Prints the plan with each stage's state here, and checks that every command's script exists and its
    arguments parse (each script's own argparse, stopped right after parsing); 1 if one does not."""
    state, plan = load_state(), stages(work)
    problems = iter(argument_problems([cmd for stage in plan for cmd in stage.commands]))
    bad = 0
    for i, stage in enumerate(plan, 1):
        reason = pending_reason(stage, state.get(stage.name)) or "pending"
        needs = f", needs {', '.join(stage.needs)}" if stage.needs else ""
        print(f"{i:2}. {stage.name} [{stage.limit_s} s{needs}] {reason}\n    goal: {stage.goal}")
        for cmd in stage.commands:
            problem = next(problems)
            bad += problem is not None
            shown = " ".join(Path(c).name if c == PY else c for c in cmd)
            print(f"    {'ok ' if problem is None else 'BAD'} {shown}" + (f"\n        {problem}" if problem else ""))
    return 1 if bad else 0


def argument_problems(commands: list[tuple[str, ...]]) -> list[str | None]:
    """Per command (PY bench/X.py ARGS): None if the script exists and its parser accepts ARGS, else why not. One
    subprocess checks them all (each script imported there, its main() stopped at its first parse_args)."""
    done = subprocess.run(
        [PY, str(Path(__file__)), "--parse-only", json.dumps([list(c) for c in commands])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        return [f"the check itself failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"] * len(commands)
    return json.loads(done.stdout.strip().splitlines()[-1])


class _Parsed(Exception):
    pass


def parse_commands(commands: list[list[str]]) -> list[str | None]:
    """In this process: each command's script imported and its main() called with its arguments, stopped at its
    first parse_args; the last line argparse printed where they do not parse."""
    import argparse
    import contextlib
    import io
    import runpy

    original: Any = argparse.ArgumentParser.parse_args

    def parse(self: Any, *given: Any, **named: Any) -> NoReturn:
        original(self, *given, **named)
        raise _Parsed

    setattr(argparse.ArgumentParser, "parse_args", parse)  # noqa: B010 - a method replaced in this process
    problems: list[str | None] = []
    for cmd in commands:
        if cmd[0] == PY and cmd[1:3] == ["-m", "pytest"]:  # its test files must exist
            missing = [a for a in cmd[3:] if a.startswith("tests/") and not (ROOT / a).is_file()]
            problems.append(f"no such test file: {', '.join(missing)}" if missing else None)
            continue
        script = ROOT / cmd[1]
        if cmd[0] != PY or not script.is_file():
            problems.append(f"no such script: {cmd[1]}")
            continue
        sys.argv, errors = [cmd[1], *cmd[2:]], io.StringIO()
        try:
            with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                runpy.run_path(str(script), run_name="__main__")
            problems.append("its main() returned without parsing arguments")
        except _Parsed:
            problems.append(None)
        except SystemExit:
            problems.append((errors.getvalue().strip().splitlines() or ["exited while parsing"])[-1])
    return problems


# ---- absorbing a call's results here --------------------------------------------------------------


def absorb(directory: Path, *, plan_file: Path | None = None, results_md: Path | None = None) -> int:
    """Records DIR/plan_results.json's stages in the plan file, writes their kept files under bench/gpu_results/,
    and appends their summaries to RESULTS.md as one dated section; a stage result absorbed before is skipped."""
    path = directory / RESULTS
    if not path.is_file():
        print(f"absorb: {path} does not exist (the call's files: its files_at folder)", file=sys.stderr)
        return 1
    try:
        records: dict[str, dict] = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        print(f"absorb: {path} is not valid JSON ({exc})", file=sys.stderr)
        return 1
    plan_file, results_md = plan_file or PLAN_FILE, results_md or RESULTS_MD
    state = load_state(plan_file)
    new = {n: r for n, r in records.items() if state.get(n, {}).get("finished_at") != r.get("finished_at")}
    if not new:
        print("absorb: nothing new")
        return 0
    for name, record in new.items():
        state[name] = {k: record[k] for k in ("date", "card", "status", "attempts", "seconds", "finished_at")}
        for filename, text in record.get("kept", {}).items():
            target = KEPT_DIR / record.get("group", name) / filename
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    plan_file.write_text(json.dumps(dict(sorted(state.items())), indent=1) + "\n")
    cards = sorted({r["card"] for r in new.values()})
    section = [
        f"## GPU plan (issue 39) — {max(r['date'] for r in new.values())}, {', '.join(cards)}",
        "",
        "`python bench/gpu_suite.py --plan` (bench/gpu_plan.py); absorbed with `--absorb`.",
        "",
        *(stage_markdown(name, record) for name, record in new.items()),
    ]
    with results_md.open("a") as f:
        f.write("\n" + "\n".join(section).rstrip() + "\n")
    for name, record in new.items():
        print(f"absorb: {name}: {record['status']} ({record['card']}, {record['date']})")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--parse-only"]:  # argument_problems' subprocess
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT))
    print(json.dumps(parse_commands(json.loads(sys.argv[2]))))

"""Tandem vs TRL 1.16's GRPOTrainer, side by side in one device call (the table of issue 24).

    python bench/peer_trl.py [--cases small_L1 small_L128 q05_L1 q05_L128] [--out DIR]
    python bench/peer_trl.py --device cpu --cases tiny_L1 --steps 2          # CPU smoke test
    python bench/peer_trl.py --cases qwen2.5-0.5b_L256                       # the real vocabulary (issue 31)

A case is PRESET_L<tokens> with any `tandem init-model` preset: qwen2.5-0.5b_L256 is Qwen2.5-0.5B's exact shape
(151,936-token vocabulary, tied embeddings) and its BPE tokenizer, once init-model has that preset (issue 30).

The same setup on both sides: one model directory per preset from `tandem init-model` (built at the start of the
call), examples/digit_max/train.jsonl with the `digit_task` reward (imported, not re-implemented), 64 prompts x 8
samples per optimizer step, lr 1e-3 constant, bf16, and every response exactly L tokens long. For L > 1 both sides
load a copy of the directory whose config and generation config have no eos_token_id: Tandem's native engine stops
only at the config's EOS ids (none left) or at max_new_tokens = L; TRL always adds the tokenizer's EOS to its stop
ids, so it gets min_new_tokens = L as well. Both decode with the same tokenizer (`load_tokenizer`).

- TRL: GRPOConfig(generation_batch_size=512, num_generations=8, max_completion_length=L, generation_kwargs
  {min_new_tokens: L}, beta=0, loss_type="dapo", learning_rate=1e-3 constant, bf16, use_vllm=False,
  gradient_checkpointing=False), the model loaded in bf16, per-device batches of ~8k tokens (gradient accumulation
  makes up the 512). Generation = the time inside `_generate_and_score_completions` (generate, decode, reward,
  advantages); step = the time between consecutive `on_step_end` callbacks, CUDA synchronised; train = step - gen.
- Tandem: `tandem run examples/digit_max_gpu.yaml` with cuda_ipc, `check_weight_update_equal` off and eval off, in
  loop.mode async and sync, at TRL's precision (trainer.precision bf16_pure, skip_nonfinite_steps off) and the
  default trainer.zero_stage 0 (the flat AdamW; ZeRO-1 until 2026-12-05); the perf/*
  keys of its metrics.jsonl, the trainer's own split of its train phase (perf/train_read_s, _prepare_s, _update_s)
  included. It is given steps + 1 rollouts, since a run's
  last step also saves a checkpoint.

Each side is its own subprocess with its own time limit, stopped (SIGKILL to its process group) once its steps are
recorded: a final checkpoint and the shutdown are not measured and cost the call nothing. The whole call keeps to
--budget-s: TRL and Tandem async for every case first, then Tandem sync; a run that no longer fits is skipped with
one line. Medians over steps 3-6 (1-based). Time to the first trained
step counts from the subprocess's start. MFU of a train phase = 6 x parameters x trained tokens (prompt + response)
/ (train seconds x --peak-tflops, 790 for an H200's dense bf16). The markdown tables are printed last and written
with the per-step records and every log under --out (three files: the device tool brings back eight at most).
TRL not importable: its column is skipped, in one line.

Estimate for the four default cases on one H200, from issue 24's figures (first step: Tandem 34-48 s, TRL 15-22 s;
its step times): init-model ~20 s, TRL ~110 s, Tandem async ~190 s and sync ~200 s: ~520 s, plus ~20 s for
bench/gpu_env.sh. The default budget (520 s) drops the last run (sync, q05_L128) first if start-up is slower.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PY = sys.executable
CONFIG = ROOT / "examples" / "digit_max_gpu.yaml"
TRAIN = ROOT / "examples" / "digit_max" / "train.jsonl"
PROMPTS, SAMPLES = 64, 8
BATCH = PROMPTS * SAMPLES
WINDOW = slice(2, 6)  # steps 3-6, 1-based
TRAIN_PARTS = ("read", "prepare", "update", "call")  # the trainer's perf/train_<part>_s (services/trainer)
DEFAULT_CASES = ["small_L1", "small_L128", "q05_L1", "q05_L128"]
MIN_RUN_S = {"trl": 30, "tandem_async": 55, "tandem_sync": 55}  # start-up + 6 steps, from issue 24: else skip


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    length: int


def parse_case(text: str) -> Case:
    from services.modelinit.families import MODEL_PRESETS
    from services.modelinit.init_model import PRESETS

    presets = [*PRESETS, *MODEL_PRESETS]  # toy bodies, and real models' shapes (init-model --preset qwen2.5-0.5b)
    match = re.fullmatch(r"([a-z0-9.\-]+)_L(\d+)", text)  # qwen2.5-0.5b_L256: a real-vocabulary preset
    if not match or match[1] not in presets or int(match[2]) < 1:
        raise argparse.ArgumentTypeError(
            f"case {text!r}: expected PRESET_L<tokens> with a preset of {', '.join(presets)}, e.g. q05_L128"
        )
    return Case(text, match[1], int(match[2]))


# ---- subprocesses --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    rc: int  # 124: hit its time limit
    launched: float  # time.time() at the start
    wall_s: float
    log: Path


def run_limited(cmd: list[str], *, log: Path, limit_s: float, done: Callable[[], bool] | None = None) -> Proc:
    """Runs cmd in its own process group until it exits, `done()` says its measurements are in (the group gets
    SIGKILL: what follows, a final checkpoint and the shutdown, is not measured), or limit_s passes (SIGTERM,
    then SIGKILL 10 s later; rc 124)."""
    launched, start = time.time(), time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            if done is not None and done():
                _stop_group(proc, (signal.SIGKILL,))
                rc = 0
                break
            if time.monotonic() - start > limit_s:
                _stop_group(proc, (signal.SIGTERM, signal.SIGKILL))
                rc = 124
                break
    return Proc(rc=rc, launched=launched, wall_s=time.monotonic() - start, log=log)


def _stop_group(proc: subprocess.Popen, signals: tuple[signal.Signals, ...]) -> None:
    for sig in signals:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_gone(marker: str, timeout_s: float = 20.0) -> None:
    """Waits until no process names `marker` (a run directory) on its command line: a stopped `tandem run`'s
    services are in sessions of their own and die with it (PR_SET_PDEATHSIG), a moment later; the next run
    should find the GPU free."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = False
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                alive = alive or marker.encode() in cmdline.read_bytes()
            except OSError:
                continue
        if not alive:
            return
        time.sleep(0.2)


def count_lines(path: Path, key: str) -> int:
    try:
        return path.read_text().count(key)
    except FileNotFoundError:
        return 0


class Budget:
    """The call's deadline: each stage gets its own limit, cut to what is left."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def limit(self, stage_limit_s: float) -> float:
        return min(stage_limit_s, self.deadline - time.monotonic())


# ---- model directories ---------------------------------------------------------------------------


def build_models(cases: list[Case], work: Path, budget: Budget, limit_s: float) -> dict[tuple[str, bool], Path]:
    """(preset, eos removed) -> directory: one `tandem init-model` per preset, a no-EOS copy where L > 1."""
    dirs: dict[tuple[str, bool], Path] = {}
    for preset in sorted({c.preset for c in cases}):
        path = work / "models" / preset
        if not (path / "config.json").exists():
            shutil.rmtree(path, ignore_errors=True)
            proc = run_limited(
                [PY, "-m", "services.cli", "init-model", str(path), "--preset", preset],
                log=work / f"init_{preset}.log",
                limit_s=budget.limit(limit_s),
            )
            print(
                f"[init-model {preset}] rc={proc.rc} in {proc.wall_s:.0f}s: "
                f"{proc.log.read_text().strip().splitlines()[-1:]}",
                flush=True,
            )
            if proc.rc != 0:
                raise SystemExit(f"tandem init-model {path} --preset {preset} failed (exit {proc.rc}): see {proc.log}")
        dirs[(preset, False)] = path
        if any(c.preset == preset and c.length > 1 for c in cases):
            dirs[(preset, True)] = without_eos(path, work / "models" / f"{preset}_noeos")
    return dirs


def without_eos(src: Path, dst: Path) -> Path:
    """A copy of src whose config.json and generation_config.json say eos_token_id: null; the weights are a
    symlink. Null, not absent: LlamaConfig fills an absent eos_token_id with 2, which is our `</s>`."""
    from transformers import AutoConfig, GenerationConfig

    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f.resolve())
        elif f.name in ("config.json", "generation_config.json"):
            (dst / f.name).write_text(json.dumps({**json.loads(f.read_text()), "eos_token_id": None}, indent=2))
        elif f.is_file():
            shutil.copy2(f, dst / f.name)
    left = (AutoConfig.from_pretrained(dst).eos_token_id, GenerationConfig.from_pretrained(dst).eos_token_id)
    if left != (None, None):  # the native engine stops at these (rollout/engines/native/engine.py `_eos_ids`)
        raise SystemExit(f"{dst}: EOS ids {left} survived the copy; responses could end before L tokens")
    return dst


# ---- one side each -------------------------------------------------------------------------------


def tandem_overrides(
    case: Case, *, model: Path, mode: str, steps: int, device: str, extra: tuple[str, ...] = ()
) -> list[str]:
    sets = [
        f"model.path={model}",
        f"loop.mode={mode}",
        f"loop.num_rollout={steps + 1}",
        "loop.eval_interval=null",
        f"rollout.rollout_batch_size={PROMPTS}",
        f"rollout.n_samples_per_prompt={SAMPLES}",
        f"rollout.sampling.max_new_tokens={case.length}",
        "rollout.sampling.temperature=1.0",
        "trainer.lr=1e-3",
        "trainer.lr_schedule=constant",
        "trainer.export_hf_on_save=false",
        "weights.check_weight_update_equal=false",
        f"trainer.device={device}",
        f"rollout.device={device}",
    ]
    if device == "cuda":
        # TRL's precision and work: bf16 weights and Adam states, no per-step overflow check (Tandem's GPU examples
        # keep fp32 master weights, trainer.precision bf16: bench/bench_train_step.py measures the difference)
        sets += [
            "weights.transport=cuda_ipc",
            "model.dtype=bfloat16",
            "trainer.precision=bf16_pure",
            "trainer.skip_nonfinite_steps=false",
        ]
    else:  # the CPU smoke test: gloo, fp32
        sets += ["weights.transport=gloo", "model.dtype=float32", "trainer.precision=fp32"]
    return [a for s in (*sets, *extra) for a in ("--set", s)]


def run_tandem(case: Case, *, model: Path, mode: str, args: argparse.Namespace, budget: Budget) -> dict:
    run_dir = args.work / f"tandem_{case.name}_{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        PY,
        "-m",
        "services.cli",
        "run",
        str(CONFIG),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *tandem_overrides(
            case, model=model, mode=mode, steps=args.steps, device=args.device, extra=tuple(args.tandem_set)
        ),
    ]
    metrics = run_dir / "metrics.jsonl"
    proc = run_limited(
        cmd,
        log=args.work / f"tandem_{case.name}_{mode}.log",
        limit_s=budget.limit(args.tandem_limit_s),
        done=lambda: count_lines(metrics, '"perf/step_time_s"') >= args.steps,
    )
    wait_gone(str(run_dir))
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    steps = [r for r in rows if "perf/step_time_s" in r][: args.steps]
    records = [
        {
            "step": i + 1,
            "step_s": r["perf/step_time_s"],
            "gen_s": r.get("perf/generate_time_s"),
            "train_s": r.get("perf/train_time_s"),
            "sync_s": r.get("perf/weight_sync_time_s"),
            **{f"{part}_s": r.get(f"perf/train_{part}_s") for part in TRAIN_PARTS},
            "prompt_tokens": r.get("rollout/prompt_tokens", 0.0),
            "response_tokens": r.get("rollout/response_tokens", 0.0),
            "finish_stop_frac": r.get("rollout/finish_stop_frac"),
            "gpu_gb_peak": r.get("train/gpu_gb_peak"),  # the trainer's (the engine's is rollout/gpu_gb_peak)
            "reward": r.get("rollout/reward_mean"),
            "wall": r["time"],
        }
        for i, r in enumerate(steps)
    ]
    return side_result(f"tandem_{mode}", case, proc, records)


def run_trl(case: Case, *, model: Path, args: argparse.Namespace, budget: Budget) -> dict:
    steps_file = args.work / f"trl_{case.name}.jsonl"
    steps_file.unlink(missing_ok=True)
    cmd = [
        PY,
        str(Path(__file__).resolve()),
        "trl-child",
        "--model",
        str(model),
        "--length",
        str(case.length),
        "--steps",
        str(args.steps),
        "--device",
        args.device,
        "--steps-file",
        str(steps_file),
        "--output-dir",
        str(args.work / f"trl_{case.name}"),
    ]
    proc = run_limited(
        cmd,
        log=args.work / f"trl_{case.name}.log",
        limit_s=budget.limit(args.trl_limit_s),
        done=lambda: count_lines(steps_file, '"step_s"') >= args.steps,
    )
    records = [json.loads(x) for x in steps_file.read_text().splitlines() if x.strip()] if steps_file.exists() else []
    return side_result("trl", case, proc, records)


def side_result(side: str, case: Case, proc: Proc, records: list[dict]) -> dict:
    status = "ok" if proc.rc == 0 and records else ("timed out" if proc.rc == 124 else f"exit {proc.rc}")
    print(f"[{side} {case.name}] {status}, {len(records)} steps, {proc.wall_s:.0f}s wall", flush=True)
    if status != "ok":
        print("  " + "\n  ".join(proc.log.read_text(errors="replace").splitlines()[-15:]), flush=True)
    first = records[0]["wall"] - proc.launched if records else None
    return {
        "side": side,
        "case": case.name,
        "status": status,
        "wall_s": proc.wall_s,
        "first_step_s": first,
        "records": records,
        "log": proc.log,
    }


# ---- TRL, in its own process ---------------------------------------------------------------------


def per_device_batch(prompt_tokens: int, length: int, budget_tokens: int = 8192) -> int:
    """The power of two nearest budget_tokens / sequence length, within [1, 512] (a divisor of 512)."""
    ideal = budget_tokens / (prompt_tokens + length)
    return max(1, min(BATCH, 2 ** round(max(0.0, math.log2(ideal)))))


def trl_child(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="peer_trl.py trl-child")
    for name in ("--model", "--steps-file", "--output-dir"):
        p.add_argument(name, type=Path, required=True)
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig

    from services.rollout.tokenizer import load_tokenizer

    cuda = args.device == "cuda"
    tokenizer = load_tokenizer(args.model)
    rows = [json.loads(x) for x in TRAIN.read_text().splitlines() if x.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in rows])
    prompt_tokens = max(len(tokenizer(r["prompt"])["input_ids"]) for r in rows)
    micro = per_device_batch(prompt_tokens, args.length)
    config = GRPOConfig(
        output_dir=str(args.output_dir),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=BATCH // micro,
        generation_batch_size=BATCH,
        num_generations=SAMPLES,
        max_completion_length=args.length,
        generation_kwargs={"min_new_tokens": args.length},
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        bf16=cuda,
        use_cpu=not cuda,
        use_vllm=False,
        gradient_checkpointing=False,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32)
    trainer = timed_trainer_class()(
        model=model, reward_funcs=[digit_reward], args=config, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.add_callback(step_clock(trainer, args.steps_file, cuda=cuda))
    print(
        f"trl-child: per-device batch {micro} x {BATCH // micro} accumulation, prompt <= {prompt_tokens} tokens",
        flush=True,
    )
    trainer.train()
    return 0


def digit_reward(prompts: list[str], completions: list[str], label: list[str], **_: object) -> list[float]:
    """Tandem's `digit_task`, called per sample exactly as the rollout service calls it."""
    from services.rollout.rewards import digit_task

    return [digit_task(p, c, lab, {}) for p, c, lab in zip(prompts, completions, label, strict=True)]


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def timed_trainer_class():
    """GRPOTrainer that times its generation phase and counts the real (unpadded) tokens it trains on."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        gen_s = 0.0
        prompt_tokens = response_tokens = 0

        def _generate_and_score_completions(self, inputs):
            cuda = self.accelerator.device.type == "cuda"
            _sync(cuda)
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            _sync(cuda)
            self.gen_s += time.perf_counter() - start
            self.prompt_tokens += int(out["prompt_mask"].sum())
            self.response_tokens += int(out["completion_mask"].sum())
            return out

    return TimedGRPOTrainer


def _peak_gib_since_last(cuda: bool) -> float | None:
    """The process's peak reserved GPU memory since the previous call (GiB), as the trainer's gpu_gb_peak counts."""
    if not cuda:
        return None
    import torch

    peak = torch.cuda.max_memory_reserved() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return peak


def step_clock(trainer, path: Path, *, cuda: bool):
    """A callback that writes one record per optimizer step (appended, so a timed-out run keeps its steps)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        last = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync(cuda)
            now = time.perf_counter()
            step_s, gen_s = now - self.last, trainer.gen_s
            record = {
                "step": state.global_step,
                "step_s": step_s,
                "gen_s": gen_s,
                "train_s": step_s - gen_s,
                "sync_s": None,
                "prompt_tokens": trainer.prompt_tokens,
                "response_tokens": trainer.response_tokens,
                "gpu_gb_peak": _peak_gib_since_last(cuda),
                "wall": time.time(),
            }
            with path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            trainer.gen_s, trainer.prompt_tokens, trainer.response_tokens = 0.0, 0, 0
            self.last = time.perf_counter()

    return StepClock()


# ---- the report ----------------------------------------------------------------------------------


def med(records: list[dict], key: str) -> float | None:
    window = records[WINDOW] or records[-1:]  # a smoke run of fewer steps: its last step
    values = [r[key] for r in window if r.get(key) is not None]
    return statistics.median(values) if values else None


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def split_cell(res: dict | None, parts: tuple[str, ...]) -> str:
    if res is None or res["status"] != "ok":
        return "-" if res is None else res["status"]
    inner = " / ".join(fmt(med(res["records"], k)) for k in parts)
    return f"{fmt(med(res['records'], 'step_s'))} ({inner})"


def tokens_per_s(res: dict | None) -> float | None:
    if res is None or res["status"] != "ok":
        return None
    step, tokens = med(res["records"], "step_s"), med(res["records"], "response_tokens")
    return tokens / step if step and tokens is not None else None


def peak_gib(res: dict | None) -> float | None:
    """The largest per-step peak of GPU memory (allocator reserved) over the run's steps: TRL's process, or
    Tandem's trainer."""
    if res is None or res["status"] != "ok":
        return None
    values = [r["gpu_gb_peak"] for r in res["records"] if r.get("gpu_gb_peak") is not None]
    return max(values) if values else None


def mfu(res: dict | None, params: int, peak_tflops: float, seconds: str = "train_s") -> float | None:
    """6 x params x the step's tokens over the median of record key `seconds` (the train phase, or the update)."""
    if res is None or res["status"] != "ok":
        return None
    train, prompt = med(res["records"], seconds), med(res["records"], "prompt_tokens")
    response = med(res["records"], "response_tokens")
    if not train or prompt is None or response is None:
        return None
    return 6 * params * (prompt + response) / (train * peak_tflops * 1e12)


def breakdown(
    cases: list[Case], results: dict[tuple[str, str], dict], params: dict[str, int], peak: float
) -> list[str]:
    """Where Tandem's train phase went: the coordinator's Train call, the trainer's own part of it (read from Redis,
    prepare, the update), and the update's MFU."""
    rows = [
        "| case, mode | train phase s | on the trainer: read / prepare / update s | rest (gRPC, commit) s | "
        "update MFU |",
        "|---|---|---|---|---|",
    ]
    for c in cases:
        for mode in ("async", "sync"):
            res = results.get((f"tandem_{mode}", c.name))
            if res is None or res["status"] != "ok":
                continue
            m = {k: med(res["records"], k) for k in ("train_s", *(f"{p}_s" for p in TRAIN_PARTS))}
            rest = m["train_s"] - m["call_s"] if m["train_s"] is not None and m["call_s"] is not None else None
            update_mfu = mfu(res, params[c.preset], peak, seconds="update_s")
            rows.append(
                f"| {c.name}, {mode} | {fmt(m['train_s'])} | "
                f"{' / '.join(fmt(m[f'{p}_s']) for p in ('read', 'prepare', 'update'))} | {fmt(rest)} | "
                f"{fmt(None if update_mfu is None else 100 * update_mfu, '.1f')}% |"
            )
    return rows


def report(cases: list[Case], results: dict[tuple[str, str], dict], params: dict[str, int], peak: float) -> str:
    rows = [
        "| case | TRL step s (gen / train) | Tandem async step s (gen / train / sync) | "
        "Tandem sync step s (gen / train / sync) | Tandem/TRL tokens/s, async | sync |",
        "|---|---|---|---|---|---|",
    ]
    rows2 = [
        "| case | params | tokens/step (prompt + response) | response tokens/s TRL / async / sync | "
        "mean response length TRL / async / sync | first trained step s TRL / async / sync | "
        "train MFU TRL / async / sync | peak GPU GiB: TRL / Tandem trainer async / sync |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        trl, a, s = (results.get((side, c.name)) for side in ("trl", "tandem_async", "tandem_sync"))
        tps = [tokens_per_s(x) for x in (trl, a, s)]
        ratio = [fmt(t / tps[0] if t and tps[0] else None, ".2f") for t in tps[1:]]
        three = ("gen_s", "train_s", "sync_s")
        rows.append(
            f"| {c.name} | {split_cell(trl, ('gen_s', 'train_s'))} | {split_cell(a, three)} | "
            f"{split_cell(s, three)} | **{ratio[0]}** | {ratio[1]} |"
        )
        some = next((x for x in (a, s, trl) if x and x["status"] == "ok"), None)
        tokens = (
            f"{med(some['records'], 'prompt_tokens'):.0f} + {med(some['records'], 'response_tokens'):.0f}"
            if some
            else "-"
        )
        lengths = [
            fmt(
                n / BATCH
                if x and x["status"] == "ok" and (n := med(x["records"], "response_tokens")) is not None
                else None,
                ".1f",
            )
            for x in (trl, a, s)
        ]
        firsts = [fmt(x["first_step_s"] if x else None, ".1f") for x in (trl, a, s)]
        mfus = [f"{100 * m:.1f}%" if (m := mfu(x, params[c.preset], peak)) is not None else "-" for x in (trl, a, s)]
        rates = " / ".join(fmt(t, ",.0f") for t in tps)
        peaks = " / ".join(fmt(peak_gib(x), ".2f") for x in (trl, a, s))
        size = f"{params[c.preset] / 1e9:.3f}B" if params[c.preset] >= 1e8 else f"{params[c.preset] / 1e6:.2f}M"
        rows2.append(
            f"| {c.name} | {size} | {tokens} | {rates} | {' / '.join(lengths)} | "
            f"{' / '.join(firsts)} | {' / '.join(mfus)} | {peaks} |"
        )
    return "\n".join([*rows, "", *rows2, "", *breakdown(cases, results, params, peak)])


def write_outputs(out: Path, work: Path, table: str, results: dict, header: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "peer_trl.md").write_text(header + "\n\n" + table + "\n")
    with (out / "peer_trl_steps.jsonl").open("w") as f:
        for (side, case), res in results.items():
            for r in res["records"]:
                f.write(json.dumps({"side": side, "case": case, **r}) + "\n")
    with tarfile.open(out / "peer_trl_logs.tar.gz", "w:gz") as tar:  # every log, the services' included
        for path in (
            sorted(work.glob("*.log"))
            + sorted(work.glob("tandem_*/logs/*.log"))
            + sorted(work.glob("tandem_*/metrics.jsonl"))
        ):
            tar.add(path, arcname=str(path.relative_to(work)))
        note = io.BytesIO(header.encode())
        info = tarfile.TarInfo("README.txt")
        info.size = len(note.getvalue())
        tar.addfile(info, note)


# ---- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cases",
        nargs="+",
        type=parse_case,
        default=[parse_case(c) for c in DEFAULT_CASES],
        help=f"PRESET_L<response tokens> (default: {' '.join(DEFAULT_CASES)})",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run (medians over steps 3-6)")
    p.add_argument("--modes", nargs="*", choices=["async", "sync"], default=["async", "sync"], help="none: TRL alone")
    p.add_argument("--no-trl", action="store_true", help="the Tandem side only")
    p.add_argument(
        "--tandem-set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="more --set overrides for every Tandem run (e.g. model.fused_kernels=off)",
    )
    p.add_argument("--budget-s", type=float, default=520.0, help="the whole call, model init included")
    p.add_argument("--trl-limit-s", type=float, default=150.0)
    p.add_argument("--tandem-limit-s", type=float, default=150.0)
    p.add_argument("--init-limit-s", type=float, default=120.0)
    p.add_argument("--peak-tflops", type=float, default=790.0, help="for MFU (H200 dense bf16)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "peer_trl_out"))
    p.add_argument("--work", type=Path, default=Path("/tmp/peer_trl"), help="model and run directories")
    return p.parse_args(argv)


def trl_available() -> str | None:
    """None when TRL can run here, else why not (one line)."""
    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    return f"TRL skipped: {', '.join(missing)} not importable (carry .whl_trl; bench/gpu_kit.sh)" if missing else None


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["trl-child"]:
        return trl_child(sys.argv[2:])
    args = parse_args(argv)
    budget = Budget(args.budget_s)
    args.work.mkdir(parents=True, exist_ok=True)
    skip_trl = "TRL skipped: --no-trl" if args.no_trl else trl_available()
    if skip_trl:
        print(skip_trl, flush=True)
    from services.modelinit.init_model import parameter_count

    models = build_models(args.cases, args.work, budget, args.init_limit_s)
    params = {c.preset: parameter_count(models[(c.preset, False)]) for c in args.cases}
    plan = [
        (side, c)
        for c in args.cases
        for side in (("trl",) if not skip_trl else ()) + (("tandem_async",) if "async" in args.modes else ())
    ]
    plan += [("tandem_sync", c) for c in args.cases if "sync" in args.modes]
    results: dict[tuple[str, str], dict] = {}
    for side, case in plan:
        left = budget.limit(float("inf"))
        if left < MIN_RUN_S[side]:
            print(
                f"[{side} {case.name}] skipped: {left:.0f} s of --budget-s {args.budget_s:.0f} left, "
                f"a run needs ~{MIN_RUN_S[side]} s",
                flush=True,
            )
            continue
        model = models[(case.preset, case.length > 1)]
        results[(side, case.name)] = (
            run_trl(case, model=model, args=args, budget=budget)
            if side == "trl"
            else run_tandem(case, model=model, mode=side.removeprefix("tandem_"), args=args, budget=budget)
        )
    header = (
        f"Tandem vs TRL GRPOTrainer — {time.strftime('%Y-%m-%d')}, device {device_name(args.device)}; "
        f"{PROMPTS} prompts x {SAMPLES} samples per step, {window_text(args.steps)}; "
        f"MFU at {args.peak_tflops:.0f} TFLOP/s. {skip_trl or ''}"
    ).strip()
    table = report(args.cases, results, params, args.peak_tflops)
    write_outputs(args.out, args.work, table, results, header)
    print(header + "\n\n" + table, flush=True)
    return 0 if results and all(r["status"] == "ok" for r in results.values()) else 1


def window_text(steps: int) -> str:
    return f"medians over steps 3-{min(steps, WINDOW.stop)}" if steps > WINDOW.start else "the last step (smoke run)"


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else device


if __name__ == "__main__":
    raise SystemExit(main())

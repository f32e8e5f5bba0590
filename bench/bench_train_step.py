"""Where one actor train step's time goes: Tandem's GRPO step under DeepSpeed variants next to a plain torch step.

    python bench/bench_train_step.py [--device cuda] [--presets q05] [--lengths 1 128] [--samples 512]
                                     [--variants ds_z1_bf16 ...] [--steps 4] [--profile [VARIANT ...]] [--out DIR]
                                     [--vocab V] [--chunk-tokens auto|C] [--mixed-lengths] [--warmups 2]
                                     [--no-count-ops] [--peak-tflops 790]
    python bench/bench_train_step.py --presets qwen2.5-0.5b --lengths 256 \
        --variants ds_z0_bf16 ds_z0_bf16_old          # the real vocabulary: chunked scoring against the old path

Every variant trains the same synthetic GRPO batches (digit_max-like prompts of 4-8 tokens, responses of exactly L
tokens, 8 samples per group) with Tandem's own loss code (`services.trainer.algo.actor.actor_step`), in this process:

- `ds_*`: the DeepSpeed backend the trainer service uses (ZeRO stage, precision and token budget per variant; the
  fused RMSNorm/SwiGLU kernels on a GPU unless the name says `eager`); `ds_z0_*` step with Tandem's flat AdamW;
- `torch_*`: the same loss over a plain torch backend (no DeepSpeed): bf16 parameters with fused AdamW
  (`torch_bf16`, what TRL does), or fp32 parameters under bf16 autocast (`torch_amp`);
- `hf_fwd_bwd`: the model's forward and backward alone on the same micro-batches (no loss code, no optimizer):
  the compute floor of these shapes.
- `*_loraR`: the DeepSpeed backend with trainer.lora rank R on every linear layer: trainer memory (peak GiB) and
  step time against full fine-tuning at the same shapes. Their MFU column counts 6 x all params like the others,
  although LoRA computes no gradient of the frozen weights (about 4 x params of work): compare step seconds.
- `*_old`: scoring as before issue 31, through the model's full [rows x width x vocab] logits and whole-vocabulary
  tables (tests/scoring_reference.py), next to the chunked head (services/trainer/algo/head_scoring.py) of the others;
- `*_ac`: trainer.activation_checkpointing; `*_packed`: trainer.pack_sequences (several samples per row).

Presets: Qwen2 bodies over `--vocab` (22 by default, Tandem's toy vocabulary), or a real model's exact shape
(bench/real_shapes.py: init-model's qwen2.5-0.5b, qwen2.5-1.5b, qwen3-0.6b, llama3.2-1b; real vocabularies, tied).
`--mixed-lengths` draws each response's length uniformly from [L/8, L] (padding to remove) instead of exactly L.

Columns: step seconds (median of `--steps` after `--warmups`, each run as the trainer runs it: no host sync inside),
its parts from one more step synchronised around each phase (micro-batch planning on the host, forward+loss, backward,
optimizer step; that step's own time is "phased step s": its syncs idle the GPU at every phase boundary, and before
2026-12-06 every timed step ran so, the step s and MFU of earlier tables included), the host work of one more step
under torch.profiler (aten ops that are not views, and on a GPU the kernel launches), peak GPU memory (the allocator's
reserved peak over the variant's steps, from each step's own gpu_gb_peak metric, as the trainer reports it: a step
resets the device's peak statistics, so reading them after the last step saw only that step's end; with what was still
reserved when the variant started, which that peak includes; on a CPU the process's peak RSS so far, exact for the
first variant of a process: run one variant per process to compare), and MFU = model FLOPs / (step s x --peak-tflops,
790 by default: the dense bf16 measured on this workplace's cards). Model FLOPs: 6 x the parameters that multiply (the
output head's included) x tokens, plus causal attention's 6 x layers x hidden x S^2 per sample of S tokens.
`--chunk-tokens` is trainer.scoring_chunk_tokens (auto by default); the `*_c1024` / `*_c8192` variants keep the head
of before issue 39 (1,024- or 8,192-token chunks over 8,192-column blocks) whatever it says. `--warmups N` steps
before the timed ones (2); `--no-count-ops` skips the profiled step (a long step makes millions of profiler events).
`--profile` writes a torch.profiler summary per variant (top ops by device and host time) to
DIR/profile_<variant>_<preset>_L<L>.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # scoring_reference: the old path

from op_counts import count_step_ops, profile_tables, profiler
from real_shapes import REAL_SHAPES, build_real_model_dir, real_vocab
from train_step_variants import SHAPES, VARIANTS

from services.contracts.config_loading import config_from_dict
from services.contracts.sampling_spec import SamplingSpec
from services.contracts.untyped import HFCausalLM
from services.contracts.wire import build_batch
from services.trainer.algo.head_scoring import ChunkSetting

DEFAULT_BUDGET = 16384  # trainer.micro_batch_tokens' default
PEAK_TFLOPS = 790.0  # dense bf16, as measured for this workplace's cards (FACTS.md): --peak-tflops


def make_model_dir(root: Path, preset: str, vocab: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if preset in REAL_SHAPES:
        return build_real_model_dir(preset, root / preset)
    out = root / f"{preset}-v{vocab}"
    if (out / "config.json").is_file():
        return out
    body: dict[str, Any] = {"rope_theta": 1e6, "rms_norm_eps": 1e-6, **SHAPES[preset]}  # Qwen2's, as its config.json
    cfg = Qwen2Config(
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **body,
    )
    torch.manual_seed(0)
    model: HFCausalLM = Qwen2ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def make_rollout(
    *, samples: int, response_len: int, vocab: int, seed: int, mixed: bool = False, prompt_len: int | None = None
):
    """`samples` responses of `response_len` tokens (mixed: uniform in [response_len / 8, response_len]) after
    prompts of 4-8 tokens (or `prompt_len`)."""
    from services.trainer.batching import merge_batches

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, vocab, size=prompt_len or int(rng.integers(4, 9))).tolist() for _ in range(samples)]
    lengths = (
        rng.integers(max(1, response_len // 8), response_len + 1, size=samples)
        if mixed
        else np.full(samples, response_len)
    )
    responses = [rng.integers(4, vocab, size=int(n)).tolist() for n in lengths]
    batch = build_batch(
        rollout_id=seed,
        policy_version=0,
        prompts=prompts,
        responses=responses,
        log_probs=[(-rng.random(len(r)) * 3).tolist() for r in responses],
        rewards=rng.integers(0, 2, size=samples).astype(float).tolist(),
        group_ids=[i // 8 for i in range(samples)],
        finish_reasons=["length"] * samples,
        sampling=SamplingSpec(),
    )
    return merge_batches([batch])


class Timer:
    """Seconds per named phase, CUDA-synchronised around each phase (so phases don't bleed into each other)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, dict[str, float]()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t


@dataclass
class TimedBackend:
    """Wraps a backend so each of its calls from actor_step lands in a phase of `timer`."""

    inner: Any
    timer: Timer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def scores(self, mb: Any, sampling: Any, **kwargs: Any) -> Any:
        with self.timer.phase("forward"):
            return self.inner.scores(mb, sampling, **kwargs)

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        with self.timer.phase("backward"):
            self.inner.backward(loss, last=last)

    def step(self) -> Any:
        with self.timer.phase("optimizer"):
            return self.inner.step()


class TorchBackend:
    """The DeepSpeedBackend's training surface over a plain torch model and optimizer (one rank)."""

    def __init__(
        self,
        model_dir: Path,
        device: torch.device,
        *,
        param_dtype: torch.dtype,
        autocast: bool,
        chunk_tokens: ChunkSetting,
        lr: float = 1e-3,
    ):
        from transformers import AutoModelForCausalLM

        from services.trainer.dist import DistInfo
        from services.trainer.model.backend import StepResult

        self._step_result = StepResult
        self.dist_info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
        from services.trainer.algo.head_scoring import install

        loaded: HFCausalLM = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=param_dtype, attn_implementation="sdpa"
        )
        self.module = loaded.to(device).train()
        install(self.module)
        self.engine = self.module
        self.vocab_size, self.chunk_tokens, self.pack_sequences = self.module.config.vocab_size, chunk_tokens, False
        self.compiled_scoring = False
        self.parameters = sum(p.numel() for p in self.module.parameters())
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=device.type == "cuda"
        )
        self.autocast = autocast
        self.global_steps = 0

    @property
    def device(self) -> torch.device:
        return self.dist_info.device

    def scores(self, mb: Any, sampling: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from services.trainer.model.backend import DeepSpeedBackend

        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return DeepSpeedBackend.scores(self, mb, sampling, **kwargs)  # type: ignore[arg-type]

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        loss.backward()

    def step(self) -> Any:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps += 1
        return self._step_result(grad_norm=float(norm), lr=self.optimizer.param_groups[0]["lr"])


class OldPathScores:
    """Scoring as before issue 31, around a backend: the model's full logits, then whole-vocabulary tables."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def scores(
        self, mb: Any, sampling: Any, *, tempered: bool = False, entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from scoring_reference import reference_scores

        from services.trainer.model.backend import model_inputs

        mb = mb.to(self.inner.device)
        logits = self.inner.engine(**model_inputs(mb), use_cache=False).logits  # no score request: the plain head
        scores = reference_scores(
            logits[mb.rows, mb.positions], mb.targets, sampling, tempered=tempered, entropy_grad=entropy_grad
        )
        return scores, logits


def build_backend(
    variant: dict[str, Any], model_dir: Path, device: torch.device, tmp: Path, chunk_tokens: ChunkSetting | None
) -> Any:
    backend = _build_backend(variant, model_dir, device, tmp, chunk_tokens)
    return OldPathScores(backend) if variant.get("scoring") == "old" else backend


def _build_backend(
    variant: dict[str, Any], model_dir: Path, device: torch.device, tmp: Path, chunk_tokens: ChunkSetting | None
) -> Any:
    if variant["kind"] == "torch":
        backend = TorchBackend(
            model_dir,
            device,
            param_dtype=variant["param_dtype"],
            autocast=variant["autocast"],
            chunk_tokens="auto" if chunk_tokens is None else chunk_tokens,
        )
        if variant.get("fused"):
            from services.tensors import fused

            fused.patch_model(backend.module)
        return backend
    from services.trainer.dist import init_process_group
    from services.trainer.model.backend import DeepSpeedBackend

    config = config_from_dict(
        {
            "model": {
                "path": str(model_dir),
                "dtype": "bfloat16",
                "fused_kernels": variant.get("fused_kernels", "auto"),
            },
            "data": {"train_path": str(tmp / "unused.jsonl")},
            "trainer": {
                "device": device.type,
                "zero_stage": variant["zero_stage"],
                "precision": variant["precision"],
                "lr": 1e-3,
                "micro_batch_tokens": variant.get("micro_batch_tokens", DEFAULT_BUDGET),
                "skip_nonfinite_steps": variant.get("skip_nonfinite_steps", True),
                "lora": variant.get("lora"),
                **({} if chunk_tokens is None else {"scoring_chunk_tokens": chunk_tokens}),  # None: the default
                "activation_checkpointing": variant.get("activation_checkpointing", False),
                "pack_sequences": variant.get("pack_sequences", False),
            },
        }
    )
    dist_info = init_process_group(device=device.type, timeout_s=config.services.timeouts.process_group_s)
    return DeepSpeedBackend(config=config, role="actor", dist_info=dist_info)


def algo_config() -> Any:
    return config_from_dict(
        {
            "model": {"path": "m"},
            "data": {"train_path": "t"},
            "algorithm": {"advantage_estimator": "grpo", "use_rollout_logprobs": True},
        }
    ).algorithm


def run_variant(
    name: str,
    *,
    model_dir: Path,
    device: torch.device,
    batches: list[Any],
    steps: int,
    tmp: Path,
    profile_to: Path | None,
    chunk_tokens: ChunkSetting,
    warmups: int = 2,
    count_ops: bool = True,
) -> dict[str, float]:
    from services.trainer.algo.actor import actor_step, lockstep_micro_batches

    variant = VARIANTS[name]
    chunk_tokens = variant.get("chunk_tokens", chunk_tokens)
    if "auto_gpu_logits" in variant:
        from services.trainer.algo import head_scoring

        head_scoring.AUTO_GPU_LOGITS = variant["auto_gpu_logits"]
        head_scoring._auto_logits.cache_clear()
    budget = variant.get("micro_batch_tokens", DEFAULT_BUDGET)
    held = 0.0  # what earlier variants left reserved counts in this one's peak: shown beside it
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_reserved(device) / 2**30
    if variant["kind"] == "floor":
        return run_floor(
            warmups=warmups,
            model_dir=model_dir,
            device=device,
            batches=batches,
            steps=steps,
            budget=budget,
            chunk_tokens=chunk_tokens,
        )
    backend = build_backend(variant, model_dir, device, tmp, chunk_tokens)
    algo = algo_config()
    rows: list[dict[str, float]] = []
    peaks = [0.0]  # each step's reserved peak, from its own metrics (which reset the device's peak statistics)
    # the timed steps run as the trainer runs them, with no host sync inside; one more step, synchronised around each
    # phase, splits the time (its syncs idle the GPU at every micro-batch's phase boundary: "phased step s")
    for i in range(steps + warmups + 1):
        phased = i == steps + warmups
        timer = Timer(device)
        batch = batches[i % len(batches)]
        if phased:
            with timer.phase("plan"):
                lockstep_micro_batches(backend, batch, token_budget=budget)  # what actor_step does first, alone
        started, cpu_started = time.perf_counter(), time.process_time()
        prof = profiler(device) if (profile_to is not None and i == steps + warmups - 1) else contextlib.nullcontext()
        with prof as p:
            metrics = actor_step(
                backend=TimedBackend(backend, timer) if phased else backend,
                batch=batch,
                algo=algo,
                ref_model=None,
                old_actor=None,
                token_budget=budget,
            )
            peaks.append(metrics.get("gpu_gb_peak", 0.0))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        step_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        if p is not None and profile_to is not None:
            profile_to.write_text(profile_tables(p))
        if phased:
            parts = {k: timer.seconds.get(k, 0.0) for k in ("plan", "forward", "backward", "optimizer")}
            other = step_s - parts["forward"] - parts["backward"] - parts["optimizer"]
            split = {**parts, "other": other, "phased_step_s": step_s}
        elif i >= warmups:
            rows.append({"step_s": step_s, "cpu_s": cpu_s})
    out = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0]} | split
    # each timed step beside its batch: a batch's first sight (new shapes) against a repeat shows what shapes cost
    seen = ", ".join(f"{r['step_s']:.3f} (batch {(warmups + i) % len(batches)})" for i, r in enumerate(rows))
    print(
        f"[{name}] timed steps s: {seen}; "
        f"phased {split['phased_step_s']:.3f} (batch {(steps + warmups) % len(batches)})"
    )
    if count_ops:
        out |= count_step_ops(
            functools.partial(
                actor_step,
                backend=backend,
                batch=batches[0],
                algo=algo,
                ref_model=None,
                old_actor=None,
                token_budget=budget,
            ),
            device,
        )
    out["peak_gib"] = max(peaks) if device.type == "cuda" else max_rss_gib()
    out["held_gib"] = held
    if hasattr(backend, "close"):
        backend.close()  # DeepSpeed's engine lets go of its buffers
    del backend
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run_floor(
    *,
    model_dir: Path,
    device: torch.device,
    batches: list[Any],
    steps: int,
    budget: int,
    chunk_tokens: ChunkSetting,
    warmups: int,
) -> dict[str, float]:
    """The model's forward + backward on the step's micro-batches, bf16 params, nothing else (the chunked head's
    tempered log-probs of the response tokens as the loss)."""
    from transformers import AutoModelForCausalLM

    from services.trainer.algo.head_scoring import TEMPERED_ROW, install, scores_of, scoring
    from services.trainer.algo.scoring import TokenSampling, score_request
    from services.trainer.batching import plan_micro_batches
    from services.trainer.model.backend import model_inputs

    model: HFCausalLM = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    model.to(device).train()
    install(model)
    times = []
    for i in range(steps + warmups):
        batch = batches[i % len(batches)]
        sampling = TokenSampling.of(batch).to(device)
        mbs = [mb.to(device) for mb in plan_micro_batches(batch, world_size=1, rank=0, token_budget=budget)]
        timer = Timer(device)
        with timer.phase("fwd_bwd"):
            for mb in mbs:
                request = score_request(
                    mb,
                    sampling.at(mb.token_index),
                    vocab=model.config.vocab_size,
                    chunk_tokens=chunk_tokens,
                    tempered=True,
                )
                with scoring(request):
                    scores = scores_of(model(**model_inputs(mb), use_cache=False), request)
                scores[TEMPERED_ROW].mean().backward()
        model.zero_grad(set_to_none=True)
        if i >= warmups:
            times.append(timer.seconds["fwd_bwd"])
    peak = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else 0.0
    del model
    return {"step_s": statistics.median(times), "forward": float("nan"), "peak_gib": peak}


def max_rss_gib() -> float:
    """The process's peak resident memory so far (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@dataclass(frozen=True)
class FlopShape:
    """What a step's model FLOPs depend on: the parameters that multiply (the output head's included, the input
    embedding's lookup not, unless tied to the head: then the one matrix counts once), layers and width."""

    matmul_params: int
    layers: int
    hidden: int

    @classmethod
    def of(cls, model_dir: Path) -> FlopShape:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        if not getattr(config, "tie_word_embeddings", False):
            params -= model.get_input_embeddings().weight.numel()
        return cls(matmul_params=params, layers=config.num_hidden_layers, hidden=config.hidden_size)

    def step_flops(self, batch: Any) -> float:
        """Forward and backward of every sample: 6 x matmul params per token, and causal attention's
        6 x layers x hidden x S^2 per sample of S tokens (QK^T and AV, half the square each; x3 for the backward)."""
        lengths = (batch.prompt_lengths + batch.response_lengths).double()
        return 6.0 * self.matmul_params * float(lengths.sum()) + 6.0 * self.layers * self.hidden * float(
            (lengths**2).sum()
        )


def _chunk_setting(text: str) -> ChunkSetting:
    return "auto" if text == "auto" else int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--presets", nargs="+", default=["q05"], choices=[*sorted(SHAPES), *REAL_SHAPES])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1, 128])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=22, help="vocabulary of the Qwen2-body presets")
    parser.add_argument(
        "--chunk-tokens", type=_chunk_setting, default="auto", help="trainer.scoring_chunk_tokens (a number or auto)"
    )
    parser.add_argument("--warmups", type=int, default=2, help="steps before the timed ones")
    parser.add_argument(
        "--count-ops",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profile one more step for its host ops and kernel launches",
    )
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="the card's dense bf16, for MFU")
    parser.add_argument("--mixed-lengths", action="store_true", help="response lengths uniform in [L/8, L]")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--profile",
        nargs="*",
        default=None,
        metavar="VARIANT",
        help="write torch.profiler tables for these variants (none given: all)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    out = args.out or Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for preset in args.presets:
            model_dir = make_model_dir(tmp, preset, args.vocab)
            shape = FlopShape.of(model_dir)
            for length in args.lengths:
                vocab = real_vocab(preset) if preset in REAL_SHAPES else args.vocab
                batches = [
                    make_rollout(
                        samples=args.samples, response_len=length, vocab=vocab, seed=s, mixed=args.mixed_lengths
                    )
                    for s in range(3)
                ]
                tokens = batches[0].num_tokens
                for name in args.variants:
                    wanted = args.profile is not None and (not args.profile or name in args.profile)
                    prof = out / f"profile_{name}_{preset}_L{length}.txt" if wanted else None
                    try:
                        r = run_variant(
                            name,
                            model_dir=model_dir,
                            device=device,
                            batches=batches,
                            steps=args.steps,
                            warmups=args.warmups,
                            count_ops=args.count_ops,
                            tmp=tmp,
                            profile_to=prof,
                            chunk_tokens=args.chunk_tokens,
                        )
                    except Exception as exc:  # noqa: BLE001 - one variant failing must not hide the others
                        print(f"[{name} {preset} L={length}] failed: {type(exc).__name__}: {exc}", flush=True)
                        failed.append(name)
                        continue
                    mfu = shape.step_flops(batches[0]) / (r["step_s"] * args.peak_tflops * 1e12)
                    rows.append({"preset": preset, "L": length, "variant": name, "tokens": tokens, "mfu": mfu, **r})
                    print(f"[{name} {preset} L={length}] {r}", flush=True)
    _print_table(
        rows,
        args,
        params_note=f"{datetime.date.today()} device={args.device} samples={args.samples} "
        f"chunk={args.chunk_tokens} MFU at {args.peak_tflops:.0f} TFLOP/s"
        f"{' mixed lengths' if args.mixed_lengths else ''}",
    )
    return 1 if failed else 0  # a variant that failed (out of memory, say) fails the call


def _print_table(rows: list[dict[str, Any]], args: argparse.Namespace, *, params_note: str) -> None:
    print(f"\n# bench_train_step {params_note} (medians of {args.steps} steps after {args.warmups} warm-ups)\n")
    print(
        "| preset | L | variant | tokens | step s | tokens/s | host CPU s | phased step s | plan s | forward+loss s "
        "| backward s | optimizer s | loss+host s | host ops | launches | peak GiB | held before GiB | MFU "
        "| vs ds_z1_bf16 |"
    )
    # (host CPU s: the process's CPU time in the step, all threads: on a shared CPU box, the load-independent
    # figure; peak GiB: on a CPU the process's peak RSS)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = {(r["preset"], r["L"]): r["step_s"] for r in rows if r["variant"] == "ds_z1_bf16"}
    fmt: Callable[[float], str] = lambda x: "–" if x != x else f"{x:.3f}"  # noqa: E731
    for r in rows:
        ref = base.get((r["preset"], r["L"]))
        ratio = f"{ref / r['step_s']:.2f}x" if ref else "–"
        print(
            f"| {r['preset']} | {r['L']} | {r['variant']} | {r['tokens']} | {fmt(r['step_s'])} | "
            f"{r['tokens'] / r['step_s']:,.0f} | {fmt(r.get('cpu_s', float('nan')))} | "
            f"{fmt(r.get('phased_step_s', float('nan')))} | {fmt(r.get('plan', float('nan')))} | "
            f"{fmt(r.get('forward', float('nan')))} | {fmt(r.get('backward', float('nan')))} | "
            f"{fmt(r.get('optimizer', float('nan')))} | "
            f"{fmt(r.get('other', float('nan')))} | {_count(r.get('host_ops'))} | {_count(r.get('launches'))} | "
            f"{r['peak_gib']:.2f} | {r.get('held_gib', 0.0):.1f} | {r['mfu'] * 100:.1f}% | {ratio} |"
        )


def _count(value: float | None) -> str:
    return "–" if value is None or value != value else f"{value:,.0f}"


if __name__ == "__main__":
    sys.exit(main())

"""Turning service replies into the per-step metric dict of `metrics.jsonl`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.coordinator.seams import GenerationResult


def prefixed(prefix: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """`loss` -> `train/loss`; keys that already carry a namespace (`perf/...`) keep it."""
    return {(k if "/" in k else f"{prefix}/{k}"): float(v) for k, v in metrics.items()}


SPAN_NAMESPACES = ("mismatch/", "distill/")  # the trainer's metrics that also go on the step's rl.train span


def span_attributes(train_metrics: Mapping[str, float]) -> dict[str, float]:
    """The trainer's `mismatch/*` and `distill/*` metrics as attributes of the step's `rl.train` span:
    `rl.mismatch.kl`, `rl.distill.reverse_kl`, ..."""
    return {f"rl.{k.replace('/', '.')}": float(v) for k, v in train_metrics.items() if k.startswith(SPAN_NAMESPACES)}


def weighted_mean(parts: Sequence[Mapping[str, float]], weights: Sequence[float]) -> dict[str, float]:
    """Combines per-replica metric dicts, weighting each by its sample (or prompt) count."""
    total = sum(weights)
    if total <= 0:
        return {}
    keys = {k for p in parts for k in p}
    return {k: sum(p.get(k, 0.0) * w for p, w in zip(parts, weights, strict=True)) / total for k in sorted(keys)}


def generation_metrics(gen: GenerationResult, *, weight_version: int) -> dict[str, float]:
    if gen.recorded_metrics is not None:  # reused from a checkpoint: recorded by the earlier run
        return {**gen.recorded_metrics, "rollout/reused_from_checkpoint": 1.0}
    counts = [r.num_samples for r in gen.responses]
    out = prefixed("rollout", weighted_mean([dict(r.metrics) for r in gen.responses], counts))
    out["rollout/num_samples"] = float(sum(counts))
    out["rollout/response_tokens"] = float(sum(r.num_response_tokens for r in gen.responses))
    out["rollout/prompt_tokens"] = float(sum(r.num_prompt_tokens for r in gen.responses))
    out["perf/rollout_time_s"] = gen.seconds
    out["perf/generate_time_s"] = max(r.generate_time_s for r in gen.responses)
    out["perf/reward_time_s"] = max(r.reward_time_s for r in gen.responses)
    out["rollout/staleness"] = float(weight_version - min(r.weight_version for r in gen.responses))
    out.update(gen.sampling_metrics)
    return out

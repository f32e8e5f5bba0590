"""The numbers a rollout batch and an eval report: rewards shaped by DAPO's overlong penalty, per-batch reward,
length, finish and version metrics, and pass@k."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from services.contracts.config import OverlongPenaltyConfig
from services.contracts.dapo import overlong_penalty
from services.rollout.engines.interface import SampleOutput


def shaped_rewards(
    outputs: Sequence[SampleOutput], rewards: Sequence[float], penalty: OverlongPenaltyConfig, *, max_new_tokens: int
) -> tuple[list[float], dict[str, float]]:
    """The rewards a training batch carries: the reward function's, plus DAPO's soft overlong penalty when it is on
    (applied here, before the batch is written, so the dynamic-sampling filter and the advantages both see it; evals
    never get it). With its metrics."""
    if not penalty.enabled:
        return list(rewards), {}
    extra = overlong_penalty(
        np.asarray([len(o.token_ids) for o in outputs]),
        max_new_tokens=max_new_tokens,
        buffer=min(penalty.buffer_tokens, max_new_tokens),
        factor=penalty.factor,
    )
    shaped = [float(r) + float(p) for r, p in zip(rewards, extra, strict=True)]
    return shaped, {"overlong_penalty_mean": float(extra.mean()), "overlong_penalized_frac": float((extra < 0).mean())}


def batch_metrics(
    outputs: Sequence[SampleOutput],
    rewards: Sequence[float],
    *,
    n: int,
    generate_s: float,
    group_ids: Sequence[int] | None = None,
) -> dict[str, float]:
    """Per-batch numbers for the coordinator (it prefixes them with `rollout/`). `group_ids`: each sample's group,
    when groups are not n samples in order (agent episodes: a failed one is left out, a rewritten one is several)."""
    r = np.asarray(rewards, dtype=np.float64)
    lengths = np.asarray([len(o.token_ids) for o in outputs], dtype=np.float64)
    if group_ids is None:
        zero_std = float((r.reshape(-1, n).std(axis=1) == 0).mean())
    else:
        ids = np.asarray(group_ids)
        zero_std = float(np.mean([r[ids == g].std() == 0 for g in np.unique(ids)]))
    reasons = [o.finish_reason for o in outputs]
    return {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()),
        "reward_min": float(r.min()),
        "reward_max": float(r.max()),
        "response_len_mean": float(lengths.mean()),
        "response_len_max": float(lengths.max()),
        "finish_stop_frac": reasons.count("stop") / len(reasons),
        "finish_length_frac": reasons.count("length") / len(reasons),
        # GRPO gets no signal from a group whose rewards are all equal.
        "zero_std_group_frac": zero_std,
        "tokens_per_s": float(lengths.sum() / generate_s) if generate_s > 0 else 0.0,
        **version_metrics(outputs),
    }


def version_metrics(outputs: Sequence[SampleOutput]) -> dict[str, float]:
    """How far weight updates reached into the samples (rollout.inflight_update): the spread of token versions
    within a sample (newest - oldest), and the fraction of tokens sampled by a newer version than their sample's
    first token."""
    spreads = [max(o.versions) - min(o.versions) for o in outputs if o.token_ids]
    newer = sum(sum(v > o.weight_version for v in o.versions) for o in outputs)
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "version_spread_mean": float(np.mean(spreads)) if spreads else 0.0,
        "version_spread_max": float(max(spreads, default=0)),
        "inflight_token_frac": newer / tokens if tokens else 0.0,
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(
    outputs: Sequence[SampleOutput], rewards: Sequence[float], *, n: int, prefix: str, pass_threshold: float
) -> dict[str, float]:
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, n)
    correct = (r >= pass_threshold).sum(axis=1)
    lengths = np.asarray([len(o.token_ids) for o in outputs], dtype=np.float64)
    out = {
        f"{prefix}/reward_mean": float(r.mean()),
        f"{prefix}/reward_std": float(r.std()),
        f"{prefix}/response_len_mean": float(lengths.mean()),
        f"{prefix}/finish_stop_frac": sum(o.finish_reason == "stop" for o in outputs) / len(outputs),
        f"{prefix}/num_prompts": float(r.shape[0]),
        f"{prefix}/num_samples": float(r.size),
    }
    k = 1
    while k <= n:
        out[f"{prefix}/pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
        k *= 2
    if n & (n - 1):  # not a power of two: also report pass@n
        out[f"{prefix}/pass@{n}"] = float(np.mean([pass_at_k(n, int(c), n) for c in correct]))
    return out

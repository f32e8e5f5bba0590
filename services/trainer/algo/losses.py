"""Per-token policy losses (PPO, GSPO) and value loss, KL estimators (log-probs and entropy of the sampling
distribution are in scoring.py; importance weights and rejection in rollout_correction.py).

Everything here works on flat per-response-token tensors. Aggregation (token mean, sequence mean) is
expressed as per-token weights computed once for the whole global batch (`aggregation_weights`), so the
loss of a step is `sum(weight * per_token_loss)` however the tokens are split into micro-batches and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
MAX_LOG_RATIO = 20.0  # exp overflow guard on every ratio; real ratios are near 1


def aggregation_weights(loss_mask: torch.Tensor, response_lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token weights (summing to 1 over the batch, 0 where masked) that implement `mode`.

    token_mean: every unmasked token counts the same. seq_mean_token_mean: mean over sequences of the mean
    over their tokens. seq_mean_token_sum: mean over sequences of the sum over their tokens (Dr.GRPO-style,
    so weights sum to the mean trainable length instead of 1). Sequences without trainable tokens are left out.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"algorithm.loss_aggregation: unknown mode {mode!r} (choose from {AGGREGATIONS})")
    mask = loss_mask.to(torch.float64)
    if mode == "token_mean":
        return (mask / mask.sum().clamp(min=1.0)).to(torch.float32)
    seq_ids = torch.repeat_interleave(torch.arange(len(response_lengths)), response_lengths.to(torch.long))
    per_seq = torch.zeros(len(response_lengths), dtype=torch.float64).index_add_(0, seq_ids, mask)
    num_seqs = (per_seq > 0).sum().clamp(min=1).to(torch.float64)
    weights = mask / per_seq.clamp(min=1.0)[seq_ids] / num_seqs if mode == "seq_mean_token_mean" else mask / num_seqs
    return weights.to(torch.float32)


@dataclass(frozen=True)
class PolicyLossConfig:
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None = symmetric
    dual_clip_c: float | None = None  # None = off; > 1 bounds the loss of negative advantages


@dataclass(frozen=True)
class Sequences:
    """Which sequence each token belongs to, and which tokens are trainable: GSPO's per-sequence means. Tokens of one
    sequence never span two micro-batches, so a micro-batch's own rows are its sequences."""

    ids: torch.Tensor  # int64 [N]: each token's sequence, in [0, count)
    count: int
    trainable: torch.Tensor  # bool [N]: loss_mask 1

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Per token: the mean of `values` over its sequence's trainable tokens (0 for a sequence without any)."""
        picked = torch.where(self.trainable, values, torch.zeros_like(values))  # masked tokens may hold NaN
        total = torch.zeros(self.count, dtype=values.dtype, device=values.device).index_add_(0, self.ids, picked)
        size = torch.zeros(self.count, dtype=values.dtype, device=values.device).index_add_(
            0, self.ids, self.trainable.to(values.dtype)
        )
        return (total / size.clamp(min=1.0))[self.ids]


def _clipped_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - cfg.eps_clip, 1.0 + eps_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).to(torch.float32)
    if cfg.dual_clip_c is not None:
        bound = -advantages * cfg.dual_clip_c
        dual_active = (advantages < 0) & (bound < loss)
        loss = torch.where(dual_active, bound, loss)
        clipped = torch.where(dual_active, torch.ones_like(clipped), clipped)
    return loss, clipped, ratio.detach()


def ppo_policy_loss(
    *, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate per token. Returns (loss, clipped indicator (float), ratio).

    loss = max(-A r, -A clip(r, 1-eps, 1+eps_high)); with dual clip, for A < 0 the loss is further
    bounded by -A c (Ye et al. 2020), so a huge ratio on a bad action cannot dominate the step.
    """
    return _clipped_surrogate(log_probs - old_log_probs, advantages, cfg)


def gspo_policy_loss(
    *,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    sequences: Sequences,
    cfg: PolicyLossConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025) in its GSPO-token form, per token: the ratio's value is the sequence's
    s = exp(mean over its trainable tokens of log(pi / pi_old)), clipped like PPO's (dual clip included), and its
    gradient is s times the token's own score, so per-token advantages are allowed. With one advantage per
    sequence and seq_mean_token_mean this is exactly GSPO's gradient; on one-token sequences exactly PPO's."""
    seq_log_ratio = sequences.mean((log_probs - old_log_probs).detach())
    return _clipped_surrogate(seq_log_ratio + log_probs - log_probs.detach(), advantages, cfg)


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1, k2, k3).

    k3 = ref/pi - 1 - log(ref/pi) is not clamped (verl's low_var_kl clamps it to [-10, 10], hiding how far the
    policy went and zeroing the gradient there); only the exponent is capped at 20 so exp stays finite."""
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        neg = (-log_ratio).clamp(max=20.0)  # ref/pi; clamp keeps exp finite for very unlikely ref tokens
        return torch.exp(neg) - 1.0 - neg
    raise ValueError(f"algorithm.kl_estimator: unknown estimator {estimator!r} (choose from {KL_ESTIMATORS})")


def clipped_value_loss(
    *, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO value loss per token: 0.5 max((V - R)^2, (V_old + clip(V - V_old) - R)^2). Returns (loss, clipped)."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    loss_unclipped = (values - returns).square()
    loss_clipped = (clipped_values - returns).square()
    loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    return loss, (loss_clipped > loss_unclipped).to(torch.float32)

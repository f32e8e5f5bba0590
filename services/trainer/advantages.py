"""Advantage estimators: group-normalised (GRPO, Dr.GRPO) and GAE, plus KL reward shaping.

Inputs are per-sample arrays (rewards, group ids, response lengths) and flat per-response-token arrays
in the batch's sample order, the layout of `RolloutBatchData`.
"""

from __future__ import annotations

import torch


def per_token(values: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """Broadcasts one value per sample to each of its response tokens."""
    return torch.repeat_interleave(values, response_lengths.to(torch.long))


def per_sample_sum(token_values: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    seq_ids = torch.repeat_interleave(torch.arange(len(response_lengths)), response_lengths.to(torch.long))
    out = torch.zeros(len(response_lengths), dtype=token_values.dtype)
    return out.index_add_(0, seq_ids, token_values)


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, normalize_std: bool,
                    eps: float = 1e-6) -> torch.Tensor:
    """A_i = r_i - mean(group), divided by the group's (unbiased) std when `normalize_std`.

    `normalize_std=False` is Dr.GRPO. A group of one sample has advantage 0 (nothing to compare with).
    """
    r = rewards.to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if len(inverse) else 0
    count = torch.bincount(inverse, minlength=num_groups).to(torch.float64)
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, r) / count
    centered = r - mean[inverse]
    if normalize_std:
        sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, centered.square())
        std = torch.sqrt(sq / (count - 1).clamp(min=1.0))
        centered = centered / (std[inverse] + eps)
    return centered.to(torch.float32)


def token_rewards(rewards: torch.Tensor, response_lengths: torch.Tensor,
                  kl_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token rewards for GAE: the sample's reward on its last response token, minus `kl_penalty`
    (already multiplied by the KL coefficient) on every token when KL is used as reward shaping."""
    lengths = response_lengths.to(torch.long)
    out = torch.zeros(int(lengths.sum()), dtype=torch.float32)
    if kl_penalty is not None:
        out -= kl_penalty.to(torch.float32)
    ends = torch.cumsum(lengths, 0) - 1
    has_tokens = lengths > 0
    out[ends[has_tokens]] += rewards.to(torch.float32)[has_tokens]
    return out


def _pad(flat: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, t_max = len(lengths), int(lengths.max()) if len(lengths) else 0
    mask = torch.arange(t_max).unsqueeze(0) < lengths.unsqueeze(1)
    padded = torch.zeros(n, t_max, dtype=flat.dtype)
    padded[mask] = flat
    return padded, mask


def gae(*, rewards: torch.Tensor, values: torch.Tensor, response_lengths: torch.Tensor, gamma: float,
        lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation per sequence over flat per-token rewards and values.

    delta_t = r_t + gamma V_{t+1} - V_t (V after the last token is 0), A_t = delta_t + gamma lambd A_{t+1}.
    Returns flat (advantages, returns = advantages + values).
    """
    lengths = response_lengths.to(torch.long)
    r, mask = _pad(rewards.to(torch.float64), lengths)
    v, _ = _pad(values.to(torch.float64), lengths)
    m = mask.to(torch.float64)
    adv = torch.zeros_like(r)
    last = torch.zeros(len(lengths), dtype=torch.float64)
    for t in reversed(range(r.shape[1])):
        next_v = v[:, t + 1] * m[:, t + 1] if t + 1 < r.shape[1] else torch.zeros_like(last)
        delta = r[:, t] + gamma * next_v - v[:, t]
        last = (delta + gamma * lambd * last) * m[:, t]
        adv[:, t] = last
    advantages = adv[mask].to(torch.float32)
    return advantages, advantages + values.to(torch.float32)

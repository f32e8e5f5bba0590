"""Advantage estimators: group-normalised (GRPO, Dr.GRPO), leave-one-out (RLOO), REINFORCE++ and REINFORCE++-baseline,
and GAE, plus KL reward shaping and whitening.

Inputs are per-sample arrays (rewards, group ids, response lengths) and flat per-response-token arrays
in the batch's sample order, the layout of `RolloutBatchData`. Tokens with loss_mask 0 (tool output,
observations) are no actions: they get no reward or KL, and GAE steps over them (docs/algorithms.md).
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


def _group_sums(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each sample's group index, samples per group, sum per group), float64."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if len(inverse) else 0
    count = torch.bincount(inverse, minlength=num_groups).to(torch.float64)
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, values)
    return inverse, count, total


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, normalize_std: bool, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = r_i - mean(group), divided by the group's (unbiased) std when `normalize_std`.

    `normalize_std=False` is Dr.GRPO. A group of one sample has advantage 0 (nothing to compare with).
    """
    r = rewards.to(torch.float64)
    inverse, count, total = _group_sums(r, group_ids)
    centered = r - (total / count)[inverse]
    if normalize_std:
        sq = torch.zeros(len(count), dtype=torch.float64).index_add_(0, inverse, centered.square())
        std = torch.sqrt(sq / (count - 1).clamp(min=1.0))
        centered = centered / (std[inverse] + eps)
    return centered.to(torch.float32)


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean of the other samples of its group (Ahmadian et al. 2024), i.e. k/(k-1) (r_i - mean).

    A group of one has no other sample: advantage 0, as GRPO's (TRL, slime; verl's loop version keeps the raw reward).
    """
    r = rewards.to(torch.float64)
    inverse, count, total = _group_sums(r, group_ids)
    k = count[inverse]
    others = (total[inverse] - r) / (k - 1).clamp(min=1.0)
    return torch.where(k > 1, r - others, torch.zeros_like(r)).to(torch.float32)


def token_rewards(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    loss_mask: torch.Tensor,
    kl_penalty: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token rewards for GAE: the sample's reward on its last trainable token (loss_mask 1; the last
    action), minus `kl_penalty` (already multiplied by the KL coefficient) on trainable tokens when KL is used
    as reward shaping. Tool / observation tokens (loss_mask 0) get nothing: they are no actions."""
    lengths = response_lengths.to(torch.long)
    mask = loss_mask.to(torch.float32)
    out = torch.zeros(int(lengths.sum()), dtype=torch.float32)
    if kl_penalty is not None:
        out -= kl_penalty.to(torch.float32) * mask
    padded_mask, _ = _pad(mask, lengths)
    trainable = padded_mask > 0
    has_action = trainable.any(dim=1)
    width = padded_mask.shape[1]
    last_in_row = width - 1 - torch.argmax(trainable.flip(1).to(torch.int8), dim=1)  # last trainable position
    last = torch.cumsum(lengths, 0) - lengths + last_in_row  # flat index: the sample's start + position
    out[last[has_action]] += rewards.to(torch.float32)[has_action]
    return out


def _pad(flat: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, t_max = len(lengths), int(lengths.max()) if len(lengths) else 0
    mask = torch.arange(t_max).unsqueeze(0) < lengths.unsqueeze(1)
    padded = torch.zeros(n, t_max, dtype=flat.dtype)
    padded[mask] = flat
    return padded, mask


def gae(
    *,
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_lengths: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation per sequence over flat per-token rewards and values.

    delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lambd A_next, where "next" is the next token with
    loss_mask 1: masked (tool / observation) tokens are no steps, so they neither discount nor bootstrap (verl's
    compute_gae_advantage_return). V after the last action is 0. Masked tokens get advantage 0.
    Returns flat (advantages, returns = advantages + values).
    """
    lengths = response_lengths.to(torch.long)
    r, in_seq = _pad(rewards.to(torch.float64), lengths)
    v, _ = _pad(values.to(torch.float64), lengths)
    m, _ = _pad(loss_mask.to(torch.float64), lengths)
    adv = torch.zeros_like(r)
    next_value = torch.zeros(len(lengths), dtype=torch.float64)
    next_adv = torch.zeros(len(lengths), dtype=torch.float64)
    for t in reversed(range(r.shape[1])):
        step = m[:, t] > 0
        delta = r[:, t] + gamma * next_value - v[:, t]
        here = delta + gamma * lambd * next_adv
        next_value = torch.where(step, v[:, t], next_value)
        next_adv = torch.where(step, here, next_adv)
        adv[:, t] = torch.where(step, here, torch.zeros_like(here))
    advantages = adv[in_seq].to(torch.float32)
    return advantages, advantages + values.to(torch.float32)


def discounted_returns(
    *, rewards: torch.Tensor, response_lengths: torch.Tensor, loss_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """REINFORCE++'s per-token returns G_t = r_t + gamma G_next over flat per-token rewards, "next" being the next
    token with loss_mask 1: GAE with V = 0 and lambda = 1, so masked tokens are no steps here either (they carry G
    through undiscounted and get 0)."""
    returns, _ = gae(
        rewards=rewards,
        values=torch.zeros_like(rewards),
        response_lengths=response_lengths,
        loss_mask=loss_mask,
        gamma=gamma,
        lambd=1.0,
    )
    return returns


def whiten(advantages: torch.Tensor, loss_mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(A - mean) / sqrt(var + eps) over the trainable tokens of the whole batch (unbiased variance, as verl's
    masked_whiten; OpenRLHF's is biased, a factor sqrt(n / (n - 1)) apart); masked tokens stay 0."""
    mask = loss_mask.to(torch.float64) > 0
    a = advantages.to(torch.float64)
    picked = a[mask]
    if picked.numel() < 2:
        return torch.zeros_like(advantages)
    out = (a - picked.mean()) * torch.rsqrt(picked.var(unbiased=True) + eps)
    return torch.where(mask, out, torch.zeros_like(out)).to(torch.float32)

"""One policy update (GRPO or PPO with critic values) over a whole TrainBatch, on every rank in lockstep.

Global per-token quantities (advantages, aggregation weights) are computed from the full batch that every
rank holds; forward passes only cover the rank's shard. Per-token results of a pre-pass that other ranks
need (KL for reward shaping) are summed over ranks into a full-length vector.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from services.common.config import AlgorithmConfig
from services.trainer.advantages import gae, grpo_advantages, per_sample_sum, per_token, token_rewards
from services.trainer.backend import DeepSpeedBackend, reference_log_probs
from services.trainer.batching import MicroBatch, TrainBatch, dummy_micro_batch, plan_micro_batches
from services.trainer.dist import all_reduce_max_int, all_reduce_sum
from services.trainer.losses import (PolicyLossConfig, aggregation_weights, entropy_from_logits, kl_estimate,
                                     ppo_policy_loss, tis_weights, token_log_probs)


def lockstep_micro_batches(backend: DeepSpeedBackend, batch: TrainBatch, *, token_budget: int) -> list[MicroBatch]:
    """This rank's micro-batches, padded with empty ones to the largest count over ranks (every rank must
    run the same number of forward/backward passes: ZeRO-3 gathers parameters in each)."""
    info = backend.dist_info
    mbs = plan_micro_batches(batch, world_size=info.world_size, rank=info.rank, token_budget=token_budget)
    count = all_reduce_max_int(len(mbs), info.device)
    return mbs + [dummy_micro_batch() for _ in range(count - len(mbs))]


def per_token_pass(num_tokens: int, mbs: list[MicroBatch], fn: Callable[[MicroBatch], torch.Tensor]) -> torch.Tensor:
    """Runs `fn` (no grad) on every micro-batch and scatters its per-token output into a flat vector;
    entries of other ranks' tokens stay 0."""
    out = torch.zeros(num_tokens, dtype=torch.float32)
    with torch.no_grad():
        for mb in mbs:
            values = fn(mb)
            if mb.token_index.numel():
                out[mb.token_index] = values.detach().float().cpu()
    return out


def owned_tokens(num_tokens: int, mbs: list[MicroBatch]) -> torch.Tensor:
    """1.0 on the response tokens this rank's micro-batches cover, else 0.0."""
    out = torch.zeros(num_tokens, dtype=torch.float32)
    for mb in mbs:
        out[mb.token_index] = 1.0
    return out


def compute_advantages(batch: TrainBatch, algo: AlgorithmConfig, kl_penalty: torch.Tensor | None) -> torch.Tensor:
    """Per-token advantages. `kl_penalty` (kl_coef × per-token KL, full batch) shapes the rewards."""
    if algo.advantage_estimator == "grpo":
        rewards = batch.rewards
        if kl_penalty is not None:
            rewards = rewards - per_sample_sum(kl_penalty * batch.loss_mask, batch.response_lengths)
        adv = grpo_advantages(rewards, batch.group_ids, normalize_std=algo.normalize_advantage_std)
        return per_token(adv, batch.response_lengths)
    if batch.values is None:
        raise ValueError("advantage_estimator gae needs the critic's values (Train with use_critic_values)")
    rewards = token_rewards(batch.rewards, batch.response_lengths, kl_penalty)
    advantages, _ = gae(rewards=rewards, values=batch.values, response_lengths=batch.response_lengths,
                        gamma=algo.gamma, lambd=algo.lambd)
    return advantages


_SUMS = ("loss", "pg_loss", "pg_clipfrac", "kl", "entropy", "ppo_ratio_mean", "tis_weight_mean")


def actor_step(*, backend: DeepSpeedBackend, batch: TrainBatch, algo: AlgorithmConfig,
               ref_model: torch.nn.Module | None, token_budget: int) -> dict[str, float]:
    start = time.monotonic()
    device, world = backend.device, backend.dist_info.world_size
    mbs = lockstep_micro_batches(backend, batch, token_budget=token_budget)
    n_tok = batch.num_response_tokens
    ref_lp = None if ref_model is None else per_token_pass(
        n_tok, mbs, lambda mb: reference_log_probs(ref_model, mb, device))
    kl_penalty = None
    if ref_lp is not None and algo.kl_mode == "reward":
        # The sampling policy's log-probs: the rollout's, or recomputed before the update.
        before = batch.rollout_log_probs if algo.use_rollout_logprobs else per_token_pass(
            n_tok, mbs, lambda mb: token_log_probs(backend.logits(mb)[0], mb.targets.to(device)))
        kl = kl_estimate(before, ref_lp, algo.kl_estimator) * owned_tokens(n_tok, mbs)
        kl_penalty = algo.kl_coef * all_reduce_sum(kl.to(device)).cpu()
    advantages = compute_advantages(batch, algo, kl_penalty)
    weights = aggregation_weights(batch.loss_mask, batch.response_lengths, algo.loss_aggregation)
    token_w = aggregation_weights(batch.loss_mask, batch.response_lengths, "token_mean")
    clip = PolicyLossConfig(eps_clip=algo.eps_clip, eps_clip_high=algo.eps_clip_high, dual_clip_c=algo.dual_clip_c)
    sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=device)
    for i, mb in enumerate(mbs):
        logits, anchor = backend.logits(mb)
        idx = mb.token_index
        logp = token_log_probs(logits, mb.targets.to(device))
        ent = entropy_from_logits(logits if algo.entropy_coef > 0 else logits.detach())
        rollout_lp = batch.rollout_log_probs[idx].to(device)
        old = rollout_lp if algo.use_rollout_logprobs else logp.detach()   # one update per Train: exact
        pg, clipped, ratio = ppo_policy_loss(log_probs=logp, old_log_probs=old, advantages=advantages[idx].to(device),
                                             cfg=clip)
        tis = torch.ones_like(pg)
        if algo.use_tis:
            tis = tis_weights(old_log_probs=logp.detach(), rollout_log_probs=rollout_lp, clip=algo.tis_clip)
            pg = pg * tis
        loss_tok = pg
        kl_tok = torch.zeros_like(pg)
        if ref_lp is not None:
            kl_tok = kl_estimate(logp, ref_lp[idx].to(device), algo.kl_estimator)
            if algo.kl_mode == "loss":
                loss_tok = loss_tok + algo.kl_coef * kl_tok
        if algo.entropy_coef > 0:
            loss_tok = loss_tok - algo.entropy_coef * ent
        w, tw = weights[idx].to(device), token_w[idx].to(device)
        loss = (w * loss_tok).sum()
        if idx.numel() == 0:
            loss = anchor.sum() * 0.0   # keeps the backward (and its ZeRO hooks) identical on every rank
        backend.backward(loss * world, last=i == len(mbs) - 1)
        with torch.no_grad():
            parts = [loss, (w * pg).sum(), (tw * clipped).sum(), (tw * kl_tok).sum(), (tw * ent).sum(),
                     (tw * ratio).sum(), (tw * tis).sum()]
            sums += torch.stack([p.detach().double() for p in parts])
    step = backend.step()
    totals = dict(zip(_SUMS, all_reduce_sum(sums).cpu().tolist()))
    if ref_lp is None:
        totals.pop("kl")
    if not algo.use_tis:
        totals.pop("tis_weight_mean")
    return {**totals, **batch_metrics(batch), "grad_norm": step.grad_norm, "lr": step.lr,
            "advantage_mean": float((advantages * token_w).sum()), **perf(batch, start)}


def batch_metrics(batch: TrainBatch) -> dict[str, float]:
    return {"tokens": float(batch.num_tokens), "response_tokens": float(batch.num_response_tokens),
            "response_len_mean": float(batch.response_lengths.double().mean()),
            "reward_mean": float(batch.rewards.double().mean()), "samples": float(batch.num_samples)}


def perf(batch: TrainBatch, start: float) -> dict[str, float]:
    seconds = time.monotonic() - start
    return {"perf/train_time_s": seconds, "perf/train_tokens_per_s": batch.num_tokens / seconds if seconds else 0.0}

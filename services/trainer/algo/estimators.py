"""The trainer's half of the algorithm table (services/contracts/algorithms.py holds the facts): for every advantage
estimator and policy loss the config may name, the function that computes it. The keys are exactly the facts'
(tests/test_algorithm_table.py), and a name missing from either is refused by name, never defaulted."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.contracts.algorithm_config import AlgorithmConfig
from services.contracts.algorithms import Estimator, advantage_estimator, policy_loss
from services.trainer.algo.advantages import (
    discounted_returns,
    gae,
    grpo_advantages,
    per_sample_sum,
    per_token,
    rloo_advantages,
    token_rewards,
    whiten,
)
from services.trainer.algo.losses import PolicyLossConfig, Sequences, gspo_policy_loss, ppo_policy_loss
from services.trainer.batching import TrainBatch

# (batch, config, rewards) -> per-token advantages; rewards are per token for an estimator with per-token returns,
# else per sample (either already less the KL penalty of kl_mode: reward)
AdvantageFn = Callable[[TrainBatch, AlgorithmConfig, torch.Tensor], torch.Tensor]
# (log-probs, old log-probs, advantages, sequences, clip) -> per-token (loss, clipped, ratio)
PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Sequences, PolicyLossConfig],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]


def _grpo(batch: TrainBatch, algo: AlgorithmConfig, rewards: torch.Tensor) -> torch.Tensor:
    adv = grpo_advantages(rewards, batch.group_ids, normalize_std=algo.normalize_advantage_std)
    return per_token(adv, batch.response_lengths)


def _rloo(batch: TrainBatch, algo: AlgorithmConfig, rewards: torch.Tensor) -> torch.Tensor:
    return per_token(rloo_advantages(rewards, batch.group_ids), batch.response_lengths)


def _gae(batch: TrainBatch, algo: AlgorithmConfig, rewards: torch.Tensor) -> torch.Tensor:
    assert batch.values is not None  # compute_advantages checks it: the estimator uses a critic
    advantages, _ = gae(
        rewards=rewards,
        values=batch.values,
        response_lengths=batch.response_lengths,
        loss_mask=batch.loss_mask,
        gamma=algo.gamma,
        lambd=algo.lambd,
    )
    return whiten(advantages, batch.loss_mask) if algo.whiten_advantages else advantages


def _reinforce_pp(batch: TrainBatch, algo: AlgorithmConfig, rewards: torch.Tensor) -> torch.Tensor:
    returns = discounted_returns(
        rewards=rewards, response_lengths=batch.response_lengths, loss_mask=batch.loss_mask, gamma=algo.gamma
    )
    return whiten(returns, batch.loss_mask)


def _reinforce_pp_baseline(batch: TrainBatch, algo: AlgorithmConfig, rewards: torch.Tensor) -> torch.Tensor:
    centred = grpo_advantages(rewards, batch.group_ids, normalize_std=False)
    return whiten(per_token(centred, batch.response_lengths), batch.loss_mask)


ADVANTAGE_FNS: dict[str, AdvantageFn] = {
    "grpo": _grpo,
    "rloo": _rloo,
    "gae": _gae,
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
}

POLICY_LOSS_FNS: dict[str, PolicyLossFn] = {
    "ppo": lambda logp, old, adv, _seqs, cfg: ppo_policy_loss(
        log_probs=logp, old_log_probs=old, advantages=adv, cfg=cfg
    ),
    "gspo": lambda logp, old, adv, seqs, cfg: gspo_policy_loss(
        log_probs=logp, old_log_probs=old, advantages=adv, sequences=seqs, cfg=cfg
    ),
}


def estimator_rewards(batch: TrainBatch, facts: Estimator, kl_penalty: torch.Tensor | None) -> torch.Tensor:
    """The rewards an estimator starts from: per token (the sample's reward on its last action, less the per-token
    KL penalty) for one with per-token returns, else per sample (less its KL penalty summed over its trainable
    tokens)."""
    lengths, mask = batch.response_lengths, batch.loss_mask
    if facts.per_token_returns:
        return token_rewards(batch.rewards, lengths, mask, kl_penalty)
    if kl_penalty is None:
        return batch.rewards
    return batch.rewards - per_sample_sum(kl_penalty * mask, lengths)


def compute_advantages(batch: TrainBatch, algo: AlgorithmConfig, kl_penalty: torch.Tensor | None) -> torch.Tensor:
    """Per-token advantages of `algo.advantage_estimator`; `kl_penalty` (kl_coef x per-token KL, full batch) shapes
    the rewards (kl_mode: reward)."""
    facts = advantage_estimator(algo.advantage_estimator)
    fn = ADVANTAGE_FNS.get(facts.name)
    if fn is None:
        raise ValueError(f"advantage_estimator {facts.name!r} has no function in the trainer's table")
    if facts.uses_critic and batch.values is None:
        raise ValueError(f"advantage_estimator {facts.name} needs the critic's values (Train with use_critic_values)")
    return fn(batch, algo, estimator_rewards(batch, facts, kl_penalty))


def policy_loss_fn(name: str) -> PolicyLossFn:
    facts = policy_loss(name)
    fn = POLICY_LOSS_FNS.get(facts.name)
    if fn is None:
        raise ValueError(f"policy_loss {facts.name!r} has no function in the trainer's table")
    return fn

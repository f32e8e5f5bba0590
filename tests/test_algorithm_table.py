"""The algorithm table (issue 40 item 6): advantage estimators and policy losses are entries that carry their facts
(services/contracts/algorithms.py), the trainer's functions are a table with the same names
(services/trainer/algo/estimators.py), the config and the actor read the facts, and an unknown name is refused by
name."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from services.contracts.algorithm_config import AlgorithmConfig
from services.contracts.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, advantage_estimator
from services.trainer.algo.estimators import (
    ADVANTAGE_FNS,
    POLICY_LOSS_FNS,
    compute_advantages,
    estimator_rewards,
    policy_loss_fn,
)
from services.trainer.batching import TrainBatch

E, P = ADVANTAGE_ESTIMATORS, POLICY_LOSSES


def test_the_trainer_has_a_function_for_exactly_the_names_of_the_facts():
    assert list(ADVANTAGE_FNS) == list(E) and list(POLICY_LOSS_FNS) == list(P)


def test_only_gae_uses_a_critic():
    assert [n for n, e in E.items() if e.uses_critic] == ["gae"]


def test_group_baselines():
    assert [n for n, e in E.items() if e.needs_groups] == ["grpo", "rloo", "reinforce_pp_baseline"]


def test_per_token_returns():
    assert [n for n, e in E.items() if e.per_token_returns] == ["gae", "reinforce_pp"]


def test_only_grpo_divides_by_the_group_std():
    assert [n for n, e in E.items() if e.divides_by_group_std] == ["grpo"]


def test_ppo_clips_per_token_and_gspo_per_sequence():
    assert (P["ppo"].ratio, P["gspo"].ratio) == ("token", "sequence")


def test_both_losses_support_token_and_sequence_aggregation():
    assert all(set(p.aggregations) == {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum"} for p in P.values())


def test_the_default_aggregation_is_the_losses_own():
    assert [AlgorithmConfig(policy_loss=n).loss_aggregation for n in P] == ["token_mean", "seq_mean_token_mean"]


def test_the_config_reads_the_critic_and_group_facts():
    assert [AlgorithmConfig(advantage_estimator=n).uses_critic for n in E] == [e.uses_critic for e in E.values()]
    assert [AlgorithmConfig(advantage_estimator=n).compares_within_groups for n in E] == [
        e.needs_groups for e in E.values()
    ]


def test_the_config_refuses_gamma_for_an_estimator_without_per_token_returns():
    with pytest.raises(ValidationError, match="gamma applies to advantage_estimator: gae or reinforce_pp"):
        AlgorithmConfig(advantage_estimator="rloo", gamma=0.9)


@pytest.mark.parametrize(("key", "name"), [("advantage_estimator", "vtrace"), ("policy_loss", "cispo")])
def test_an_unknown_name_is_refused_with_the_known_ones(key, name):
    known = ", ".join(E if key == "advantage_estimator" else P)
    with pytest.raises(ValidationError, match=f"unknown {key} '{name}' \\(known: {known}\\)"):
        AlgorithmConfig.model_validate({key: name})


def test_the_trainer_refuses_an_unknown_name_too_instead_of_defaulting():
    """A config that skipped validation (model_construct) still never falls through to GRPO."""
    with pytest.raises(ValueError, match="unknown advantage_estimator 'vtrace'"):
        compute_advantages(batch(), AlgorithmConfig.model_construct(advantage_estimator="vtrace"), None)
    with pytest.raises(ValueError, match="unknown policy_loss 'cispo'"):
        policy_loss_fn("cispo")


def test_the_actor_reads_uses_critic():
    with pytest.raises(ValueError, match="advantage_estimator gae needs the critic's values"):
        compute_advantages(batch(), AlgorithmConfig(advantage_estimator="gae"), None)


def test_the_actor_reads_per_token_returns():
    """Per token for reinforce_pp (the reward on the last action less each token's KL), per sample for grpo."""
    b, kl = batch(), torch.full((5,), 0.1)
    assert estimator_rewards(b, advantage_estimator("reinforce_pp"), kl).tolist() == pytest.approx(
        [-0.1, -0.1, 0.9, -0.1, -0.1]
    )
    assert estimator_rewards(b, advantage_estimator("grpo"), kl).tolist() == pytest.approx([0.7, -0.2])


def batch() -> TrainBatch:
    """Two samples of one prompt: 3 and 2 response tokens, rewards 1 and 0."""
    return TrainBatch(
        tokens=torch.zeros(7, dtype=torch.long),
        prompt_lengths=torch.tensor([1, 1]),
        response_lengths=torch.tensor([3, 2]),
        loss_mask=torch.ones(5),
        rollout_log_probs=torch.zeros(5),
        rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 0]),
        sample_versions=torch.tensor([0, 0]),
        sampling_temperature=torch.ones(2),
        sampling_top_p=torch.ones(2),
        sampling_top_k=torch.zeros(2, dtype=torch.long),
    )

"""Advantage estimators against small hand-computed references."""

import math

import pytest
import torch

from services.trainer.algo.advantages import gae, grpo_advantages, per_sample_sum, per_token, token_rewards


def test_grpo_group_normalised_with_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
    groups = torch.tensor([7, 7, 7, 3, 3])
    adv = grpo_advantages(rewards, groups, normalize_std=True, eps=0.0)
    # group 7: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    s7 = math.sqrt(1 / 3)
    # group 3: mean 3, unbiased std sqrt((1 + 1) / 1) = sqrt(2)
    expected = [(2 / 3) / s7, (-1 / 3) / s7, (-1 / 3) / s7, -1 / math.sqrt(2), 1 / math.sqrt(2)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_dr_grpo_only_centres():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
    groups = torch.tensor([7, 7, 7, 3, 3])
    adv = grpo_advantages(rewards, groups, normalize_std=False)
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0], rel=1e-6)


def test_grpo_identical_rewards_and_singleton_groups_give_zero():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 5.0]), torch.tensor([0, 0, 1]), normalize_std=True)
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_token_rewards_put_reward_on_last_token_minus_kl():
    lengths = torch.tensor([2, 0, 3])
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    out = token_rewards(torch.tensor([1.0, 9.0, -1.0]), lengths, torch.ones(5), kl_penalty=kl)
    assert out.tolist() == pytest.approx([-0.1, 1.0 - 0.2, -0.3, -0.4, -1.0 - 0.5])


def test_token_rewards_skip_masked_tokens():
    # sample 0 ends with an observation token: its reward goes on its last action; no KL on masked tokens
    lengths, mask = torch.tensor([3, 2]), torch.tensor([1, 1, 0, 0, 1])
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    out = token_rewards(torch.tensor([1.0, -1.0]), lengths, mask, kl_penalty=kl)
    assert out.tolist() == pytest.approx([-0.1, 1.0 - 0.2, 0.0, 0.0, -1.0 - 0.5])


def test_gae_matches_hand_computation():
    # one sequence of 3 tokens, one of 1 token
    values = torch.tensor([0.5, 0.2, -0.1, 0.3])
    rewards = torch.tensor([0.0, 0.0, 1.0, 2.0])
    gamma, lambd = 0.9, 0.8
    adv, ret = gae(
        rewards=rewards,
        values=values,
        response_lengths=torch.tensor([3, 1]),
        loss_mask=torch.ones(4),
        gamma=gamma,
        lambd=lambd,
    )
    d2 = 1.0 + 0.0 - (-0.1)
    d1 = 0.0 + gamma * (-0.1) - 0.2
    d0 = 0.0 + gamma * 0.2 - 0.5
    a2 = d2
    a1 = d1 + gamma * lambd * a2
    a0 = d0 + gamma * lambd * a1
    a3 = 2.0 - 0.3
    assert adv.tolist() == pytest.approx([a0, a1, a2, a3], rel=1e-6)
    assert ret.tolist() == pytest.approx([a0 + 0.5, a1 + 0.2, a2 - 0.1, a3 + 0.3], rel=1e-6)


def test_gae_gamma_lambda_one_gives_reward_to_go_minus_value():
    values = torch.tensor([0.1, 0.2, 0.3])
    adv, ret = gae(
        rewards=torch.tensor([0.0, 0.0, 1.0]),
        values=values,
        response_lengths=torch.tensor([3]),
        loss_mask=torch.ones(3),
        gamma=1.0,
        lambd=1.0,
    )
    assert adv.tolist() == pytest.approx([0.9, 0.8, 0.7])
    assert ret.tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_gae_masked_token_is_no_step():
    # tokens 0, 2 are actions, token 1 an observation: token 0 bootstraps from V_2 with one discount
    values = torch.tensor([0.5, 9.0, 0.2])
    gamma, lambd = 0.9, 0.8
    adv, ret = gae(
        rewards=torch.tensor([0.0, 0.0, 1.0]),
        values=values,
        response_lengths=torch.tensor([3]),
        loss_mask=torch.tensor([1, 0, 1]),
        gamma=gamma,
        lambd=lambd,
    )
    a2 = 1.0 - 0.2
    a0 = gamma * 0.2 - 0.5 + gamma * lambd * a2
    assert adv.tolist() == pytest.approx([a0, 0.0, a2], rel=1e-6)
    assert ret[[0, 2]].tolist() == pytest.approx([a0 + 0.5, a2 + 0.2], rel=1e-6)


def test_per_token_and_per_sample_sum_round_trip():
    lengths = torch.tensor([2, 1, 0, 3])
    tok = per_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), lengths)
    assert tok.tolist() == [1.0, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert per_sample_sum(tok, lengths).tolist() == [2.0, 2.0, 0.0, 12.0]

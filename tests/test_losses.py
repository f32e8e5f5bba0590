"""Loss pieces against small hand-computed references."""

import math

import pytest
import torch
from scoring_reference import chunked_scores_of_logits

from services.contracts.algorithm_config import RolloutCorrection
from services.trainer.algo.losses import (
    PolicyLossConfig,
    aggregation_weights,
    clipped_value_loss,
    kl_estimate,
    ppo_policy_loss,
)
from services.trainer.algo.rollout_correction import TokenSequences, correct
from services.trainer.algo.scoring import TokenSampling


def _ratios_to_logps(ratios):
    return torch.log(torch.tensor(ratios)), torch.zeros(len(ratios))


def test_ppo_clip_symmetric():
    logp, old = _ratios_to_logps([0.5, 1.1, 1.5, 0.7])
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0])
    loss, clipped, ratio = ppo_policy_loss(
        log_probs=logp, old_log_probs=old, advantages=adv, cfg=PolicyLossConfig(eps_clip=0.2)
    )
    # A>0: max(-r, -clip(r)) ; r=0.5 -> max(-0.5, -0.8) = -0.5 (unclipped wins, pessimistic)
    # r=1.1 inside; r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped); A=-2, r=0.7 -> max(1.4, 1.6) = 1.6 (clipped)
    assert loss.tolist() == pytest.approx([-0.5, -1.1, -1.2, 1.6], rel=1e-6)
    assert clipped.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert ratio.tolist() == pytest.approx([0.5, 1.1, 1.5, 0.7], rel=1e-6)


def test_ppo_clip_asymmetric_high():
    logp, old = _ratios_to_logps([1.25, 1.35, 0.75])
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, clipped, _ = ppo_policy_loss(
        log_probs=logp, old_log_probs=old, advantages=adv, cfg=PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.28)
    )
    # upper bound 1.28: 1.25 inside, 1.35 clipped to 1.28; lower bound 0.8: A<0 r=0.75 -> max(0.75, 0.8)
    assert loss.tolist() == pytest.approx([-1.25, -1.28, 0.8], rel=1e-6)
    assert clipped.tolist() == [0.0, 1.0, 1.0]


def test_ppo_dual_clip_bounds_negative_advantages():
    logp, old = _ratios_to_logps([5.0, 2.0, 5.0])
    adv = torch.tensor([-1.0, -1.0, 1.0])
    loss, clipped, _ = ppo_policy_loss(
        log_probs=logp, old_log_probs=old, advantages=adv, cfg=PolicyLossConfig(eps_clip=0.2, dual_clip_c=3.0)
    )
    # A<0, r=5: standard max(5, 1.2) = 5, dual bound -A*c = 3 -> 3; r=2: max(2, 1.2) = 2 < 3 -> 2
    # A>0, r=5: dual clip does not apply: max(-5, -1.2) = -1.2
    assert loss.tolist() == pytest.approx([3.0, 2.0, -1.2], rel=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 1.0]


def test_ppo_gradient_zero_when_clipped():
    logp = torch.log(torch.tensor([1.5, 1.1])).requires_grad_()
    loss, _, _ = ppo_policy_loss(
        log_probs=logp, old_log_probs=torch.zeros(2), advantages=torch.ones(2), cfg=PolicyLossConfig(eps_clip=0.2)
    )
    loss.sum().backward()
    # d(-r)/d logp = -r inside the clip range, 0 once clipped
    assert logp.grad is not None and logp.grad.tolist() == pytest.approx([0.0, -1.1], rel=1e-6)


def test_aggregation_weights_modes():
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1], dtype=torch.uint8)
    lengths = torch.tensor([3, 4])
    values = torch.tensor([1.0, 2.0, 100.0, 3.0, 4.0, 5.0, 6.0])
    tok = aggregation_weights(mask, lengths, "token_mean")
    assert float((tok * values).sum()) == pytest.approx((1 + 2 + 3 + 4 + 5 + 6) / 6)
    seq = aggregation_weights(mask, lengths, "seq_mean_token_mean")
    assert float((seq * values).sum()) == pytest.approx(((1 + 2) / 2 + (3 + 4 + 5 + 6) / 4) / 2)
    seq_sum = aggregation_weights(mask, lengths, "seq_mean_token_sum")
    assert float((seq_sum * values).sum()) == pytest.approx(((1 + 2) + (3 + 4 + 5 + 6)) / 2)
    assert float(tok[2]) == 0.0 and float(seq[2]) == 0.0


def test_aggregation_skips_fully_masked_sequences():
    mask = torch.tensor([0, 0, 1, 1], dtype=torch.uint8)
    w = aggregation_weights(mask, torch.tensor([2, 2]), "seq_mean_token_mean")
    assert w.tolist() == pytest.approx([0.0, 0.0, 0.5, 0.5])


def test_aggregation_rejects_unknown_mode():
    with pytest.raises(ValueError, match="loss_aggregation"):
        aggregation_weights(torch.ones(2), torch.tensor([2]), "mean")


def test_kl_estimators():
    logp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.4)])
    lr = [math.log(2.0), math.log(0.5)]
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx(lr, rel=1e-6)
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.5 * x * x for x in lr], rel=1e-6)
    # k3 = ref/pi - 1 - log(ref/pi): 0.5 - 1 + log 2, 2 - 1 - log 2
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx(
        [0.5 - 1 + math.log(2), 2 - 1 - math.log(2)], rel=1e-6
    )
    assert kl_estimate(ref, ref, "k3").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k4")


def test_tis_weights_truncate_and_detach():
    old = torch.log(torch.tensor([0.6, 0.3, 0.9])).requires_grad_()
    rollout = torch.log(torch.tensor([0.3, 0.3, 0.1]))
    seqs = TokenSequences.of(torch.tensor([3]), torch.ones(3))
    w = correct(old - rollout, seqs, RolloutCorrection(is_level="token", is_cap=2.0)).weight
    assert w.tolist() == pytest.approx([2.0, 1.0, 2.0], rel=1e-6)  # 0.6/0.3 = 2, 1, 9 -> capped at 2
    assert not w.requires_grad


def test_entropy_and_token_log_probs():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [1.0, 1e-30, 1e-30]]))
    untruncated = TokenSampling.per_row(torch.ones(2), torch.ones(2), torch.zeros(2, dtype=torch.long))
    lp, ent, tempered = chunked_scores_of_logits(logits, torch.tensor([1, 0]), untruncated)
    assert ent.tolist() == pytest.approx([-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)), 0.0], abs=1e-6)
    assert lp.tolist() == pytest.approx([math.log(0.25), 0.0], abs=1e-6) and torch.equal(lp, tempered)


def test_clipped_value_loss():
    values = torch.tensor([1.0, 0.5, 0.0])
    old = torch.tensor([0.0, 0.4, 0.0])
    returns = torch.tensor([1.0, 0.0, 1.0])
    loss, clipped = clipped_value_loss(values=values, old_values=old, returns=returns, clip=0.2)
    # token 0: clipped value 0.2 -> max(0, 0.64) * 0.5; token 1: clipped 0.5 (inside) -> 0.125
    # token 2: V = V_old = 0 -> 0.5
    assert loss.tolist() == pytest.approx([0.32, 0.125, 0.5], rel=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 0.0]

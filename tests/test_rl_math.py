"""Every RL formula against the independent references of rl_reference.py, on random inputs: temperatures
other than 1 with top-p / top-k, mixed sampling settings in one batch, masked interior (tool) tokens."""

from __future__ import annotations

import math
import random

import pytest
import rl_reference as ref
import torch

from services.contracts.config import AlgorithmConfig
from services.contracts.sampling import SamplingSpec
from services.rollout.engines import sampling as rollout_sampling
from services.tensors.sampling import sampling_log_probs
from services.trainer.actor import compute_advantages
from services.trainer.advantages import gae, grpo_advantages, per_token, token_rewards, whiten
from services.trainer.batching import TrainBatch
from services.trainer.losses import PolicyLossConfig, kl_estimate, ppo_policy_loss, tis_weights
from services.trainer.scoring import (
    LOG_PROB_FLOOR,
    TokenSampling,
    entropy_from_log_probs,
    gather_targets,
    sampling_log_prob_table,
    tempered_token_log_probs,
)

VOCAB = 24
SETTINGS = [SamplingSpec(temperature=0.7, top_p=0.9), SamplingSpec(temperature=1.3, top_k=6),
            SamplingSpec(temperature=0.7, top_p=0.6, top_k=10),
            SamplingSpec(temperature=0.0, top_p=0.5), SamplingSpec(temperature=1.0)]


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


def assert_same_log_probs(ours: list[float], theirs: list[float]) -> None:
    assert [math.isinf(x) for x in ours] == [math.isinf(x) for x in theirs]
    assert [x for x in ours if not math.isinf(x)] == pytest.approx([x for x in theirs if not math.isinf(x)], abs=1e-5)


@pytest.mark.parametrize("dist", SETTINGS, ids=str)
def test_sampling_distribution_matches_the_reference(dist):
    logits = random_logits(16, seed=1)
    ours = sampling_log_probs(logits, dist)
    for row, out in zip(logits.tolist(), ours.tolist()):
        assert_same_log_probs(out, ref.sampling_log_probs(row, temperature=dist.temperature, top_p=dist.top_p,
                                                          top_k=dist.top_k))
    assert rollout_sampling.sampling_log_probs is sampling_log_probs   # the rollout samples from this very one


def mixed_sampling(rows: int, seed: int) -> tuple[TokenSampling, list[SamplingSpec]]:
    rng = random.Random(seed)
    chosen = [rng.choice(SETTINGS) for _ in range(rows)]
    return TokenSampling.per_row(torch.tensor([d.temperature for d in chosen]), torch.tensor([d.top_p for d in chosen]),
                                 torch.tensor([d.top_k for d in chosen])), chosen


def test_trainer_scores_each_row_under_its_own_distribution():
    logits = random_logits(40, seed=2).requires_grad_()
    sampling, chosen = mixed_sampling(40, seed=2)
    table = sampling_log_prob_table(logits, sampling)
    targets = torch.tensor([random.Random(i).randrange(VOCAB) for i in range(40)])
    tempered = tempered_token_log_probs(logits, targets, sampling.temperature)
    entropy = entropy_from_log_probs(table)
    for i, (row, d) in enumerate(zip(logits.tolist(), chosen)):
        expected = ref.sampling_log_probs(row, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k)
        assert_same_log_probs(table[i].tolist(), expected)
        assert entropy[i].item() == pytest.approx(ref.entropy(expected), abs=1e-5)
        untruncated = ref.sampling_log_probs(row, temperature=d.temperature, top_p=1.0, top_k=0)
        assert tempered[i].item() == pytest.approx(untruncated[targets[i]], abs=1e-5)
    scored = gather_targets(table, targets)
    assert scored.min() >= LOG_PROB_FLOOR   # a token outside the nucleus is floored, not -inf
    (scored.sum() + entropy.sum() + tempered.sum()).backward()
    assert torch.isfinite(logits.grad).all()   # truncated entries pass no NaN gradient
    assert sampling.truncates(VOCAB) and not TokenSampling.per_row(
        torch.tensor([0.0, 0.5]), torch.tensor([0.5, 1.0]), torch.tensor([3, 0])).truncates(VOCAB)


def test_ppo_loss_matches_the_reference_on_random_tokens():
    gen = torch.Generator().manual_seed(3)
    logp, old = -torch.rand(200, generator=gen) * 3, -torch.rand(200, generator=gen) * 3
    adv = torch.randn(200, generator=gen)
    for cfg in (PolicyLossConfig(eps_clip=0.2), PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.28, dual_clip_c=3.0)):
        loss, clipped, ratio = ppo_policy_loss(log_probs=logp, old_log_probs=old, advantages=adv, cfg=cfg)
        high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
        for i in range(200):
            r_loss, r_ratio, r_clip = ref.ppo_loss(log_prob=float(logp[i]), old_log_prob=float(old[i]),
                                                    advantage=float(adv[i]), eps_low=cfg.eps_clip, eps_high=high,
                                                    dual_clip_c=cfg.dual_clip_c)
            assert (loss[i].item(), ratio[i].item(), clipped[i].item()) == pytest.approx((r_loss, r_ratio, r_clip),
                                                                                         rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_the_reference(estimator):
    gen = torch.Generator().manual_seed(4)
    logp, ref_lp = -torch.rand(100, generator=gen) * 4, -torch.rand(100, generator=gen) * 4
    ours = kl_estimate(logp, ref_lp, estimator)
    assert ours.tolist() == pytest.approx([ref.kl(a, b, estimator) for a, b in zip(logp.tolist(), ref_lp.tolist())],
                                          rel=1e-5, abs=1e-6)
    if estimator == "k3":   # not clamped to [-10, 10] as verl's low_var_kl: a far-away policy shows
        assert kl_estimate(torch.tensor([0.0]), torch.tensor([-15.0]), "k3").item() == pytest.approx(14.0, rel=1e-4)


def test_tis_matches_the_reference():
    gen = torch.Generator().manual_seed(5)
    old, rollout = -torch.rand(100, generator=gen) * 3, -torch.rand(100, generator=gen) * 3
    ours = tis_weights(old_log_probs=old, rollout_log_probs=rollout, clip=2.0)
    assert ours.tolist() == pytest.approx([ref.tis_weight(old_log_prob=a, rollout_log_prob=b, clip=2.0)
                                           for a, b in zip(old.tolist(), rollout.tolist())], rel=1e-5)


def random_sequences(seed: int, n: int = 6) -> tuple[list[int], list[list[int]], list[float]]:
    """Lengths, loss masks with masked interior (tool) tokens and a masked tail on some, rewards."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, 9) for _ in range(n)]
    masks = []
    for length in lengths:
        mask = [1 if rng.random() > 0.35 else 0 for _ in range(length)]
        mask[0] = 1
        masks.append(mask)
    return lengths, masks, [rng.uniform(-1, 2) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_gae_matches_verl_with_masked_interior_tokens_and_kl_shaping(seed):
    lengths, masks, rewards = random_sequences(seed)
    rng = random.Random(100 + seed)
    values = [[rng.uniform(-1, 1) for _ in range(n)] for n in lengths]
    kl = [[rng.uniform(0, 0.3) for _ in range(n)] for n in lengths]
    gamma, lambd = rng.uniform(0.8, 1.0), rng.uniform(0.8, 1.0)
    flat_mask = torch.tensor([m for ms in masks for m in ms], dtype=torch.float32)
    shaped = token_rewards(torch.tensor(rewards), torch.tensor(lengths), flat_mask,
                           kl_penalty=torch.tensor([k for ks in kl for k in ks]))
    adv, ret = gae(rewards=shaped, values=torch.tensor([v for vs in values for v in vs]),
                   response_lengths=torch.tensor(lengths), loss_mask=flat_mask, gamma=gamma, lambd=lambd)
    expected_adv, expected_ret = [], []
    for r, v, m, k in zip(rewards, values, masks, kl):
        a, rt = ref.gae_sequence(reward=r, values=v, mask=m, kl_penalty=k, gamma=gamma, lambd=lambd)
        expected_adv += a
        expected_ret += rt
    assert adv.tolist() == pytest.approx(expected_adv, rel=1e-5, abs=1e-6)
    trainable = flat_mask.bool()
    assert ret[trainable].tolist() == pytest.approx([x for x, m in zip(expected_ret, flat_mask) if m],
                                                    rel=1e-5, abs=1e-6)


def test_whitening_matches_verl():
    lengths, masks, _ = random_sequences(7, n=8)
    flat = [m for ms in masks for m in ms]
    values = torch.randn(len(flat), generator=torch.Generator().manual_seed(7))
    assert whiten(values, torch.tensor(flat)).tolist() == pytest.approx(ref.whiten(values.tolist(), flat),
                                                                        rel=1e-5, abs=1e-6)


def test_grpo_advantages_match_the_reference():
    rng = random.Random(8)
    rewards = [float(rng.randint(0, 3)) for _ in range(24)]
    groups = [rng.choice([3, 11, 40, 41]) for _ in range(24)]
    for normalize in (True, False):
        ours = grpo_advantages(torch.tensor(rewards), torch.tensor(groups), normalize_std=normalize)
        assert ours.tolist() == pytest.approx(ref.grpo_advantages(rewards, groups, normalize_std=normalize),
                                              rel=1e-5, abs=1e-6)


def _train_batch(lengths: list[int], masks: list[list[int]], rewards: list[float], values: list[float]) -> TrainBatch:
    n = len(lengths)
    resp = torch.tensor(lengths)
    return TrainBatch(tokens=torch.zeros(int(resp.sum()) + n, dtype=torch.long),
                      prompt_lengths=torch.ones(n, dtype=torch.long), response_lengths=resp,
                      loss_mask=torch.tensor([m for ms in masks for m in ms], dtype=torch.float32),
                      rollout_log_probs=torch.zeros(int(resp.sum())), rewards=torch.tensor(rewards),
                      group_ids=torch.arange(n), sample_versions=torch.zeros(n, dtype=torch.long),
                      sampling_temperature=torch.ones(n), sampling_top_p=torch.ones(n),
                      sampling_top_k=torch.zeros(n, dtype=torch.long), values=torch.tensor(values))


def test_actor_advantages_with_kl_reward_and_whitening_match_the_reference():
    """The actor's PPO advantages: KL charged on trainable tokens only, masked tokens no steps, whitened."""
    lengths, masks, rewards = random_sequences(9)
    rng = random.Random(9)
    values = [[rng.uniform(-1, 1) for _ in range(n)] for n in lengths]
    kl_penalty = torch.tensor([rng.uniform(0, 0.2) for n in lengths for _ in range(n)])
    batch = _train_batch(lengths, masks, rewards, [v for vs in values for v in vs])
    algo = AlgorithmConfig(advantage_estimator="gae", gamma=0.95, lambd=0.9, whiten_advantages=True)
    ours = compute_advantages(batch, algo, kl_penalty)
    raw, offset = [], 0
    for r, v, m in zip(rewards, values, masks):
        a, _ = ref.gae_sequence(reward=r, values=v, mask=m, kl_penalty=kl_penalty[offset:offset + len(m)].tolist(),
                                gamma=0.95, lambd=0.9)
        raw += a
        offset += len(m)
    flat_mask = [m for ms in masks for m in ms]
    assert ours.tolist() == pytest.approx(ref.whiten(raw, flat_mask), rel=1e-4, abs=1e-5)
    grpo = compute_advantages(batch, AlgorithmConfig(), kl_penalty)
    sums = [sum(k for k, m in zip(kl_penalty[o:o + n].tolist(), ms) if m)
            for o, n, ms in zip([sum(lengths[:i]) for i in range(len(lengths))], lengths, masks)]
    expected = ref.grpo_advantages([r - s for r, s in zip(rewards, sums)], list(range(len(rewards))),
                                   normalize_std=True)
    assert grpo.tolist() == pytest.approx(per_token(torch.tensor(expected), torch.tensor(lengths)).tolist(), abs=1e-6)

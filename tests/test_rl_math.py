"""Every RL formula against the independent references of rl_reference.py, on random inputs: temperatures
other than 1 with top-p / top-k, mixed sampling settings in one batch, masked interior (tool) tokens; the estimators
and losses of issue 25 (RLOO, REINFORCE++, REINFORCE++-baseline, GSPO) with a one-line test per edge-case decision."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import rl_reference as ref
import torch
from scoring_reference import chunked_scores_of_logits

from services.contracts.algorithm_config import RolloutCorrection
from services.contracts.config import AlgorithmConfig
from services.contracts.sampling_spec import SamplingSpec
from services.rollout.engines.native import sampler as rollout_sampling
from services.tensors.sampling_dist import sampling_log_probs
from services.trainer.algo.actor import TokenInputs, policy_loss_terms
from services.trainer.algo.advantages import (
    discounted_returns,
    gae,
    grpo_advantages,
    per_token,
    rloo_advantages,
    token_rewards,
    whiten,
)
from services.trainer.algo.estimators import compute_advantages
from services.trainer.algo.losses import (
    PolicyLossConfig,
    Sequences,
    aggregation_weights,
    gspo_policy_loss,
    kl_estimate,
    ppo_policy_loss,
)
from services.trainer.algo.rollout_correction import TokenSequences, correct
from services.trainer.algo.scoring import LOG_PROB_FLOOR, TokenSampling
from services.trainer.batching import MicroBatch, TrainBatch
from services.trainer.update import TokenWeights

VOCAB = 24
SETTINGS = [
    SamplingSpec(temperature=0.7, top_p=0.9),
    SamplingSpec(temperature=1.3, top_k=6),
    SamplingSpec(temperature=0.7, top_p=0.6, top_k=10),
    SamplingSpec(temperature=0.0, top_p=0.5),
    SamplingSpec(temperature=1.0),
]


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


def assert_same_log_probs(ours: list[float], theirs: list[float]) -> None:
    assert [math.isinf(x) for x in ours] == [math.isinf(x) for x in theirs]
    assert [x for x in ours if not math.isinf(x)] == pytest.approx([x for x in theirs if not math.isinf(x)], abs=1e-5)


@pytest.mark.parametrize("dist", SETTINGS, ids=str)
def test_sampling_distribution_matches_the_reference(dist):
    logits = random_logits(16, seed=1)
    ours = sampling_log_probs(logits, dist)
    for row, out in zip(logits.tolist(), ours.tolist(), strict=True):
        assert_same_log_probs(
            out, ref.sampling_log_probs(row, temperature=dist.temperature, top_p=dist.top_p, top_k=dist.top_k)
        )
    assert rollout_sampling.sampling_log_probs is sampling_log_probs  # the rollout samples from this very one


def mixed_sampling(rows: int, seed: int) -> tuple[TokenSampling, list[SamplingSpec]]:
    rng = random.Random(seed)
    chosen = [rng.choice(SETTINGS) for _ in range(rows)]
    return TokenSampling.per_row(
        torch.tensor([d.temperature for d in chosen]),
        torch.tensor([d.top_p for d in chosen]),
        torch.tensor([d.top_k for d in chosen]),
    ), chosen


def test_trainer_scores_each_row_under_its_own_distribution():
    """The chunked scoring head (7-token chunks) on mixed rows: each row's log-prob, entropy and tempered log-prob
    are the reference's."""
    logits = random_logits(40, seed=2).requires_grad_()
    sampling, chosen = mixed_sampling(40, seed=2)
    targets = torch.tensor([random.Random(i).randrange(VOCAB) for i in range(40)])
    scored, entropy, tempered = chunked_scores_of_logits(logits, targets, sampling)
    for i, (row, d) in enumerate(zip(logits.tolist(), chosen, strict=True)):
        expected = ref.sampling_log_probs(row, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k)
        assert scored[i].item() == pytest.approx(max(expected[targets[i]], LOG_PROB_FLOOR), abs=1e-5)
        assert entropy[i].item() == pytest.approx(ref.entropy(expected), abs=1e-5)
        untruncated = ref.sampling_log_probs(row, temperature=d.temperature, top_p=1.0, top_k=0)
        assert tempered[i].item() == pytest.approx(untruncated[targets[i]], abs=1e-5)
    assert scored.min() == LOG_PROB_FLOOR  # a token outside the nucleus is floored, not -inf
    (scored.sum() + entropy.sum() + tempered.sum()).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()  # truncated entries pass no NaN gradient
    assert (
        sampling.rows(VOCAB).truncates
        and not TokenSampling.per_row(torch.tensor([0.0, 0.5]), torch.tensor([0.5, 1.0]), torch.tensor([3, 0]))
        .rows(VOCAB)
        .truncates
    )


def test_truncation_with_ties_keeps_the_references_support():
    """Logits on a coarse grid (bf16's rounding, only more so) tie often: top-k keeps every tie with the k-th, top-p
    every tie with its last kept logit; with top-k set, the nucleus is found among the top k alone (ties with the
    k-th beyond them included)."""
    logits = torch.round(random_logits(64, seed=9)) / 2
    ordered = logits.sort(dim=-1, descending=True).values
    assert int((ordered[:, 4] == ordered[:, 5]).sum()) > 10  # ties at the 5th value: the case under test
    for dist in (
        SamplingSpec(temperature=1.0, top_k=5),
        SamplingSpec(temperature=1.0, top_p=0.5),
        SamplingSpec(temperature=1.0, top_p=0.7, top_k=8),
        SamplingSpec(temperature=1.0, top_p=0.99, top_k=3),
    ):
        ours = sampling_log_probs(logits, dist)
        for row, out in zip(logits.tolist(), ours.tolist(), strict=True):
            assert_same_log_probs(out, ref.sampling_log_probs(row, temperature=1.0, top_p=dist.top_p, top_k=dist.top_k))


def test_ppo_loss_matches_the_reference_on_random_tokens():
    gen = torch.Generator().manual_seed(3)
    logp, old = -torch.rand(200, generator=gen) * 3, -torch.rand(200, generator=gen) * 3
    adv = torch.randn(200, generator=gen)
    for cfg in (PolicyLossConfig(eps_clip=0.2), PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.28, dual_clip_c=3.0)):
        loss, clipped, ratio = ppo_policy_loss(log_probs=logp, old_log_probs=old, advantages=adv, cfg=cfg)
        high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
        for i in range(200):
            r_loss, r_ratio, r_clip = ref.ppo_loss(
                log_prob=float(logp[i]),
                old_log_prob=float(old[i]),
                advantage=float(adv[i]),
                eps_low=cfg.eps_clip,
                eps_high=high,
                dual_clip_c=cfg.dual_clip_c,
            )
            assert (loss[i].item(), ratio[i].item(), clipped[i].item()) == pytest.approx(
                (r_loss, r_ratio, r_clip), rel=1e-5, abs=1e-6
            )


def _token_micro_batch(n: int, lengths: list[int]) -> MicroBatch:
    """A micro-batch of len(lengths) sequences of n tokens in all."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.cat([torch.arange(k) for k in lengths])
    return MicroBatch(
        input_ids=torch.zeros(len(lengths), max(lengths) + 1, dtype=torch.long),
        attention_mask=torch.ones(len(lengths), max(lengths) + 1, dtype=torch.long),
        rows=rows,
        positions=positions,
        targets=torch.zeros(n, dtype=torch.long),
        token_index=torch.arange(n),
        num_tokens=n + len(lengths),
    )


@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_decoupled_ppo_matches_areal_with_each_tokens_own_behaviour_log_prob(dual_clip_c):
    """tis_mode: mask is AReaL's decoupled PPO: the surrogate clipped against the proximal policy (the trainer's
    policy before the step), times exp(prox - behav) with behav each token's own rollout log-prob, 0 above the cap.
    Random tokens of 8 samples whose later tokens were sampled after a mid-generation sync: their behaviour log-probs
    come from another policy (far off for some, so some weights pass the cap)."""
    gen = torch.Generator().manual_seed(11)
    lengths = [25] * 8
    n = sum(lengths)
    mb = _token_micro_batch(n, lengths)
    logp, prox = -torch.rand(n, generator=gen) * 3, -torch.rand(n, generator=gen) * 3
    after_sync = (torch.arange(n) % 25) >= 10
    behav = torch.where(after_sync, prox - torch.randn(n, generator=gen), prox + 0.05 * torch.randn(n, generator=gen))
    adv = torch.randn(n, generator=gen)
    inputs = TokenInputs(
        sampling=TokenSampling.per_row(torch.ones(8), torch.ones(8), torch.zeros(8), lengths=torch.tensor(lengths)),
        advantages=adv,
        rollout_log_probs=behav,
        loss_mask=torch.ones(n),
        weights=TokenWeights(loss=torch.ones(n) / n, mean=torch.ones(n) / n),
        ref_log_probs=None,
        old=None,
        samples=TokenSequences.of(torch.tensor(lengths), torch.ones(n)),
        observed_log_ratio=torch.zeros(n),
    )
    algo = AlgorithmConfig.model_validate(  # the older spelling, as configs still write it
        {
            "use_rollout_logprobs": False,
            "use_tis": True,
            "tis_mode": "mask",
            "tis_clip": 2.0,
            "eps_clip": 0.2,
            "eps_clip_high": 0.28,
            "dual_clip_c": dual_clip_c,
        }
    )
    pg, _, ratio, tis = policy_loss_terms(logp=logp, behaviour=prox, rollout_lp=behav, mb=mb, inputs=inputs, algo=algo)
    expected = [
        ref.decoupled_ppo_loss(
            log_prob=a,
            prox_log_prob=b,
            behav_log_prob=c,
            advantage=d,
            eps_low=0.2,
            eps_high=0.28,
            dual_clip_c=dual_clip_c,
            cap=2.0,
        )
        for a, b, c, d in zip(logp.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), strict=True)
    ]
    assert pg.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert ratio.tolist() == pytest.approx((logp - prox).exp().tolist(), rel=1e-5)  # against prox, not behav
    masked = tis == 0
    assert masked[after_sync].any() and not masked[~after_sync].any()  # only far-off in-flight tokens pass the cap
    truncate = RolloutCorrection(is_level="token", is_cap=2.0)  # miles' TIS keeps them at 2
    truncated = correct(prox - behav, inputs.samples, truncate).weight
    assert truncated[masked].tolist() == [2.0] * int(masked.sum())


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_the_reference(estimator):
    gen = torch.Generator().manual_seed(4)
    logp, ref_lp = -torch.rand(100, generator=gen) * 4, -torch.rand(100, generator=gen) * 4
    ours = kl_estimate(logp, ref_lp, estimator)
    expected = [ref.kl(a, b, estimator) for a, b in zip(logp.tolist(), ref_lp.tolist(), strict=True)]
    assert ours.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    if estimator == "k3":  # not clamped to [-10, 10] as verl's low_var_kl: a far-away policy shows
        assert kl_estimate(torch.tensor([0.0]), torch.tensor([-15.0]), "k3").item() == pytest.approx(14.0, rel=1e-4)


def test_tis_matches_the_reference():
    gen = torch.Generator().manual_seed(5)
    old, rollout = -torch.rand(100, generator=gen) * 3, -torch.rand(100, generator=gen) * 3
    seqs = TokenSequences.of(torch.tensor([100]), torch.ones(100))
    ours = correct(old - rollout, seqs, RolloutCorrection(is_level="token", is_cap=2.0)).weight
    assert ours.tolist() == pytest.approx(
        [
            ref.tis_weight(old_log_prob=a, rollout_log_prob=b, clip=2.0)
            for a, b in zip(old.tolist(), rollout.tolist(), strict=True)
        ],
        rel=1e-5,
    )


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
    shaped = token_rewards(
        torch.tensor(rewards), torch.tensor(lengths), flat_mask, kl_penalty=torch.tensor([k for ks in kl for k in ks])
    )
    adv, ret = gae(
        rewards=shaped,
        values=torch.tensor([v for vs in values for v in vs]),
        response_lengths=torch.tensor(lengths),
        loss_mask=flat_mask,
        gamma=gamma,
        lambd=lambd,
    )
    expected_adv, expected_ret = [], []
    for r, v, m, k in zip(rewards, values, masks, kl, strict=True):
        a, rt = ref.gae_sequence(reward=r, values=v, mask=m, kl_penalty=k, gamma=gamma, lambd=lambd)
        expected_adv += a
        expected_ret += rt
    assert adv.tolist() == pytest.approx(expected_adv, rel=1e-5, abs=1e-6)
    trainable = flat_mask.bool()
    assert ret[trainable].tolist() == pytest.approx(
        [x for x, m in zip(expected_ret, flat_mask, strict=True) if m], rel=1e-5, abs=1e-6
    )


def test_whitening_matches_verl():
    _lengths, masks, _ = random_sequences(7, n=8)
    flat = [m for ms in masks for m in ms]
    values = torch.randn(len(flat), generator=torch.Generator().manual_seed(7))
    assert whiten(values, torch.tensor(flat)).tolist() == pytest.approx(
        ref.whiten(values.tolist(), flat), rel=1e-5, abs=1e-6
    )


def test_grpo_advantages_match_the_reference():
    rng = random.Random(8)
    rewards = [float(rng.randint(0, 3)) for _ in range(24)]
    groups = [rng.choice([3, 11, 40, 41]) for _ in range(24)]
    for normalize in (True, False):
        ours = grpo_advantages(torch.tensor(rewards), torch.tensor(groups), normalize_std=normalize)
        assert ours.tolist() == pytest.approx(
            ref.grpo_advantages(rewards, groups, normalize_std=normalize), rel=1e-5, abs=1e-6
        )


def _train_batch(lengths: list[int], masks: list[list[int]], rewards: list[float], values: list[float]) -> TrainBatch:
    n = len(lengths)
    resp = torch.tensor(lengths)
    return TrainBatch(
        tokens=torch.zeros(int(resp.sum()) + n, dtype=torch.long),
        prompt_lengths=torch.ones(n, dtype=torch.long),
        response_lengths=resp,
        loss_mask=torch.tensor([m for ms in masks for m in ms], dtype=torch.float32),
        rollout_log_probs=torch.zeros(int(resp.sum())),
        rewards=torch.tensor(rewards),
        group_ids=torch.arange(n),
        sample_versions=torch.zeros(n, dtype=torch.long),
        sampling_temperature=torch.ones(n),
        sampling_top_p=torch.ones(n),
        sampling_top_k=torch.zeros(n, dtype=torch.long),
        values=torch.tensor(values),
    )


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
    for r, v, m in zip(rewards, values, masks, strict=True):
        a, _ = ref.gae_sequence(
            reward=r, values=v, mask=m, kl_penalty=kl_penalty[offset : offset + len(m)].tolist(), gamma=0.95, lambd=0.9
        )
        raw += a
        offset += len(m)
    flat_mask = [m for ms in masks for m in ms]
    assert ours.tolist() == pytest.approx(ref.whiten(raw, flat_mask), rel=1e-4, abs=1e-5)
    grpo = compute_advantages(batch, AlgorithmConfig(), kl_penalty)
    sums = [
        sum(k for k, m in zip(kl_penalty[o : o + n].tolist(), ms, strict=True) if m)
        for o, n, ms in zip([sum(lengths[:i]) for i in range(len(lengths))], lengths, masks, strict=True)
    ]
    expected = ref.grpo_advantages(
        [r - s for r, s in zip(rewards, sums, strict=True)], list(range(len(rewards))), normalize_std=True
    )
    assert grpo.tolist() == pytest.approx(per_token(torch.tensor(expected), torch.tensor(lengths)).tolist(), abs=1e-6)


# ---- issue 25: RLOO, REINFORCE++, REINFORCE++-baseline, GSPO --------------------------------------------------------


def random_groups(seed: int, n: int = 24) -> tuple[list[float], list[int]]:
    """Rewards and group ids with groups of different sizes, a group of one among them."""
    rng = random.Random(seed)
    groups = [rng.choice([3, 11, 40]) for _ in range(n - 1)] + [99]
    return [rng.uniform(-1, 2) for _ in range(n)], groups


def test_rloo_matches_the_reference():
    rewards, groups = random_groups(20)
    ours = rloo_advantages(torch.tensor(rewards), torch.tensor(groups))
    assert ours.tolist() == pytest.approx(ref.rloo_advantages(rewards, groups), rel=1e-5, abs=1e-6)


def test_rloo_group_of_one_gets_zero_not_its_raw_reward():  # TRL, slime, verl's vectorised RLOO; not verl's loop
    assert rloo_advantages(torch.tensor([0.7, 1.0, 0.0]), torch.tensor([5, 6, 6])).tolist() == [0.0, 1.0, -1.0]


@pytest.mark.parametrize("seed", range(4))
def test_reinforce_pp_returns_match_the_reference_with_masked_tokens_and_kl(seed):
    lengths, masks, rewards = random_sequences(30 + seed)
    rng = random.Random(seed)
    kl = [[rng.uniform(0, 0.3) for _ in range(n)] for n in lengths]
    gamma = rng.uniform(0.8, 1.0)
    flat_mask = torch.tensor([m for ms in masks for m in ms], dtype=torch.float32)
    shaped = token_rewards(
        torch.tensor(rewards), torch.tensor(lengths), flat_mask, kl_penalty=torch.tensor([k for ks in kl for k in ks])
    )
    ours = discounted_returns(rewards=shaped, response_lengths=torch.tensor(lengths), loss_mask=flat_mask, gamma=gamma)
    expected = [
        g
        for r, m, k in zip(rewards, masks, kl, strict=True)
        for g in ref.reinforce_pp_returns(reward=r, mask=m, kl_penalty=k, gamma=gamma)
    ]
    assert ours.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_reinforce_pp_masked_tokens_are_no_steps():
    """Reward 1 after an observation token: the action before it gets gamma^1 (one action later), as GAE; slime /
    OpenRLHF discount the observation too (gamma^2); verl's reset gives it nothing. With gamma 1 ours is slime's."""
    mask, lengths = [1, 0, 1], torch.tensor([3])
    ours = discounted_returns(
        rewards=torch.tensor([0.0, 0.0, 1.0]), response_lengths=lengths, loss_mask=torch.tensor(mask), gamma=0.5
    )
    assert ours.tolist() == [0.5, 0.0, 1.0]
    assert ref.reinforce_pp_returns(reward=1.0, mask=mask, kl_penalty=None, gamma=0.5, masked="through")[0] == 0.25
    assert ref.reinforce_pp_returns(reward=1.0, mask=mask, kl_penalty=None, gamma=0.5, masked="reset")[0] == 0.0
    undiscounted = discounted_returns(
        rewards=torch.tensor([0.0, 0.0, 1.0]), response_lengths=lengths, loss_mask=torch.tensor(mask), gamma=1.0
    )
    assert undiscounted[[0, 2]].tolist() == [
        x
        for x, m in zip(
            ref.reinforce_pp_returns(reward=1.0, mask=mask, kl_penalty=None, gamma=1.0, masked="through"),
            mask,
            strict=True,
        )
        if m
    ]


def test_whitening_variance_is_unbiased_not_openrlhfs_biased():
    ours = whiten(torch.tensor([0.0, 2.0]), torch.ones(2), eps=0.0)
    assert ours.tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])  # var = 2 over n - 1 = 1
    assert ref.whiten_biased([0.0, 2.0], [1, 1], eps=0.0) == pytest.approx([-1.0, 1.0])  # var = 1 over n = 2


def grouped_batch(seed: int) -> tuple[TrainBatch, list[int], list[list[int]], list[float], list[int]]:
    """A batch of 8 samples in groups of 4, 3 and 1, with masked interior tokens."""
    lengths, masks, rewards = random_sequences(seed, n=8)
    groups = [0, 0, 0, 0, 1, 1, 1, 2]
    batch = dataclasses.replace(
        _train_batch(lengths, masks, rewards, [0.0] * sum(lengths)), group_ids=torch.tensor(groups)
    )
    return batch, lengths, masks, rewards, groups


def kl_sums(kl_penalty: torch.Tensor, lengths: list[int], masks: list[list[int]]) -> list[float]:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [
        sum(k for k, m in zip(kl_penalty[o : o + n].tolist(), ms, strict=True) if m)
        for o, n, ms in zip(starts, lengths, masks, strict=True)
    ]


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp_baseline", "reinforce_pp"])
def test_actor_advantages_of_the_new_estimators_with_kl_reward_match_the_reference(estimator):
    batch, lengths, masks, rewards, groups = grouped_batch(40)
    rng = random.Random(41)
    kl_penalty = torch.tensor([rng.uniform(0, 0.2) for _ in range(batch.num_response_tokens)])
    gamma = {"gamma": 0.9} if estimator == "reinforce_pp" else {}
    ours = compute_advantages(batch, AlgorithmConfig(advantage_estimator=estimator, **gamma), kl_penalty)
    flat_mask = [m for ms in masks for m in ms]
    shaped = [r - s for r, s in zip(rewards, kl_sums(kl_penalty, lengths, masks), strict=True)]
    if estimator == "rloo":
        expected = [a for a, n in zip(ref.rloo_advantages(shaped, groups), lengths, strict=True) for _ in range(n)]
    elif estimator == "reinforce_pp_baseline":  # Dr.GRPO's centring, then whitened over the batch's tokens
        centred = ref.grpo_advantages(shaped, groups, normalize_std=False)
        expected = ref.whiten([a for a, n in zip(centred, lengths, strict=True) for _ in range(n)], flat_mask)
    else:  # KL per token, discounted; whitened over the batch's tokens
        offsets = [sum(lengths[:i]) for i in range(len(lengths))]
        returns = [
            g
            for r, m, o in zip(rewards, masks, offsets, strict=True)
            for g in ref.reinforce_pp_returns(
                reward=r, mask=m, kl_penalty=kl_penalty[o : o + len(m)].tolist(), gamma=0.9
            )
        ]
        expected = ref.whiten(returns, flat_mask)
    assert ours.tolist() == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_reinforce_pp_baseline_group_of_one_is_treated_as_a_group_of_equal_rewards():
    """Its centred advantage is 0 (slime; verl keeps the raw reward), so whitening moves it where it moves a sample
    of a group whose rewards are all equal."""
    lengths = [3, 1, 2, 2, 2]  # unequal, so the token mean of the centred advantages is not 0
    batch = dataclasses.replace(
        _train_batch(lengths, [[1] * n for n in lengths], [1.0, 0.0, 1.0, 1.0, 5.0], [0.0] * 10),
        group_ids=torch.tensor([0, 0, 1, 1, 2]),
    )
    adv = compute_advantages(batch, AlgorithmConfig(advantage_estimator="reinforce_pp_baseline"), None)
    assert adv[8].item() == pytest.approx(adv[4].item()) and adv[8].item() != 0.0


def test_gspo_matches_the_sequence_form_on_random_sequences():
    """Loss, ratio, clip fraction and the gradient of the aggregated loss: the GSPO-token form (ours) against GSPO's
    sequence objective differentiated through s (reference), under seq_mean_token_mean (the paper's) and
    token_mean (TRL's GSPO with its token-mean loss types)."""
    lengths, masks, _ = random_sequences(50, n=10)
    gen = torch.Generator().manual_seed(50)
    n_tok = sum(lengths)
    logp = (-torch.rand(n_tok, generator=gen) * 2).requires_grad_()
    old = logp.detach() + torch.randn(n_tok, generator=gen) * 0.15
    seq_adv = torch.randn(len(lengths), generator=gen)
    flat_mask = torch.tensor([m for ms in masks for m in ms], dtype=torch.float32)
    seqs = Sequences(
        ids=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
        count=len(lengths),
        trainable=flat_mask > 0,
    )
    cfg = PolicyLossConfig(eps_clip=0.05, eps_clip_high=0.08, dual_clip_c=1.02)
    loss, clipped, ratio = gspo_policy_loss(
        log_probs=logp, old_log_probs=old, advantages=per_token(seq_adv, torch.tensor(lengths)), sequences=seqs, cfg=cfg
    )
    rows, offset = [], 0
    for n, m, a in zip(lengths, masks, seq_adv.tolist(), strict=True):
        rows.append(
            ref.gspo_sequence(
                log_probs=logp[offset : offset + n].tolist(),
                old_log_probs=old[offset : offset + n].tolist(),
                advantage=a,
                mask=m,
                eps_low=0.05,
                eps_high=0.08,
                dual_clip_c=1.02,
            )
        )
        offset += n
    assert 0 < sum(r[2] for r in rows) < len(rows)  # some sequences clip, some do not
    per_tok = [x for r, n in zip(rows, lengths, strict=True) for _ in range(n) for x in r[:3]]  # (L, s, clipped)
    trainable = flat_mask.bool()
    assert torch.stack([loss, ratio, clipped], 1)[trainable].flatten().tolist() == pytest.approx(
        [x for i, x in enumerate(per_tok) if flat_mask[i // 3]], rel=1e-5, abs=1e-6
    )
    sizes = [sum(m) for m in masks]
    for mode, seq_weight in (
        ("seq_mean_token_mean", [1 / len(lengths)] * len(lengths)),  # 1/G sum_i L_i
        ("token_mean", [k / sum(sizes) for k in sizes]),
    ):  # sum_i |y_i| L_i / N
        w = aggregation_weights(flat_mask, torch.tensor(lengths), mode)
        (grad,) = torch.autograd.grad((w * loss).sum(), logp, retain_graph=True)
        expected = [g * c for r, c in zip(rows, seq_weight, strict=True) for g in r[3]]
        objective = sum(r[0] * c for r, c in zip(rows, seq_weight, strict=True))
        assert float((w * loss).sum().detach()) == pytest.approx(objective)
        assert grad.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_gspo_on_one_token_sequences_is_ppo():
    gen = torch.Generator().manual_seed(51)
    logp, old, adv = -torch.rand(50, generator=gen), -torch.rand(50, generator=gen), torch.randn(50, generator=gen)
    cfg = PolicyLossConfig(eps_clip=0.2, dual_clip_c=3.0)
    one_each = Sequences(ids=torch.arange(50), count=50, trainable=torch.ones(50, dtype=torch.bool))
    gspo = gspo_policy_loss(log_probs=logp, old_log_probs=old, advantages=adv, sequences=one_each, cfg=cfg)
    ppo = ppo_policy_loss(log_probs=logp, old_log_probs=old, advantages=adv, cfg=cfg)
    assert all(torch.allclose(a, b) for a, b in zip(gspo, ppo, strict=True))


def test_gspo_log_ratio_is_capped_at_20_both_ways_and_stops_the_gradient_there():  # verl +10 only, TRL none
    logp = torch.tensor([30.0, 30.0, -30.0]).requires_grad_()
    seqs = Sequences(ids=torch.tensor([0, 0, 1]), count=2, trainable=torch.ones(3, dtype=torch.bool))
    loss, _, ratio = gspo_policy_loss(
        log_probs=logp,
        old_log_probs=torch.zeros(3),
        advantages=-torch.ones(3),
        sequences=seqs,
        cfg=PolicyLossConfig(eps_clip=0.2),
    )
    assert ratio.tolist() == pytest.approx([math.exp(20)] * 2 + [math.exp(-20)], rel=1e-5)
    assert torch.autograd.grad(loss.sum(), logp)[0].tolist() == [0.0, 0.0, 0.0]


def test_gspo_tis_weight_is_the_sequences_geometric_mean():
    """policy_loss_terms on a micro-batch of two sequences (a masked token in the first): every trainable token of a
    sequence gets the capped geometric-mean weight of the sequence (slime would weight each token by its own)."""
    lengths, mask = torch.tensor([3, 2]), torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    behaviour, rollout = torch.tensor([-1.0, -9.0, -2.0, -0.5, -0.5]), torch.tensor([-1.5, 0.0, -1.7, -2.0, -1.6])
    mb = MicroBatch(
        input_ids=torch.zeros(2, 4, dtype=torch.long),
        attention_mask=torch.ones(2, 4, dtype=torch.long),
        rows=torch.tensor([0, 0, 0, 1, 1]),
        positions=torch.tensor([0, 1, 2, 0, 1]),
        targets=torch.zeros(5, dtype=torch.long),
        token_index=torch.arange(5),
        num_tokens=8,
    )
    inputs = TokenInputs(
        sampling=TokenSampling.per_row(torch.ones(2), torch.ones(2), torch.zeros(2), lengths=lengths),
        advantages=torch.ones(5),
        rollout_log_probs=rollout,
        loss_mask=mask,
        weights=TokenWeights(loss=mask / 4, mean=mask / 4),
        ref_log_probs=None,
        old=None,
        samples=TokenSequences.of(lengths, mask),
        observed_log_ratio=torch.zeros(5),
    )
    algo = AlgorithmConfig.model_validate(
        {"policy_loss": "gspo", "use_rollout_logprobs": False, "use_tis": True, "tis_clip": 3.0}
    )
    *_, tis = policy_loss_terms(
        logp=behaviour, behaviour=behaviour, rollout_lp=rollout, mb=mb, inputs=inputs, algo=algo
    )
    first = ref.tis_sequence_weight(
        old_log_probs=[-1.0, -9.0, -2.0], rollout_log_probs=[-1.5, 0.0, -1.7], mask=[1, 0, 1], clip=3.0
    )
    assert tis[[0, 2, 3]].tolist() == pytest.approx([first, first, 3.0])  # the second: exp(1.3) capped at 3


def test_gspo_aggregates_per_sequence_unless_told_otherwise():
    assert AlgorithmConfig(policy_loss="gspo").loss_aggregation == "seq_mean_token_mean"  # the paper; verl always
    assert AlgorithmConfig(policy_loss="gspo", loss_aggregation="token_mean").loss_aggregation == "token_mean"  # TRL
    assert AlgorithmConfig().loss_aggregation == "token_mean"

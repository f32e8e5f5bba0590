"""The trainer's RL math end to end (real DeepSpeed on CPU, real redis-server) against the independent
references of rl_reference.py: each sample scored under the distribution it was drawn from (T != 1, top-p,
top-k, greedy, mixed in one step), the step's metrics recomputed by hand after an update with masked interior
tokens, GAE skipping masked tokens in the critic, keep_old_actor's per-version snapshots, and the estimators and
losses of issue 25 in a real step: GSPO with RLOO, REINFORCE++ and REINFORCE++-baseline with KL rewards."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import rl_reference as ref
import torch
from conftest_trainer import harness, make_batch, model_logits, peaked_model_dir, tiny_model_dir  # noqa: F401

from services.contracts.sampling_spec import SamplingSpec
from services.contracts.trainer_calls import LoadRequest, PublishRequest, SaveRequest, TrainRequest, WeightSyncRequest
from services.contracts.wire import RolloutBatchData, sampling_arrays
from services.trainer.algo.critic import read_handoff

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def prompts_and_responses(batch: RolloutBatchData) -> tuple[list[list[int]], list[list[int]]]:
    slices = batch.sample_slices()
    return ([batch.tokens[p].tolist() for p, _, _ in slices], [batch.tokens[r].tolist() for _, r, _ in slices])


def reference_tables(model_dir: Path, batch: RolloutBatchData, *, tempered: bool = False) -> list[list[float]]:
    """Per response token (flat): the log-prob table of its sample's distribution under the model."""
    prompts, responses = prompts_and_responses(batch)
    tables = []
    for i, rows in enumerate(model_logits(model_dir, prompts, responses)):
        temperature = float(batch.sampling_temperature[i])
        top_p, top_k = (1.0, 0) if tempered else (float(batch.sampling_top_p[i]), int(batch.sampling_top_k[i]))
        tables += [ref.sampling_log_probs(row, temperature=temperature, top_p=top_p, top_k=top_k) for row in rows]
    return tables


def targets(batch: RolloutBatchData) -> list[int]:
    return [t for r in prompts_and_responses(batch)[1] for t in r]


def test_each_sample_is_scored_under_the_distribution_it_was_drawn_from(harness, peaked_model_dir):  # noqa: F811
    settings = [
        SamplingSpec(temperature=0.7, top_p=0.9),
        SamplingSpec(temperature=1.3, top_k=8),
        SamplingSpec(temperature=0.0),
    ]
    batches = [make_batch(rollout_id=i, seed=i, model_dir=peaked_model_dir, sampling=s) for i, s in enumerate(settings)]
    h = harness(model_dir=peaked_model_dir, algorithm={"kl_coef": 0.1})
    m = h.service.train(TrainRequest(rollout_id=0, entry_ids=tuple(h.put(b) for b in batches))).metrics
    # on-policy: every token's ratio is 1, so nothing clips and the rollout's log-probs are reproduced
    assert m["pg_clipfrac"] == 0.0 and m["ppo_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["rollout_logprob_abs_diff"] < 1e-5
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference, both tempered
    tables = [t for b in batches for t in reference_tables(peaked_model_dir, b)]
    assert m["entropy"] == pytest.approx(np.mean([ref.entropy(t) for t in tables]), rel=1e-4)
    # the inputs tell the difference: scored at temperature 1 untruncated, these tokens are far off
    plain = [dataclasses.replace(b, **sampling_arrays(b.num_samples, SamplingSpec())) for b in batches]
    t1 = [
        table[tok] for b in plain for table, tok in zip(reference_tables(peaked_model_dir, b), targets(b), strict=True)
    ]
    rollout = np.concatenate([b.rollout_log_probs for b in batches])
    assert np.mean(np.abs(np.asarray(t1) - rollout)) > 0.1
    tis = harness(
        model_dir=peaked_model_dir, run_name="tis", algorithm={"use_rollout_logprobs": False, "use_tis": True}
    )
    m = tis.service.train(TrainRequest(rollout_id=0, entry_ids=tuple(tis.put(b) for b in batches))).metrics
    assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5) and m["rollout_logprob_abs_diff"] < 1e-5


def interior_masks(batch: RolloutBatchData, seed: int) -> np.ndarray:
    """A loss mask with masked (tool / observation) tokens inside responses; every response keeps its first."""
    rng = np.random.default_rng(seed)
    mask = (rng.random(batch.num_response_tokens) > 0.3).astype(np.uint8)
    mask[np.cumsum(batch.response_lengths) - batch.response_lengths] = 1
    return mask


def test_step_metrics_match_the_reference_after_an_update(harness, peaked_model_dir):  # noqa: F811
    """Rollout log-probs off the policy, masked interior tokens, asymmetric and dual clip, k3 KL in the loss:
    every metric of the second step recomputed from the exported weights after the first."""
    algo = {"kl_coef": 0.05, "eps_clip": 0.2, "eps_clip_high": 0.28, "dual_clip_c": 3.0}
    h = harness(model_dir=peaked_model_dir, algorithm=algo)
    dist = SamplingSpec(temperature=0.7, top_p=0.9)
    h.service.train(
        TrainRequest(rollout_id=0, entry_ids=(h.put(make_batch(seed=1, model_dir=peaked_model_dir, sampling=dist)),))
    )
    trained = h.service.save(SaveRequest(rollout_id=0, export_hf=True)).hf_path
    batch = make_batch(rollout_id=1, seed=2, groups=4, model_dir=peaked_model_dir, sampling=dist)
    noise = np.random.default_rng(3).normal(0.0, 0.3, batch.num_response_tokens).astype(np.float32)
    batch = dataclasses.replace(
        batch, loss_mask=interior_masks(batch, seed=4), rollout_log_probs=batch.rollout_log_probs + noise
    )
    m = h.service.train(TrainRequest(rollout_id=1, entry_ids=(h.put(batch),))).metrics

    now, now_t = reference_tables(trained, batch), reference_tables(trained, batch, tempered=True)
    init_t = reference_tables(peaked_model_dir, batch, tempered=True)
    adv = ref.grpo_advantages(batch.rewards.tolist(), batch.group_ids.tolist(), normalize_std=True)
    token_adv = np.repeat(adv, batch.response_lengths)
    rows = []
    for i, tok in enumerate(targets(batch)):
        if not batch.loss_mask[i]:
            continue
        lp, old = now[i][tok], float(batch.rollout_log_probs[i])
        loss, ratio, clipped = ref.ppo_loss(
            log_prob=lp, old_log_prob=old, advantage=float(token_adv[i]), eps_low=0.2, eps_high=0.28, dual_clip_c=3.0
        )
        kl = ref.kl(now_t[i][tok], init_t[i][tok], "k3")
        rows.append((loss, ratio, clipped, kl, ref.entropy(now[i]), min(abs(lp - old), 20.0)))
    pg, ratio, clipfrac, kl, entropy, mismatch = np.mean(rows, axis=0)
    assert kl > 1e-4 and 0 < clipfrac < 1  # the update moved the policy; some tokens clip, some do not
    got = [
        m[k] for k in ("pg_loss", "ppo_ratio_mean", "pg_clipfrac", "kl", "entropy", "rollout_logprob_abs_diff", "loss")
    ]
    assert got == pytest.approx([pg, ratio, clipfrac, kl, entropy, mismatch, pg + 0.05 * kl], rel=2e-4, abs=2e-6)


def test_decoupled_ppo_step_weighs_each_token_by_its_own_behaviour_log_prob(harness, peaked_model_dir):  # noqa: F811
    """A real DeepSpeed step with tis_mode: mask (AReaL's decoupled PPO): the second half of every sample was
    sampled after a mid-generation sync by a far-off policy (its rollout log-probs moved by N(0, 1.5)), so some of
    those tokens pass the cap and leave the loss. The metrics are the reference's from each token's own log-prob."""
    h = harness(
        model_dir=peaked_model_dir,
        algorithm={"use_rollout_logprobs": False, "use_tis": True, "tis_mode": "mask", "tis_clip": 2.0},
    )
    dist = SamplingSpec(temperature=0.7, top_p=0.9)
    batch = make_batch(rollout_id=0, seed=6, groups=4, model_dir=peaked_model_dir, sampling=dist)
    offsets = np.concatenate([np.arange(k) for k in batch.response_lengths])
    late = offsets >= np.repeat(batch.response_lengths // 2, batch.response_lengths)
    shift = np.random.default_rng(7).normal(0.0, 1.5, batch.num_response_tokens).astype(np.float32)
    batch = dataclasses.replace(
        batch,
        rollout_log_probs=np.where(late, batch.rollout_log_probs + shift, batch.rollout_log_probs).astype(np.float32),
        token_versions=np.where(late, 1, 0).astype(np.int64),
    )
    m = h.service.train(TrainRequest(rollout_id=0, entry_ids=(h.put(batch),))).metrics
    prox = reference_tables(peaked_model_dir, batch)  # the policy the step starts from
    adv = np.repeat(
        ref.grpo_advantages(batch.rewards.tolist(), batch.group_ids.tolist(), normalize_std=True),
        batch.response_lengths,
    )
    rows = []
    for i, tok in enumerate(targets(batch)):
        lp, behav = prox[i][tok], float(batch.rollout_log_probs[i])
        loss = ref.decoupled_ppo_loss(
            log_prob=lp,
            prox_log_prob=lp,
            behav_log_prob=behav,
            advantage=float(adv[i]),
            eps_low=0.2,
            eps_high=0.2,
            dual_clip_c=None,
            cap=2.0,
        )
        weight = math.exp(lp - behav)
        rows.append((loss, weight if weight <= 2.0 else 0.0, float(weight > 2.0), lp - behav))
    pg, weight, masked, _ = np.mean(rows, axis=0)
    assert 0 < masked < 0.5 and all(r[2] == 0 for r, is_late in zip(rows, late, strict=True) if not is_late)
    assert [m["pg_loss"], m["tis_weight_mean"], m["tis_masked_frac"]] == pytest.approx(
        [pg, weight, masked], rel=2e-4, abs=2e-6
    )
    # the mismatch metrics take each token's ratio against its own behaviour log-prob (its own version's)
    log_ratio = np.array([r[3] for r in rows])
    assert [m["mismatch/kl"], m["mismatch/ratio_max"], m["mismatch/token_masked_frac"]] == pytest.approx(
        [-log_ratio.mean(), math.exp(log_ratio.max()), masked], rel=2e-4, abs=2e-6
    )


def test_critic_gae_skips_masked_tokens(harness, tiny_model_dir):  # noqa: F811
    gae = {"advantage_estimator": "gae", "gamma": 0.9, "lambd": 0.8}
    critic = harness(role="critic", run_name="ppo-mask", algorithm=gae)
    actor = harness(run_name="ppo-mask", algorithm={**gae, "whiten_advantages": True})
    for rollout_id in range(2):  # the second step's values come from a trained value head (not all 0)
        batch = make_batch(rollout_id=rollout_id, seed=rollout_id, model_dir=tiny_model_dir)
        batch = dataclasses.replace(batch, loss_mask=interior_masks(batch, seed=10 + rollout_id))
        entry = critic.put(batch)
        critic.service.train(TrainRequest(rollout_id=rollout_id, entry_ids=(entry,)))
        handoff = read_handoff(critic.client, stream=critic.stream, rollout_id=rollout_id)
        a = actor.service.train(TrainRequest(rollout_id=rollout_id, entry_ids=(entry,), use_critic_values=True)).metrics
    assert np.abs(handoff.values).max() > 0
    expected_adv, expected_ret = [], []
    for (_, _, resp), reward in zip(batch.sample_slices(), batch.rewards.tolist(), strict=True):
        adv, ret = ref.gae_sequence(
            reward=reward,
            values=handoff.values[resp].tolist(),
            mask=batch.loss_mask[resp].tolist(),
            kl_penalty=None,
            gamma=0.9,
            lambd=0.8,
        )
        expected_adv += adv
        expected_ret += ret
    trainable = batch.loss_mask.astype(bool)
    assert handoff.advantages.tolist() == pytest.approx(expected_adv, rel=1e-5, abs=1e-6)
    assert handoff.returns[trainable].tolist() == pytest.approx(
        np.asarray(expected_ret)[trainable].tolist(), rel=1e-5, abs=1e-6
    )
    assert a["advantage_mean"] == pytest.approx(0.0, abs=1e-5)  # whitened over the trainable tokens


def publish(h, version: int) -> None:
    h.service.prepare_weight_sync(WeightSyncRequest(version=version, transport="disk"))
    h.service.publish_weights(PublishRequest(version=version))


def test_keep_old_actor_scores_samples_under_the_version_that_generated_them(harness, peaked_model_dir):  # noqa: F811
    h = harness(
        model_dir=peaked_model_dir, algorithm={"use_rollout_logprobs": False, "keep_old_actor": True, "use_tis": True}
    )
    dist = SamplingSpec(temperature=0.7, top_p=0.9)
    generated_by_v0 = [
        make_batch(rollout_id=i, seed=i, model_dir=peaked_model_dir, sampling=dist, sample_versions=[0] * 12)
        for i in range(2)
    ]
    publish(h, 0)
    first = h.service.train(TrainRequest(rollout_id=0, entry_ids=(h.put(generated_by_v0[0]),))).metrics
    # nothing trained since v0 was published: the current policy is v0, nothing is recomputed
    assert first["ppo_ratio_mean"] == pytest.approx(1.0, abs=1e-6) and first["old_actor_fallback_frac"] == 0.0
    publish(h, 1)
    # one step off: a batch of v0 trained after the v1 update is scored by the v0 snapshot, which reproduces
    # its rollout log-probs exactly (TIS weight 1), while the ratio shows how far the policy moved
    second = h.service.train(TrainRequest(rollout_id=1, entry_ids=(h.put(generated_by_v0[1]),))).metrics
    assert second["rollout_logprob_abs_diff"] < 1e-5 and second["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    # the mismatch is taken against the snapshot of each token's version, not the policy that moved since
    assert abs(second["mismatch/kl"]) < 1e-5 and second["mismatch/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert abs(second["ppo_ratio_mean"] - 1.0) > 1e-4 and second["old_actor_fallback_frac"] == 0.0
    # Per token: a sync landed mid-sample. Each sample's first token is v0's, whose snapshot reproduces its rollout
    # log-prob; the later ones claim version 5, which has no snapshot: exactly those fall back to the current policy.
    mixed = make_batch(rollout_id=2, seed=3, model_dir=peaked_model_dir, sampling=dist, sample_versions=[0] * 12)
    firsts = np.zeros(mixed.num_response_tokens, dtype=bool)
    firsts[np.cumsum(mixed.response_lengths) - mixed.response_lengths] = True
    mixed = dataclasses.replace(mixed, token_versions=np.where(firsts, 0, 5).astype(np.int64))
    third = h.service.train(TrainRequest(rollout_id=2, entry_ids=(h.put(mixed),))).metrics
    assert third["old_actor_fallback_frac"] == pytest.approx(1 - 12 / mixed.num_response_tokens, abs=1e-6)
    publish(h, 2)
    assert sorted(h.trainer.old_actor.snapshots) == [1, 2]  # one step off keeps two versions
    unknown = make_batch(rollout_id=3, seed=5, model_dir=peaked_model_dir, sampling=dist, sample_versions=[0] * 12)
    fourth = h.service.train(TrainRequest(rollout_id=3, entry_ids=(h.put(unknown),))).metrics
    assert fourth["old_actor_fallback_frac"] == 1.0 and math.isfinite(fourth["loss"])  # v0 is gone: current policy
    h.service.save(SaveRequest(rollout_id=3))
    assert (
        h.service.load(LoadRequest()).loaded and not h.trainer.old_actor.snapshots
    )  # a Load rolls back: snapshots dropped


def noisy_masked_batch(model_dir: Path, *, seed: int, dist: SamplingSpec, noise: float) -> RolloutBatchData:
    """Masked interior tokens and rollout log-probs off the policy by N(0, noise) per token."""
    batch = make_batch(rollout_id=1, seed=seed, groups=4, model_dir=model_dir, sampling=dist)
    shift = np.random.default_rng(seed + 1).normal(0.0, noise, batch.num_response_tokens).astype(np.float32)
    return dataclasses.replace(
        batch, loss_mask=interior_masks(batch, seed=seed + 2), rollout_log_probs=batch.rollout_log_probs + shift
    )


def test_gspo_with_rloo_step_matches_the_reference_after_an_update(harness, peaked_model_dir):  # noqa: F811
    """GSPO's sequence ratio over multi-token sequences with masked interior tokens, split over micro-batches, with
    asymmetric and dual clip and the default seq_mean_token_mean; RLOO advantages: every metric of the second step
    against GSPO's sequence objective (rl_reference.gspo_sequence) under the exported weights."""
    algo = {
        "policy_loss": "gspo",
        "advantage_estimator": "rloo",
        "eps_clip": 0.1,
        "eps_clip_high": 0.15,
        "dual_clip_c": 1.5,
    }
    h = harness(model_dir=peaked_model_dir, algorithm=algo)
    dist = SamplingSpec(temperature=0.7, top_p=0.9)
    h.service.train(
        TrainRequest(rollout_id=0, entry_ids=(h.put(make_batch(seed=1, model_dir=peaked_model_dir, sampling=dist)),))
    )
    trained = h.service.save(SaveRequest(rollout_id=0, export_hf=True)).hf_path
    batch = noisy_masked_batch(peaked_model_dir, seed=2, dist=dist, noise=0.3)
    m = h.service.train(TrainRequest(rollout_id=1, entry_ids=(h.put(batch),))).metrics

    now, toks = reference_tables(trained, batch), targets(batch)
    adv = ref.rloo_advantages(batch.rewards.tolist(), batch.group_ids.tolist())
    seqs, token_rows = [], []
    for (_, _, resp), a in zip(batch.sample_slices(), adv, strict=True):
        idx = range(resp.start, resp.stop)
        mask = batch.loss_mask[resp].tolist()
        loss, s, clipped, _ = ref.gspo_sequence(
            log_probs=[now[i][toks[i]] for i in idx],
            old_log_probs=batch.rollout_log_probs[resp].tolist(),
            advantage=a,
            mask=mask,
            eps_low=0.1,
            eps_high=0.15,
            dual_clip_c=1.5,
        )
        seqs.append(loss)
        token_rows += [(s, clipped, ref.entropy(now[i])) for i, k in zip(idx, mask, strict=True) if k]
    ratio, clipfrac, entropy = np.mean(token_rows, axis=0)
    assert 0 < clipfrac < 1 and abs(ratio - 1) > 1e-3  # some sequences clip, some do not
    got = [m[k] for k in ("pg_loss", "loss", "ppo_ratio_mean", "pg_clipfrac", "entropy")]
    assert got == pytest.approx([np.mean(seqs), np.mean(seqs), ratio, clipfrac, entropy], rel=2e-4, abs=2e-6)


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_step_with_kl_reward_matches_the_reference(harness, peaked_model_dir, estimator):  # noqa: F811
    """REINFORCE++ (gamma 0.9, per-token KL rewards, masked interior tokens no steps) and REINFORCE++-baseline
    (KL-shaped group-centred rewards), both whitened over the batch, in a real step after an update: the policy
    loss recomputed from the exported weights, the reference model's log-probs and the rollout's."""
    algo = {
        "advantage_estimator": estimator,
        "kl_coef": 0.05,
        "kl_mode": "reward",
        **({"gamma": 0.9} if estimator == "reinforce_pp" else {}),
    }
    h = harness(model_dir=peaked_model_dir, algorithm=algo)
    dist = SamplingSpec(temperature=0.7, top_p=0.9)
    h.service.train(
        TrainRequest(rollout_id=0, entry_ids=(h.put(make_batch(seed=1, model_dir=peaked_model_dir, sampling=dist)),))
    )
    trained = h.service.save(SaveRequest(rollout_id=0, export_hf=True)).hf_path
    batch = noisy_masked_batch(peaked_model_dir, seed=3, dist=dist, noise=0.2)
    m = h.service.train(TrainRequest(rollout_id=1, entry_ids=(h.put(batch),))).metrics

    now, toks = reference_tables(trained, batch), targets(batch)
    now_t, init_t = (
        reference_tables(trained, batch, tempered=True),
        reference_tables(peaked_model_dir, batch, tempered=True),
    )
    kl_penalty = [0.05 * ref.kl(now_t[i][t], init_t[i][t], "k3") for i, t in enumerate(toks)]
    mask = batch.loss_mask.tolist()
    per_token_adv = []
    if estimator == "reinforce_pp":
        for (_, _, resp), r in zip(batch.sample_slices(), batch.rewards.tolist(), strict=True):
            per_token_adv += ref.reinforce_pp_returns(reward=r, mask=mask[resp], kl_penalty=kl_penalty[resp], gamma=0.9)
    else:
        shaped = [
            r - sum(k for k, on in zip(kl_penalty[resp], mask[resp], strict=True) if on)
            for (_, _, resp), r in zip(batch.sample_slices(), batch.rewards.tolist(), strict=True)
        ]
        centred = ref.grpo_advantages(shaped, batch.group_ids.tolist(), normalize_std=False)
        per_token_adv = np.repeat(centred, batch.response_lengths).tolist()
    advantages = ref.whiten(per_token_adv, mask)
    rows = [
        ref.ppo_loss(
            log_prob=now[i][t],
            old_log_prob=float(batch.rollout_log_probs[i]),
            advantage=advantages[i],
            eps_low=0.2,
            eps_high=0.2,
            dual_clip_c=None,
        )
        for i, t in enumerate(toks)
        if mask[i]
    ]
    pg, ratio, clipfrac = np.mean(rows, axis=0)
    assert 0 < clipfrac < 1 and max(kl_penalty) > 1e-5  # the update moved the policy away from the reference
    got = [m[k] for k in ("pg_loss", "loss", "ppo_ratio_mean", "pg_clipfrac", "advantage_mean")]
    assert got == pytest.approx([pg, pg, ratio, clipfrac, 0.0], rel=2e-4, abs=2e-6)


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_adams_eps_from_the_config_reaches_the_optimizer(harness, zero_stage):  # noqa: F811
    """trainer.eps: Tandem's flat AdamW (stage 0) and torch's under ZeRO get it; DeepSpeed's own AdamW gets it in its
    config (that optimizer is not built on a CPU)."""
    from services.trainer.model.backend import deepspeed_config

    h = harness(trainer={"zero_stage": zero_stage, "eps": 0.5})
    engine = h.trainer.backend.engine
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    assert [g["eps"] for g in inner.param_groups] == [0.5] * len(inner.param_groups)
    config = h.config.model_copy(
        update={"trainer": h.config.trainer.model_copy(update={"optimizer": "adamw_deepspeed", "zero_stage": 1})}
    )
    assert deepspeed_config(config, world_size=1, lr=1.0)["optimizer"]["params"]["eps"] == 0.5

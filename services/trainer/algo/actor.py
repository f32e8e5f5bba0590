"""One policy update (a policy loss and an advantage estimator of the algorithm table, estimators.py) over a whole
TrainBatch, on every rank in lockstep.

Global per-token quantities (advantages, aggregation weights) are computed from the full batch that every
rank holds; forward passes only cover the rank's shard. Per-token results of a pre-pass that other ranks
need (KL for reward shaping) are summed over ranks into a full-length vector.

Every log-prob is of the distribution the sample was drawn from (scoring.py): the ratio, TIS and the log-prob
mismatch use each sample's behaviour space, the one its engine reported (the sampling distribution with temperature,
top-k and top-p for the native engine; the tempered one, logits / T untruncated, for SGLang), the entropy the
sampling distribution, the KL to the reference the tempered one. docs/algorithms.md lists every choice.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from services.contracts.config import AlgorithmConfig
from services.trainer.algo.distillation import Teacher, distillation_loss, distilled_advantages, reverse_kl
from services.trainer.algo.estimators import compute_advantages, policy_loss_fn
from services.trainer.algo.head_scoring import BEHAVIOUR_ROW, ENTROPY_ROW, TEMPERED_ROW
from services.trainer.algo.losses import PolicyLossConfig, Sequences, kl_estimate
from services.trainer.algo.old_actor import OldActor
from services.trainer.algo.rollout_correction import TokenSequences, correct, mismatch_metrics
from services.trainer.algo.scoring import TokenSampling
from services.trainer.batching import MicroBatch, TrainBatch
from services.trainer.dist import all_reduce_sum
from services.trainer.model.backend import frozen_log_probs
from services.trainer.update import (
    MicroBatchLoss,
    TokenWeights,
    UpdateBackend,
    lockstep_micro_batches,
    optimizer_update,
    per_token_pass,
    step_metrics,
)


def owned_tokens(num_tokens: int, mbs: list[MicroBatch], device: torch.device) -> torch.Tensor:
    """1.0 on the response tokens this rank's micro-batches cover, else 0.0 (on `device`)."""
    out = torch.zeros(num_tokens, dtype=torch.float32, device=device)
    for mb in mbs:
        out[mb.to(device).token_index] = 1.0
    return out


def frozen_pass(
    model: torch.nn.Module,
    backend: UpdateBackend,
    num_tokens: int,
    mbs: list[MicroBatch],
    sampling: TokenSampling,
    *,
    tempered: bool,
    vocab: int | None = None,
) -> torch.Tensor:
    """Log-probs of this rank's response tokens under a frozen model (reference, old actor, distillation teacher;
    the trained model's scoring chunk, and its vocabulary unless `vocab` gives the frozen model's own), full-batch
    vector on the device. `sampling` is on the device."""
    return per_token_pass(
        num_tokens,
        mbs,
        lambda mb: frozen_log_probs(
            model,
            mb,
            backend.device,
            sampling=sampling.at(mb.token_index),
            tempered=tempered,
            vocab=vocab or backend.vocab_size,
            chunk_tokens=backend.chunk_tokens,
            compiled=backend.compiled_scoring,
        ),
        device=backend.device,
    )


@dataclass(frozen=True)
class BehaviourLogProbs:
    """The old actor's log-probs of each token's version (NaN: the current policy is that version) and
    1.0 where no snapshot of the version was left (a restart): those use the current policy too. On the device."""

    log_probs: torch.Tensor  # float32 [T]
    fallback: torch.Tensor  # float32 [T]


def old_actor_log_probs(
    *, old_actor: OldActor, backend: UpdateBackend, batch: TrainBatch, mbs: list[MicroBatch], sampling: TokenSampling
) -> BehaviourLogProbs:
    n_tok, device = batch.num_response_tokens, backend.device
    versions = batch.versions.to(device)  # each token's own: a sync may have landed mid-sample
    out = torch.full((n_tok,), float("nan"), device=device)
    fallback = torch.zeros(n_tok, device=device)
    for version in sorted(set(batch.versions.tolist())):
        chosen = versions == version
        snapshot = old_actor.get(version)
        if snapshot is None:
            fallback[chosen] = 1.0
        elif snapshot.optimizer_step != backend.global_steps:  # else nothing was trained since: current = old
            lp = frozen_pass(old_actor.module_for(snapshot), backend, n_tok, mbs, sampling, tempered=False)
            out[chosen] = lp[chosen]
    return BehaviourLogProbs(log_probs=out, fallback=fallback)


def reward_kl_penalty(
    *,
    backend: UpdateBackend,
    mbs: list[MicroBatch],
    sampling: TokenSampling,
    ref_lp: torch.Tensor,
    algo: AlgorithmConfig,
) -> torch.Tensor:
    """kl_coef x per-token KL of the policy before the update to the reference (both tempered), full batch, on the
    host (it shapes the rewards)."""
    n_tok, device = len(ref_lp), backend.device
    policy = per_token_pass(
        n_tok,
        mbs,
        lambda mb: backend.scores(mb, sampling.at(mb.token_index), tempered=True)[0][TEMPERED_ROW],
        device=device,
    )
    kl = kl_estimate(policy, ref_lp, algo.kl_estimator) * owned_tokens(n_tok, mbs, device)
    return algo.kl_coef * all_reduce_sum(kl).cpu()


def teacher_pass(
    *, teacher: Teacher | None, backend: UpdateBackend, mbs: list[MicroBatch], sampling: TokenSampling, num_tokens: int
) -> torch.Tensor | None:
    """algorithm.distillation: the teacher's tempered log-probs of this rank's tokens, on the device. The student's
    come from the update's own forward (one optimizer step per Train: its scores are the policy's before the update),
    so distillation costs the teacher's forward and no other."""
    if teacher is None:
        return None
    return frozen_pass(teacher.model, backend, num_tokens, mbs, sampling, tempered=True, vocab=teacher.vocab_size)


@dataclass(frozen=True)
class TokenInputs:
    """The step's per-token tensors, moved to the device once per step; a micro-batch indexes them with its
    token_index (on the device too)."""

    sampling: TokenSampling
    advantages: torch.Tensor
    rollout_log_probs: torch.Tensor
    loss_mask: torch.Tensor
    weights: TokenWeights
    ref_log_probs: torch.Tensor | None
    old: BehaviourLogProbs | None
    samples: TokenSequences  # every token's sample, for the corrections per sequence (the whole batch)
    observed_log_ratio: torch.Tensor  # written per micro-batch: trainer minus behaviour log-prob, for the metrics
    teacher_log_probs: torch.Tensor | None = None  # algorithm.distillation's, tempered

    def sequences(self, mb: MicroBatch) -> TokenSequences:
        idx = mb.token_index
        return TokenSequences(
            ids=self.samples.ids[idx], count=self.samples.count, trainable=self.samples.trainable[idx]
        )


@dataclass(frozen=True)
class TokenTerms:
    """Per-token pieces of one micro-batch's loss and metrics."""

    pg: torch.Tensor  # policy-gradient loss (weighted by the rollout correction)
    clipped: torch.Tensor
    ratio: torch.Tensor
    tis: torch.Tensor  # the rollout correction's weight (1 without one)
    log_ratio: torch.Tensor  # trainer minus behaviour log-prob
    kl: torch.Tensor
    entropy: torch.Tensor
    mismatch: torch.Tensor  # |behaviour log-prob - rollout log-prob|, capped at 20
    advantages: torch.Tensor  # the estimator's, with distillation's per-token term (mode reverse_kl)


def token_advantages(
    *, scores: torch.Tensor, mb: MicroBatch, inputs: TokenInputs, algo: AlgorithmConfig
) -> torch.Tensor:
    """The micro-batch's advantages; with distillation in mode reverse_kl, minus coef x (log pi_student - log
    pi_teacher), the student's from this forward's tempered scores (no gradient)."""
    advantages = inputs.advantages[mb.token_index]
    distill, teacher_lp = algo.distillation, inputs.teacher_log_probs
    if distill is None or teacher_lp is None or distill.mode != "reverse_kl":
        return advantages
    return distilled_advantages(advantages, scores[TEMPERED_ROW], teacher_lp[mb.token_index], distill.coef)


def policy_loss_terms(
    *,
    logp: torch.Tensor,
    behaviour: torch.Tensor,
    rollout_lp: torch.Tensor,
    mb: MicroBatch,
    inputs: TokenInputs,
    algo: AlgorithmConfig,
    advantages: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Per token: (the policy loss of `algo.policy_loss`, weighted by the rollout correction; clipped; ratio; the
    correction's weight). Under GSPO the ratio is the sequence's geometric mean (the micro-batch's rows are its
    sequences). `advantages`: the micro-batch's (token_advantages); by default the estimator's."""
    clip = PolicyLossConfig(eps_clip=algo.eps_clip, eps_clip_high=algo.eps_clip_high, dual_clip_c=algo.dual_clip_c)
    old_lp = rollout_lp if algo.use_rollout_logprobs else behaviour
    seqs = Sequences(ids=mb.rows, count=mb.input_ids.shape[0], trainable=inputs.loss_mask[mb.token_index] > 0)
    loss_fn = policy_loss_fn(algo.policy_loss)
    advantages = inputs.advantages[mb.token_index] if advantages is None else advantages
    pg, clipped, ratio = loss_fn(logp, old_lp, advantages, seqs, clip)
    if not algo.rollout_correction.active:
        return pg, clipped, ratio, torch.ones_like(pg)
    weight = correct(behaviour - rollout_lp, inputs.sequences(mb), algo.rollout_correction).weight
    return pg * weight, clipped, ratio, weight


def token_terms(*, scores: torch.Tensor, mb: MicroBatch, inputs: TokenInputs, algo: AlgorithmConfig) -> TokenTerms:
    """`scores`: the micro-batch's [3, N] (head_scoring: behaviour log-prob in the space the rollout reported,
    entropy of the sampling distribution, tempered log-prob); `mb` is on the device."""
    idx = mb.token_index
    logp = scores[BEHAVIOUR_ROW]
    entropy = scores[ENTROPY_ROW] if algo.entropy_coef > 0 else scores[ENTROPY_ROW].detach()
    rollout_lp = inputs.rollout_log_probs[idx]
    # The trainer's view of the behaviour policy: the old actor, or the current policy before this step's
    # single update (exact without keep_old_actor in sync mode).
    behaviour = logp.detach()
    if inputs.old is not None:
        kept = inputs.old.log_probs[idx]
        behaviour = torch.where(torch.isnan(kept), behaviour, kept)
    advantages = token_advantages(scores=scores, mb=mb, inputs=inputs, algo=algo)
    pg, clipped, ratio, tis = policy_loss_terms(
        logp=logp, behaviour=behaviour, rollout_lp=rollout_lp, advantages=advantages, mb=mb, inputs=inputs, algo=algo
    )
    kl = torch.zeros_like(pg)
    if inputs.ref_log_probs is not None:
        kl = kl_estimate(scores[TEMPERED_ROW], inputs.ref_log_probs[idx], algo.kl_estimator)
    return TokenTerms(
        pg=pg,
        clipped=clipped,
        ratio=ratio,
        tis=tis,
        kl=kl,
        entropy=entropy,
        mismatch=(behaviour - rollout_lp).abs().clamp(max=20.0),
        log_ratio=(behaviour - rollout_lp).detach(),
        advantages=advantages,
    )


def _ppo_micro_loss(
    *, backend: UpdateBackend, mb: MicroBatch, inputs: TokenInputs, algo: AlgorithmConfig
) -> MicroBatchLoss:
    scores, anchor = backend.scores(
        mb, inputs.sampling.at(mb.token_index), entropy=True, entropy_grad=algo.entropy_coef > 0
    )
    t = token_terms(scores=scores, mb=mb, inputs=inputs, algo=algo)
    loss_tok = t.pg
    if inputs.ref_log_probs is not None and algo.kl_mode == "loss":
        loss_tok = loss_tok + algo.kl_coef * t.kl
    distill, teacher_lp = algo.distillation, inputs.teacher_log_probs
    if distill is not None and teacher_lp is not None and distill.mode == "kl_loss":
        loss_tok = loss_tok + distillation_loss(scores[TEMPERED_ROW], teacher_lp[mb.token_index], distill)
    if algo.entropy_coef > 0:
        loss_tok = loss_tok - algo.entropy_coef * t.entropy
    w, tw = inputs.weights.at(mb)

    def metrics() -> dict[str, torch.Tensor]:
        fallback = torch.zeros_like(tw) if inputs.old is None else inputs.old.fallback[mb.token_index]
        inputs.observed_log_ratio[mb.token_index] = t.log_ratio  # the step's metrics read it after the update
        per_token = {
            "pg_clipfrac": t.clipped,
            "kl": t.kl,
            "entropy": t.entropy,
            "ppo_ratio_mean": t.ratio,
            "tis_weight_mean": t.tis,
            "rollout_logprob_abs_diff": t.mismatch,
            "old_actor_fallback_frac": fallback,
            "tis_masked_frac": (t.tis == 0).float(),
            "advantage_mean": t.advantages,
        }
        if teacher_lp is not None:
            teacher = teacher_lp[mb.token_index]
            per_token["distill/reverse_kl"] = reverse_kl(scores[TEMPERED_ROW].detach(), teacher)
            per_token["distill/teacher_logprob_mean"] = teacher
        return {"pg_loss": (w * t.pg).sum(), **{name: (tw * x).sum() for name, x in per_token.items()}}

    return MicroBatchLoss(loss=(w * loss_tok).sum(), anchor=anchor, metrics=metrics)


def step_advantages(batch: TrainBatch, algo: AlgorithmConfig, kl_penalty: torch.Tensor | None) -> torch.Tensor:
    """The estimator's advantages; under pure distillation (task_reward: false) of rewards 0."""
    cfg = algo.distillation
    if cfg is not None and not cfg.task_reward:
        batch = dataclasses.replace(batch, rewards=torch.zeros_like(batch.rewards))
    return compute_advantages(batch, algo, kl_penalty)


def actor_step(
    *,
    backend: UpdateBackend,
    batch: TrainBatch,
    algo: AlgorithmConfig,
    ref_model: torch.nn.Module | None,
    old_actor: OldActor | None,
    token_budget: int,
    teacher: Teacher | None = None,
) -> dict[str, float]:
    start = time.monotonic()
    device = backend.device
    mbs = lockstep_micro_batches(backend, batch, token_budget=token_budget)
    sampling = TokenSampling.of(batch).to(device)
    n_tok = batch.num_response_tokens
    ref_lp = None if ref_model is None else frozen_pass(ref_model, backend, n_tok, mbs, sampling, tempered=True)
    kl_penalty = None
    if ref_lp is not None and algo.kl_mode == "reward":
        kl_penalty = reward_kl_penalty(backend=backend, mbs=mbs, sampling=sampling, ref_lp=ref_lp, algo=algo)
    old = (
        None
        if old_actor is None
        else old_actor_log_probs(old_actor=old_actor, backend=backend, batch=batch, mbs=mbs, sampling=sampling)
    )
    teacher_lp = teacher_pass(teacher=teacher, backend=backend, mbs=mbs, sampling=sampling, num_tokens=n_tok)
    inputs = TokenInputs(
        sampling=sampling,
        advantages=step_advantages(batch, algo, kl_penalty).to(device),
        rollout_log_probs=batch.rollout_log_probs.to(device),
        loss_mask=batch.loss_mask.to(device),
        weights=TokenWeights.of(batch, algo.loss_aggregation, device),
        ref_log_probs=ref_lp,
        old=old,
        samples=TokenSequences.of(batch.response_lengths, batch.loss_mask.to(device)),
        observed_log_ratio=torch.zeros(n_tok, dtype=torch.float32, device=device),
        teacher_log_probs=teacher_lp,
    )
    totals, step = optimizer_update(
        backend, mbs, micro_loss=lambda mb: _ppo_micro_loss(backend=backend, mb=mb, inputs=inputs, algo=algo)
    )
    correction = algo.rollout_correction
    for key, used in (
        ("kl", ref_lp is not None),
        ("tis_weight_mean", correction.active),
        ("old_actor_fallback_frac", old is not None),
        ("tis_masked_frac", correction.drops),
    ):
        if not used:
            totals.pop(key)
    # every token was scored on exactly one rank: the sum over ranks is the whole batch's
    log_ratio = all_reduce_sum(inputs.observed_log_ratio).cpu()
    samples = TokenSequences(inputs.samples.ids.cpu(), inputs.samples.count, inputs.samples.trainable.cpu())
    return {
        **totals,
        **mismatch_metrics(log_ratio, batch.rollout_log_probs, samples, correction),
        **step_metrics(batch, step, start, parameters=backend.parameters),
    }

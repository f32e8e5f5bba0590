"""Observation tokens (loss_mask 0, rollout log-prob 0: what a multi-turn environment's output becomes) get no
gradient and leave no trace in the metrics, with every loss term on: the PPO ratio against the trainer's
log-probs, TIS, dual clip, the k3 KL in the loss and an entropy bonus, at top-p 0.9, where an observation the
policy never sampled usually lies outside the nucleus (its log-prob floored at -1e4). Real DeepSpeed on CPU, real
redis-server. (test_trainer_rl.py checks every metric against an independent reference with masked tokens.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest_trainer import harness, make_batch, peaked_model_dir, tiny_model_dir  # noqa: F401

from services.contracts.sampling_spec import SamplingSpec
from services.contracts.trainer_calls import TrainRequest
from services.contracts.wire import RolloutBatchData
from services.trainer.algo.actor import actor_step
from services.trainer.algo.head_scoring import output_head
from services.trainer.batching import merge_batches

pytestmark = pytest.mark.timeout(240)
ALGO = {
    "use_rollout_logprobs": False,
    "use_tis": True,
    "kl_coef": 0.1,
    "entropy_coef": 0.05,
    "eps_clip_high": 0.28,
    "dual_clip_c": 3.0,
}
NUCLEUS = SamplingSpec(temperature=0.7, top_p=0.9)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def with_observations(batch: RolloutBatchData, *, seed: int, observation_log_prob: float = 0.0) -> RolloutBatchData:
    """Every response's tokens after its first become, at random, observation tokens: a random token id (not the
    policy's), loss_mask 0 and rollout log-prob `observation_log_prob` (the rollout writes 0)."""
    rng = np.random.default_rng(seed)
    mask = (rng.random(batch.num_response_tokens) > 0.4).astype(np.uint8)
    mask[np.cumsum(batch.response_lengths) - batch.response_lengths] = 1
    tokens = batch.tokens.copy()
    response_positions = np.concatenate([np.arange(r.start, r.stop) for _, r, _ in batch.sample_slices()])
    observed = response_positions[mask == 0]
    tokens[observed] = np.random.default_rng(seed + 1).integers(4, 32, size=len(observed))
    log_probs = batch.rollout_log_probs.copy()
    log_probs[mask == 0] = observation_log_prob
    return dataclasses.replace(batch, tokens=tokens, loss_mask=mask, rollout_log_probs=log_probs)


class GradientSpy:
    """The trainer's real backend, recording d loss / d hidden state at each micro-batch's response tokens during the
    real backward (a hook on the output head's input: the chunked head builds no logits tensor to hook; a hidden
    state feeds only its own position's logits, so its gradient is 0 exactly where theirs is); everything else
    passes straight through."""

    def __init__(self, backend) -> None:
        self.backend, self.grads = backend, list[tuple[torch.Tensor, torch.Tensor]]()  # (token index, grad)

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    def scores(self, mb, sampling, **kwargs):
        dmb = mb.to(self.backend.device)

        def spy(module, inputs, output):
            if dmb.token_index.numel() and inputs[0].requires_grad:
                index = dmb.token_index.cpu()
                inputs[0].register_hook(
                    lambda grad: self.grads.append((index, grad[dmb.rows, dmb.positions].detach().cpu()))
                )

        hook = output_head(self.backend.module).register_forward_hook(spy)
        try:
            return self.backend.scores(mb, sampling, **kwargs)
        finally:
            hook.remove()


def hidden_gradients(h, batch: RolloutBatchData, *, trainable_everywhere: bool = False) -> list[tuple]:
    """One real actor step (actor_step) on `batch`: per micro-batch, (the batch's loss mask at its tokens,
    d loss / d hidden state at its tokens [N, H]); with `trainable_everywhere` the step sees loss_mask 1 on every
    token."""
    train = merge_batches([batch])
    stepped = dataclasses.replace(train, loss_mask=torch.ones_like(train.loss_mask)) if trainable_everywhere else train
    spy = GradientSpy(h.trainer.backend)
    actor_step(
        backend=spy,
        batch=stepped,
        algo=h.config.algorithm,
        ref_model=h.trainer.step.ref_model,
        old_actor=None,
        token_budget=h.config.trainer.micro_batch_tokens,
    )
    assert spy.grads
    return [(train.loss_mask[index], grad) for index, grad in spy.grads]


def test_observation_tokens_pass_no_gradient_through_any_loss_term(harness, peaked_model_dir):  # noqa: F811
    h = harness(model_dir=peaked_model_dir, algorithm=ALGO)
    batch = with_observations(make_batch(seed=3, groups=4, model_dir=peaked_model_dir, sampling=NUCLEUS), seed=4)
    observed_rows, policy_live = 0, []
    for mask, grad in hidden_gradients(h, batch):
        observed = mask == 0
        assert torch.equal(grad[observed], torch.zeros_like(grad[observed]))  # exactly 0, not just small
        observed_rows += int(observed.sum())
        policy_live.append(grad[~observed].abs().sum(dim=-1) > 0)
    # most policy tokens get a gradient (not all: a one-token nucleus with a zero advantage passes none)
    assert observed_rows > 10 and torch.cat(policy_live).float().mean() > 0.5
    # the mask is what stops it: the same tokens, trainable, do get gradients (the KL and entropy terms reach them
    # even where the floored log-prob passes none)
    observed_live = [
        (grad.abs().sum(dim=-1) > 0)[mask == 0] for mask, grad in hidden_gradients(h, batch, trainable_everywhere=True)
    ]
    assert torch.cat(observed_live).float().mean() > 0.5


@pytest.mark.parametrize("sampling", [SamplingSpec(), NUCLEUS], ids=["untruncated", "top_p"])
def test_observation_log_probs_change_neither_the_metrics_nor_the_update(
    harness,  # noqa: F811
    peaked_model_dir,  # noqa: F811
    sampling,
):
    """The same episodes with the observation tokens' rollout log-probs 0 (what the rollout writes) or arbitrary:
    an identical step (metrics and weights), so no ratio, TIS weight, KL, entropy or mismatch of theirs counts.
    (Untruncated, every observation token has a finite log-prob, so its TIS weight would differ if it counted.)"""
    base = with_observations(make_batch(seed=5, groups=4, model_dir=peaked_model_dir, sampling=sampling), seed=6)
    garbage = dataclasses.replace(
        base,
        rollout_log_probs=np.where(
            base.loss_mask == 0,
            np.random.default_rng(7).uniform(-30, 0, base.num_response_tokens),
            base.rollout_log_probs,
        ).astype(np.float32),
    )
    assert not np.array_equal(base.rollout_log_probs, garbage.rollout_log_probs)
    runs = []
    for name, batch in (("zero", base), ("garbage", garbage)):
        h = harness(model_dir=peaked_model_dir, algorithm=ALGO, run_name=f"obs-{name}-{sampling.top_p}")
        metrics = dict(h.service.train(TrainRequest(rollout_id=0, entry_ids=(h.put(batch),))).metrics)
        weights = {k: v.detach().clone() for k, v in h.trainer.backend.module.state_dict().items()}
        runs.append(({k: v for k, v in metrics.items() if not k.startswith("perf/")}, weights))  # timings
    (m0, w0), (m1, w1) = runs
    assert m0 == m1
    assert m0["rollout_logprob_abs_diff"] > 0 and m0["tis_weight_mean"] > 0 and "kl" in m0 and "entropy" in m0
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)

"""The trainer scores what the engine reports: each rollout batch names the distribution of its log-probs
(RolloutBatch.logprob_space), the wire and merge_batches carry it per sample, and the ratio, TIS and the log-prob
mismatch use it (the KL stays tempered, the entropy of the sampling distribution).

SGLang 0.5.x reports log_softmax(logits / T) over the whole vocabulary (TEMPERED); the native engine the truncated,
renormalised distribution it sampled from (SAMPLING). Here the "engine" is the shared sampler plus the tempered
formula on the same logits, so an on-policy step must give ratio 1 and mismatch 0 in the stamped space.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest
import torch
from scoring_reference import chunked_scores_of_logits

from services.contracts.config import AlgorithmConfig
from services.contracts.gen.tandem.v1 import common_pb2
from services.contracts.sampling_spec import SamplingSpec
from services.contracts.wire import WireError, build_batch, decode_batch, encode_batch
from services.tensors.sampling_dist import sampling_log_probs
from services.trainer.algo.actor import TokenInputs, token_terms
from services.trainer.algo.rollout_correction import TokenSequences
from services.trainer.algo.scoring import MIXED, SAMPLING, TEMPERED, TokenSampling
from services.trainer.batching import MicroBatch, merge_batches
from services.trainer.commands import decode_batch as decode_train_batch
from services.trainer.commands import encode_batch as encode_train_batch
from services.trainer.update import TokenWeights

VOCAB = 64
T, TOP_P = 0.7, 0.9


def _sampled(logits: torch.Tensor, spec: SamplingSpec, seed: int) -> torch.Tensor:
    """Tokens drawn from the truncated distribution, as any engine draws them."""
    probs = sampling_log_probs(logits, spec).exp()
    return torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).squeeze(-1)


def _terms(
    logits: torch.Tensor, targets: torch.Tensor, rollout_lp: torch.Tensor, tempered: list[bool], lengths: list[int]
):
    n_tok = len(targets)
    mb = MicroBatch(
        input_ids=torch.zeros(len(lengths), max(lengths) + 1, dtype=torch.long),
        attention_mask=torch.ones(len(lengths), max(lengths) + 1, dtype=torch.long),
        rows=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
        positions=torch.cat([torch.arange(n) for n in lengths]),
        targets=targets,
        token_index=torch.arange(n_tok),
        num_tokens=n_tok + len(lengths),
    )
    n = len(lengths)
    sampling = TokenSampling.per_row(
        torch.full((n,), T),
        torch.full((n,), TOP_P),
        torch.zeros(n, dtype=torch.long),
        lengths=torch.tensor(lengths),
        tempered=torch.tensor(tempered),
    )
    ones = torch.ones(n_tok)
    inputs = TokenInputs(
        sampling=sampling,
        advantages=ones,
        rollout_log_probs=rollout_lp,
        loss_mask=ones,
        weights=TokenWeights(loss=ones / n_tok, mean=ones / n_tok),
        ref_log_probs=None,
        old=None,
        samples=TokenSequences.of(torch.tensor(lengths), ones),
        observed_log_ratio=torch.zeros(n_tok),
    )
    algo = AlgorithmConfig(use_rollout_logprobs=True)
    return sampling, token_terms(
        scores=chunked_scores_of_logits(logits, targets, sampling), mb=mb, inputs=inputs, algo=algo
    )


def test_a_tempered_batch_at_t07_top_p09_is_on_policy_with_ratio_one():
    logits = torch.randn(200, VOCAB, generator=torch.Generator().manual_seed(0)) * 2.0
    targets = _sampled(logits, SamplingSpec(temperature=T, top_p=TOP_P), seed=1)
    # what SGLang reports for these tokens: log_softmax(logits / T) over the whole vocabulary
    reported = torch.log_softmax(logits / T, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    sampling, terms = _terms(logits, targets, reported, tempered=[True, True], lengths=[120, 80])
    assert sampling.space == TEMPERED
    assert terms.ratio.tolist() == pytest.approx([1.0] * 200, abs=1e-5)
    assert float(terms.mismatch.max()) < 1e-5
    # the entropy is still that of the distribution sampled from (truncated): below the tempered one's
    tempered_entropy = -(torch.softmax(logits / T, -1) * torch.log_softmax(logits / T, -1)).sum(-1)
    assert bool((terms.entropy < tempered_entropy - 1e-4).all())

    # the same numbers scored as SAMPLING (what the trainer did before the stamp): the ratio is 1 / kept mass
    _, wrong = _terms(logits, targets, reported, tempered=[False, False], lengths=[120, 80])
    support = torch.isfinite(sampling_log_probs(logits, SamplingSpec(temperature=T, top_p=TOP_P)))
    kept_mass = (torch.softmax(logits / T, -1) * support).sum(-1)
    assert wrong.ratio.tolist() == pytest.approx((1 / kept_mass).tolist(), rel=1e-4)
    assert float(wrong.ratio.mean()) > 1.02
    assert float(wrong.mismatch.mean()) > 0.02


def test_a_step_mixing_engines_scores_each_sample_in_its_own_space():
    logits = torch.randn(90, VOCAB, generator=torch.Generator().manual_seed(2)) * 2.0
    spec = SamplingSpec(temperature=T, top_p=TOP_P)
    targets = _sampled(logits, spec, seed=3)
    tempered = torch.log_softmax(logits / T, -1).gather(-1, targets[:, None]).squeeze(-1)
    truncated = sampling_log_probs(logits, spec).gather(-1, targets[:, None]).squeeze(-1)
    reported = torch.cat([tempered[:50], truncated[50:]])  # an SGLang sample, then a native one
    sampling, terms = _terms(logits, targets, reported, tempered=[True, False], lengths=[50, 40])
    assert sampling.space == MIXED
    assert terms.ratio.tolist() == pytest.approx([1.0] * 90, abs=1e-5)


def _batch(space: str | None, *, rollout_id: int = 0, n: int = 2):
    return build_batch(
        rollout_id=rollout_id,
        policy_version=0,
        prompts=[[1, 2]] * n,
        responses=[[3, 4, 5]] * n,
        log_probs=[[-0.1, -0.2, -0.3]] * n,
        rewards=[1.0] * n,
        group_ids=[7] * n,
        finish_reasons=["length"] * n,
        sampling=SamplingSpec(temperature=T, top_p=TOP_P),
        logprob_space=space or "sampling",
    )


def test_the_wire_carries_the_space_and_a_batch_without_it_is_sampling():
    assert decode_batch(encode_batch(_batch("tempered"))).logprob_space == "tempered"
    assert decode_batch(encode_batch(_batch(None))).logprob_space == "sampling"
    # an older producer's batch has no field 20 at all
    old = common_pb2.RolloutBatch()
    old.ParseFromString(encode_batch(_batch(None)))
    old.ClearField("logprob_space")
    assert decode_batch(old.SerializeToString()).logprob_space == "sampling"
    newer = common_pb2.RolloutBatch()
    newer.ParseFromString(encode_batch(_batch("tempered")))
    newer.logprob_space = cast(common_pb2.LogProbSpace, 7)  # a value this version does not know
    with pytest.raises(WireError, match="unknown logprob_space 7"):
        decode_batch(newer.SerializeToString())
    with pytest.raises(WireError, match="unknown logprob_space 'raw'"):
        encode_batch(_batch("raw"))


def test_merge_select_and_the_rank_broadcast_keep_each_samples_space():
    merged = merge_batches([_batch("tempered", n=2), _batch("sampling", rollout_id=1, n=3)])
    assert merged.tempered.tolist() == [True, True, False, False, False]
    assert merged.select([4, 0]).tempered.tolist() == [False, True]
    again = decode_train_batch(*encode_train_batch(merged))  # what rank 0 sends the other trainer ranks
    assert again.tempered.tolist() == merged.tempered.tolist() and again.tempered.dtype == torch.bool
    assert TokenSampling.of(merged).space == MIXED
    assert TokenSampling.of(merge_batches([_batch(None)])).space == SAMPLING
    assert np.asarray(TokenSampling.of(merged).tempered).tolist() == [True] * 6 + [False] * 9

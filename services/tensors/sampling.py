"""The sampling distribution: the one definition the rollout engines sample from and the trainer scores under.

The distribution is: logits / temperature, then top-k, then top-p (nucleus), renormalised (the order Hugging
Face uses; SGLang's rule is joint, the top-p mass measured on the tempered distribution inside the top-k, so with
both set the supports can differ; SGLang reports the untruncated tempered log-probs anyway: docs/algorithms.md).
`sampling_log_probs` is its single definition: the native engine draws tokens from it and reports their
log-probs; the trainer recomputes the same log-probs from teacher-forced logits with the parameters each sample
carries (`RolloutBatch.sampling_*`), so a PPO ratio of an on-policy sample is 1.

Greedy (temperature 0) has a point-mass distribution whose log-probs are all 0, which is useless to a trainer;
for greedy, log-probs are those of the unscaled model distribution (temperature 1, no truncation), which is
what the policy assigns to the chosen tokens.
"""

from __future__ import annotations

import torch

from services.contracts.sampling import SamplingSpec


def sampling_log_probs(logits: torch.Tensor, sampling: SamplingSpec) -> torch.Tensor:
    """[..., vocab] logits -> [..., vocab] float32 log-probs of the sampling distribution
    (-inf for tokens top-k / top-p exclude). Differentiable in the logits (the truncation set is not)."""
    logits = logits.float()
    if sampling.temperature == 0.0:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / sampling.temperature
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))   # ties with the k-th are kept (as HF)
    if sampling.top_p < 1.0:
        logits = _top_p_mask(logits, sampling.top_p)
    return torch.log_softmax(logits, dim=-1)


def _top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose mass reaches top_p (always at least one)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))

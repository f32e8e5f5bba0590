"""Token sampling with log-probs of the distribution actually sampled from.

The sampling distribution is: logits / temperature, then top-k, then top-p (nucleus), renormalised —
the order Hugging Face and SGLang use. `sampling_log_probs` is the single definition of it, so a trainer
(or a test) can recompute rollout log-probs exactly from teacher-forced logits.

Greedy (temperature 0) has a point-mass distribution whose log-probs are all 0, which is useless to a
trainer; for greedy we report log-probs under the unscaled model distribution (temperature 1, no
truncation) instead, which is what the policy assigns to the chosen tokens.
"""

from __future__ import annotations

import torch

from services.rollout.engine import SamplingOptions


def sampling_log_probs(logits: torch.Tensor, sampling: SamplingOptions) -> torch.Tensor:
    """[..., vocab] logits -> [..., vocab] float32 log-probs of the sampling distribution
    (-inf for tokens top-k / top-p exclude)."""
    logits = logits.float()
    if sampling.greedy:
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


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def sample_next(logits: torch.Tensor, sampling: SamplingOptions,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, vocab] logits -> (token ids [batch] int64, their log-probs [batch] float32)."""
    log_probs = sampling_log_probs(logits, sampling)
    if sampling.greedy:
        tokens = torch.argmax(log_probs, dim=-1)
    else:
        tokens = torch.multinomial(log_probs.exp(), num_samples=1, generator=generator).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

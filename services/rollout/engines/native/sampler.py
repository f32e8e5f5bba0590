"""Token sampling with log-probs of the distribution actually sampled from.

The distribution itself (temperature, top-k, top-p) is defined once, in `services.tensors.sampling_dist`, which the
trainer uses too, so it scores each sample under exactly the distribution it was drawn from.

The draw: on a GPU `torch.multinomial`; on the CPU the inverse of each row's cumulative distribution at one uniform
number. torch.multinomial(p, 1) on the CPU is the exponential race, one random number per vocabulary entry: 0.19 s
for 64 rows of 151,936 on this box, where the whole draw by the inverse CDF takes ~0.04 s (bench/bench_sampling.py),
and over a real vocabulary the draw is most of a CPU decode step.
"""

from __future__ import annotations

import torch

from services.contracts.sampling_spec import SamplingSpec
from services.tensors.sampling_dist import sampling_log_probs

__all__ = ["make_generator", "sample_next", "sampling_log_probs"]


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator for one generate call: seeded from `seed`, or from the OS's entropy when it is None (torch's
    default generator would replay the same fixed stream in every fresh process)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def sample_next(
    logits: torch.Tensor, sampling: SamplingSpec, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, vocab] logits -> (token ids [batch] int64, their log-probs [batch] float32)."""
    log_probs = sampling_log_probs(logits, sampling)
    tokens = torch.argmax(log_probs, dim=-1) if sampling.greedy else draw(log_probs.exp(), generator)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of [batch, vocab] probabilities (each row's scale is free; zeros are never drawn)."""
    if probs.device.type != "cpu":
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    cdf = probs.double().cumsum(-1)  # float64: a float32 running sum over 151,936 entries would misweigh rare tokens
    u = torch.rand((probs.shape[0], 1), dtype=torch.float64, generator=generator) * cdf[:, -1:]
    # the first entry whose running sum exceeds u: token i covers [cdf[i-1], cdf[i]), empty when p_i = 0
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)

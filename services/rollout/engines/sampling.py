"""Token sampling with log-probs of the distribution actually sampled from.

The distribution itself (temperature, top-k, top-p) is defined once, in `services.tensors.sampling`, which the
trainer uses too, so it scores each sample under exactly the distribution it was drawn from.
"""

from __future__ import annotations

import torch

from services.contracts.sampling import SamplingSpec
from services.tensors.sampling import sampling_log_probs

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
    if sampling.greedy:
        tokens = torch.argmax(log_probs, dim=-1)
    else:
        tokens = torch.multinomial(log_probs.exp(), num_samples=1, generator=generator).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

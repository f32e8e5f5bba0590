"""Log-probs of sampled tokens under the distribution each was drawn from, from teacher-forced logits.

Each sample carries its sampling parameters (temperature, top-p, top-k; `RolloutBatch.sampling_*`), so a batch
may mix distributions (eval-style greedy samples next to T=0.7 ones, two replicas with different settings).
Two views are needed:

- the sampling distribution (`sampling_log_prob_table`, the shared `services.tensors.sampling` definition,
  truncation included): the PPO ratio, TIS and the entropy, so an on-policy ratio is exactly 1;
- the tempered distribution (`tempered_token_log_probs`, logits / T without truncation): the KL to the reference
  model. Truncated, the KL would be infinite wherever the trained policy picks a token outside the reference's
  nucleus; tempered it is finite, and 0 while the policy equals the reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from services.contracts.sampling import SamplingSpec
from services.tensors.sampling import sampling_log_probs
from services.trainer.advantages import per_token
from services.trainer.batching import TrainBatch


@dataclass(frozen=True)
class TokenSampling:
    """Per response token: the sampling parameters of its sample."""

    temperature: torch.Tensor   # float32 [N]
    top_p: torch.Tensor         # float32 [N]
    top_k: torch.Tensor         # int64 [N]

    @classmethod
    def of(cls, batch: TrainBatch) -> TokenSampling:
        lengths = batch.response_lengths
        return cls(temperature=per_token(batch.sampling_temperature, lengths),
                   top_p=per_token(batch.sampling_top_p, lengths), top_k=per_token(batch.sampling_top_k, lengths))

    def at(self, index: torch.Tensor) -> TokenSampling:
        return TokenSampling(temperature=self.temperature[index], top_p=self.top_p[index], top_k=self.top_k[index])

    def truncates(self, vocab: int) -> bool:
        """Whether top-k or top-p removes tokens anywhere (then sampling and tempered log-probs differ)."""
        cut = (self.top_p < 1.0) | ((self.top_k > 0) & (self.top_k < vocab))
        return bool((cut & (self.temperature != 0)).any())

    def groups(self) -> Iterator[tuple[SamplingSpec, torch.Tensor]]:
        """(distribution, token positions) for each distinct parameter set, in a fixed order."""
        keys = torch.stack([self.temperature.double(), self.top_p.double(), self.top_k.double()], dim=1)
        unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
        for i, (t, p, k) in enumerate(unique.tolist()):   # float32 values, as the rollout's tensors used them
            yield SamplingSpec(temperature=t, top_p=p, top_k=int(k)), torch.nonzero(inverse == i).flatten()


def sampling_log_prob_table(logits: torch.Tensor, sampling: TokenSampling) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 log-probs of each row's sampling distribution (-inf where truncated)."""
    groups = list(sampling.groups())
    if len(groups) == 1:
        return sampling_log_probs(logits, groups[0][0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for dist, rows in groups:
        rows = rows.to(logits.device)
        out[rows] = sampling_log_probs(logits[rows], dist)
    return out


def tempered_token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / T)[target] per row, no truncation (T = 0, greedy, counts as 1)."""
    t = torch.where(temperature == 0, torch.ones_like(temperature), temperature).to(logits.device)
    x = logits.float() / t.unsqueeze(-1)
    return x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


# A token outside a row's top-k / nucleus has log-prob -inf; scored log-probs are floored here instead, so a
# ratio of two of them is 1 (not NaN) and its gradient 0 (clamp passes none below the floor).
LOG_PROB_FLOOR = -1.0e4


def gather_targets(table: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return table.gather(-1, targets.unsqueeze(-1)).squeeze(-1).clamp(min=LOG_PROB_FLOOR)


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, sampling: TokenSampling, *,
                 tempered: bool) -> torch.Tensor:
    """Log-probs of `targets` under each row's sampling distribution, or (tempered) of logits / T untruncated."""
    if tempered:
        return tempered_token_log_probs(logits, targets, sampling.temperature)
    return gather_targets(sampling_log_prob_table(logits, sampling), targets)


def entropy_from_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy per row of a [N, V] log-prob table; truncated (-inf) entries count 0 (and pass no NaN gradient)."""
    finite = torch.isfinite(log_probs)
    safe = log_probs.masked_fill(~finite, 0.0)
    return -(safe.exp().masked_fill(~finite, 0.0) * safe).sum(dim=-1)

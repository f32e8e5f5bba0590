"""Log-probs of sampled tokens under the distribution each was drawn from, from teacher-forced logits.

Each sample carries its sampling parameters (temperature, top-p, top-k; `RolloutBatch.sampling_*`), so a batch
may mix distributions (eval-style greedy samples next to T=0.7 ones, two replicas with different settings).
Two views are needed:

- the sampling distribution (`sampling_log_prob_table`, the shared `services.tensors.sampling` definition,
  truncation included): the entropy, and the PPO ratio, TIS and the log-prob mismatch of samples whose engine
  reports that distribution (the native engine), so an on-policy ratio is exactly 1;
- the tempered distribution (`tempered_token_log_probs`, logits / T without truncation): the KL to the reference
  model (truncated, it would be infinite wherever the trained policy picks a token outside the reference's
  nucleus; tempered it is finite, and 0 while the policy equals the reference), and the ratio, TIS and mismatch of
  samples whose engine reports the tempered distribution (SGLang 0.5.x: `RolloutBatch.logprob_space` TEMPERED).

"The trainer scores what the engine reports": each token's behaviour space is its batch's stamp
(`TrainBatch.logprob_tempered`), so the ratio compares like with like whichever engine sampled (docs/algorithms.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from services.contracts.sampling import SamplingSpec
from services.tensors.sampling import sampling_log_probs
from services.trainer.advantages import per_token
from services.trainer.batching import TrainBatch

# A batch's behaviour log-prob space (TokenSampling.space): every token's, or a mix.
SAMPLING, TEMPERED, MIXED = "sampling", "tempered", "mixed"


def _truncates(spec: SamplingSpec, vocab: int) -> bool:
    return spec.temperature != 0 and (spec.top_p < 1.0 or 0 < spec.top_k < vocab)


@dataclass(frozen=True)
class TokenSampling:
    """Per response token: which of the batch's distinct sampling distributions its sample was drawn from.

    The distinct distributions are found once per batch, over samples (a handful of keys), so a micro-batch of a
    batch drawn under one distribution (the usual case) costs no host work or device sync to score."""

    specs: tuple[SamplingSpec, ...]   # the batch's distinct distributions
    group: torch.Tensor               # int64 [N]: each token's index into `specs`
    temperature: torch.Tensor         # float32 [N] (the tempered log-probs of the KL term)
    tempered: torch.Tensor | None = None   # bool [N]: the token's behaviour space is the tempered one
    space: str = SAMPLING                  # the batch's: SAMPLING, TEMPERED (every token) or MIXED (host side)

    @classmethod
    def of(cls, batch: TrainBatch) -> TokenSampling:
        return cls.per_row(batch.sampling_temperature, batch.sampling_top_p, batch.sampling_top_k,
                           lengths=batch.response_lengths, tempered=batch.tempered)

    @classmethod
    def per_row(cls, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, *,
                lengths: torch.Tensor | None = None, tempered: torch.Tensor | None = None) -> TokenSampling:
        """From one (T, top-p, top-k) per sample, repeated `lengths` times (once per row when None); `tempered`
        (bool per sample, default none): samples whose rollout log-probs are of the tempered distribution."""
        index: dict[tuple[float, float, int], int] = {}
        # float32 values, as the rollout's tensors used them
        keys = zip(temperature.tolist(), top_p.tolist(), top_k.tolist(), strict=True)
        sample_group = torch.tensor([index.setdefault((t, p, int(k)), len(index)) for t, p, k in keys],
                                    dtype=torch.long)
        specs = tuple(SamplingSpec(temperature=t, top_p=p, top_k=k) for t, p, k in index)
        temps = temperature.to(torch.float32)
        tempered = torch.zeros(len(temps), dtype=torch.bool) if tempered is None else tempered.to(torch.bool)
        space = TEMPERED if bool(tempered.all()) else MIXED if bool(tempered.any()) else SAMPLING
        if lengths is not None:
            sample_group, temps, tempered = (per_token(x, lengths) for x in (sample_group, temps, tempered))
        return cls(specs=specs, group=sample_group, temperature=temps, tempered=tempered, space=space)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TokenSampling:
        return TokenSampling(specs=self.specs, group=fn(self.group), temperature=fn(self.temperature),
                             tempered=None if self.tempered is None else fn(self.tempered), space=self.space)

    def at(self, index: torch.Tensor) -> TokenSampling:
        return self._map(lambda x: x[index])

    def to(self, device: torch.device) -> TokenSampling:
        return self._map(lambda x: x.to(device))

    def present(self) -> list[tuple[int, SamplingSpec]]:
        """The distributions these tokens use (one device sync when the batch mixes several)."""
        if len(self.specs) == 1:
            return [(0, self.specs[0])]
        return [(i, self.specs[i]) for i in torch.unique(self.group).tolist()]

    def truncates(self, vocab: int) -> bool:
        """Whether top-k or top-p removes tokens anywhere (then sampling and tempered log-probs differ)."""
        return any(_truncates(spec, vocab) for _, spec in self.present())

    def groups(self) -> Iterator[tuple[SamplingSpec, torch.Tensor | None]]:
        """(distribution, its rows; None = every row) for each distribution these tokens use, in a fixed order."""
        present = self.present()
        if len(present) == 1:
            yield present[0][1], None
            return
        for i, spec in present:
            yield spec, torch.nonzero(self.group == i).flatten()


def sampling_log_prob_table(logits: torch.Tensor, sampling: TokenSampling) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 log-probs of each row's sampling distribution (-inf where truncated)."""
    groups = list(sampling.groups())
    if groups[0][1] is None:
        return sampling_log_probs(logits, groups[0][0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for dist, rows in groups:
        assert rows is not None
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


def behaviour_log_probs(logits: torch.Tensor, targets: torch.Tensor, sampling: TokenSampling, *,
                        table: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probs of `targets` in each row's behaviour space: its sampling distribution (`table`, the rows'
    sampling_log_prob_table, when the caller has it) or, for rows of tempered-space batches, logits / T untruncated.
    Decided on the host from `sampling.space`: one batch of one engine (the usual case) computes one of the two."""
    if sampling.space == TEMPERED:
        return tempered_token_log_probs(logits, targets, sampling.temperature)
    sampled = gather_targets(table if table is not None else sampling_log_prob_table(logits, sampling), targets)
    if sampling.space == SAMPLING:
        return sampled
    assert sampling.tempered is not None
    tempered = tempered_token_log_probs(logits, targets, sampling.temperature)
    return torch.where(sampling.tempered.to(logits.device), tempered, sampled)


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, sampling: TokenSampling, *,
                 tempered: bool) -> torch.Tensor:
    """Log-probs of `targets` in each row's behaviour space (behaviour_log_probs), or (tempered, the KL to the
    reference) of logits / T untruncated for every row."""
    if tempered:
        return tempered_token_log_probs(logits, targets, sampling.temperature)
    return behaviour_log_probs(logits, targets, sampling)


def entropy_from_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy per row of a [N, V] log-prob table; truncated (-inf) entries count 0 (and pass no NaN gradient)."""
    finite = torch.isfinite(log_probs)
    safe = log_probs.masked_fill(~finite, 0.0)
    return -(safe.exp().masked_fill(~finite, 0.0) * safe).sum(dim=-1)

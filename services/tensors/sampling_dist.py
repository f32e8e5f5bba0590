"""The sampling distribution: the one definition the rollout engines sample from and the trainer scores under.

The distribution is: logits / temperature, then top-k, then top-p (nucleus), renormalised (the order Hugging
Face uses; SGLang's rule is joint, the top-p mass measured on the tempered distribution inside the top-k, so with
both set the supports can differ; SGLang reports the untruncated tempered log-probs anyway: docs/algorithms.md).
`sampling_log_probs` is its single definition: the native engine draws tokens from it and reports their
log-probs; the trainer recomputes the same log-probs with the parameters each sample carries
(`RolloutBatch.sampling_*`), so a PPO ratio of an on-policy sample is 1. The trainer's chunked scoring
(trainer/algo/head_scoring.py) calls the same `truncation` on each chunk of rows, one (T, top-k, top-p) per row.

A row's truncation is one number (`Truncation`): the smallest kept value; the support is every entry at or above
it. Top-k keeps every entry tied with the k-th (as HF); top-p keeps the smallest set of most likely entries whose
mass reaches top_p, and every entry tied with the last of them (as top-k does with the k-th: no arbitrary choice
among equal logits, which bf16 logits often have). The number rebuilds the support exactly without sorting again
(the trainer's backward recomputes it per chunk).

When every row that uses top-p also uses top-k, the nucleus is sought among the top-k entries only (the `topk` that
found the k-th value, instead of a sort over the whole vocabulary: bench/bench_sampling.py measures both at
151,936).

Greedy (temperature 0) has a point-mass distribution whose log-probs are all 0, which is useless to a trainer;
for greedy, log-probs are those of the unscaled model distribution (temperature 1, no truncation), which is
what the policy assigns to the chosen tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.contracts.sampling_spec import SamplingSpec

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowSampling:
    """One sampling distribution per row of a [R, V] block of logits, and the host-side facts that decide which
    passes run (so deciding costs no device sync)."""

    temperature: torch.Tensor  # float32 [R]: the divisor (1 for greedy rows)
    top_k: torch.Tensor  # int64 [R]: 0 = off (greedy rows: off)
    top_p: torch.Tensor  # float32 [R]: 1 = off (greedy rows: off)
    max_top_k: int  # the largest top-k any row uses (0: none truncates by top-k)
    uses_top_p: bool  # some row truncates by top-p
    top_p_within_top_k: bool  # every row that uses top-p also uses top-k: the nucleus lies in the top-k

    @property
    def truncates(self) -> bool:
        return self.max_top_k > 0 or self.uses_top_p

    @classmethod
    def of_rows(
        cls,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        *,
        specs: Sequence[SamplingSpec],
        vocab: int,
    ) -> RowSampling:
        """Row i draws from (temperature[i], top_k[i], top_p[i]) as its spec gave them, one of `specs` (the host's
        view of the same rows, which decides the passes)."""
        greedy = temperature == 0
        live = [s for s in specs if not s.greedy]
        top_ks = [s.top_k for s in live if 0 < s.top_k < vocab]
        return cls(
            temperature=torch.where(greedy, torch.ones_like(temperature), temperature).float(),
            top_k=torch.where(greedy | (top_k >= vocab), torch.zeros_like(top_k), top_k).long(),
            top_p=torch.where(greedy, torch.ones_like(top_p), top_p).float(),
            max_top_k=max(top_ks, default=0),
            uses_top_p=any(s.top_p < 1.0 for s in live),
            top_p_within_top_k=all(0 < s.top_k < vocab for s in live if s.top_p < 1.0),
        )

    @classmethod
    def of_spec(cls, spec: SamplingSpec, rows: int, vocab: int, device: torch.device) -> RowSampling:
        """Every row from `spec` (filled on the device: no host-to-device copy, which would wait for the queue)."""

        def fill(value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((rows,), value, dtype=dtype, device=device)

        return cls.of_rows(
            fill(spec.temperature, torch.float32),
            fill(spec.top_k, torch.long),
            fill(spec.top_p, torch.float32),
            specs=[spec],
            vocab=vocab,
        )

    def rows(self, start: int, stop: int) -> RowSampling:
        return RowSampling(
            temperature=self.temperature[start:stop],
            top_k=self.top_k[start:stop],
            top_p=self.top_p[start:stop],
            max_top_k=self.max_top_k,
            uses_top_p=self.uses_top_p,
            top_p_within_top_k=self.top_p_within_top_k,
        )


@dataclass(frozen=True)
class Truncation:
    """Per row: the support is every entry at or above `threshold` (-inf keeps everything)."""

    threshold: torch.Tensor  # float32 [R]

    def keep(self, scaled: torch.Tensor) -> torch.Tensor:
        """bool [R, V]: the support, from the scaled logits it was found on."""
        return scaled >= self.threshold.unsqueeze(-1)

    def apply(self, scaled: torch.Tensor) -> torch.Tensor:
        """The scaled logits with -inf outside the support."""
        return scaled.masked_fill(scaled < self.threshold.unsqueeze(-1), NEG_INF)


def truncation(scaled: torch.Tensor, rows: RowSampling) -> Truncation:
    """The support of each row of [R, V] float32 scaled logits (logits / T) under its top-k, then top-p."""
    n = scaled.shape[0]
    kth = torch.full((n,), NEG_INF, dtype=torch.float32, device=scaled.device)
    window = scaled[:, :0]
    if rows.max_top_k > 0:
        window = torch.topk(scaled, rows.max_top_k, dim=-1).values  # sorted, largest first
        picked = window.gather(-1, (rows.top_k.clamp(min=1, max=rows.max_top_k) - 1).unsqueeze(-1)).squeeze(-1)
        kth = torch.where(rows.top_k > 0, picked, kth)
    if not rows.uses_top_p:
        return Truncation(kth)
    edge = kth.unsqueeze(-1)
    if rows.top_p_within_top_k:  # each row's top-k set, largest first, is in the window (but ties beyond it)
        ordered = window.masked_fill(window < edge, NEG_INF)
        beyond = ((scaled == edge).sum(dim=-1) - (ordered == edge).sum(dim=-1)).float()
        log_norm = torch.logsumexp(ordered, dim=-1)
        log_norm = torch.where(beyond > 0, torch.logaddexp(log_norm, kth + beyond.clamp(min=1).log()), log_norm)
        probs = torch.exp(ordered - log_norm.unsqueeze(-1))
    else:
        ordered = torch.sort(
            scaled.masked_fill(scaled < edge, NEG_INF) if rows.max_top_k else scaled, dim=-1, descending=True
        ).values
        probs = torch.softmax(ordered, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    kept = (mass_before < rows.top_p.unsqueeze(-1)) & (ordered > NEG_INF)
    kept[:, 0] = True
    threshold = ordered.gather(-1, (kept.sum(dim=-1) - 1).unsqueeze(-1)).squeeze(-1)
    return Truncation(torch.where(rows.top_p < 1.0, threshold, kth))


def scaled_logits(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """[R, V] logits -> float32 logits / T per row (a new tensor; the division by the float32 temperatures computes
    in float32, one pass over bf16 logits)."""
    return logits / rows.temperature.unsqueeze(-1)


def sampling_log_probs(logits: torch.Tensor, sampling: SamplingSpec) -> torch.Tensor:
    """[..., vocab] logits -> [..., vocab] float32 log-probs of the sampling distribution
    (-inf for tokens top-k / top-p exclude). Differentiable in the logits (the truncation set is not)."""
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1])
    rows = RowSampling.of_spec(sampling, flat.shape[0], shape[-1], flat.device)
    scaled = scaled_logits(flat, rows)
    if rows.truncates:
        with torch.no_grad():
            cut = truncation(scaled, rows)
        scaled = cut.apply(scaled)
    return torch.log_softmax(scaled, dim=-1).reshape(shape)

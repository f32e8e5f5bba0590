"""Rollout correction: importance weights, rejection and veto on each token's ratio r_t = pi_trainer / pi_behaviour,
and the training-inference mismatch metrics (docs/algorithms.md, "Rollout correction").

`log_ratio` is the trainer's log-prob (the old actor's snapshot of the token's own version, or the policy before the
step) minus the behaviour log-prob the engine reported for that token, both in the sample's log-prob space. Tokens
with loss_mask 0 take no part: they are in no sequence's sum or mean and are never counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.contracts.algorithm_config import CorrectionLevel, RolloutCorrection

MAX_LOG_RATIO = 20.0  # exp overflow guard (verl's SAFETY_BOUND); only from above, so a token outside the nucleus
# (log-prob floored at -1e4) keeps weight 0 as before
QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)


@dataclass(frozen=True)
class TokenSequences:
    """Which sample each token belongs to (a sample never spans two micro-batches) and which tokens are trainable."""

    ids: torch.Tensor  # int64 [N], in [0, count)
    count: int
    trainable: torch.Tensor  # bool [N]

    @classmethod
    def of(cls, response_lengths: torch.Tensor, loss_mask: torch.Tensor) -> TokenSequences:
        """A batch's samples, from its flat layout (on `loss_mask`'s device)."""
        ids = torch.repeat_interleave(torch.arange(len(response_lengths)), response_lengths.to(torch.long))
        return cls(ids=ids.to(loss_mask.device), count=len(response_lengths), trainable=loss_mask > 0)

    def sums(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence: (the sum of `values` over its trainable tokens, how many there are), float64."""
        picked = torch.where(self.trainable, values.double(), torch.zeros_like(values, dtype=torch.float64))
        total = torch.zeros(self.count, dtype=torch.float64, device=values.device).index_add_(0, self.ids, picked)
        size = torch.zeros(self.count, dtype=torch.float64, device=values.device).index_add_(
            0, self.ids, self.trainable.double()
        )
        return total, size

    def flagged(self, flags: torch.Tensor) -> torch.Tensor:
        """Per sequence: whether any of its trainable tokens has `flags`."""
        hits = torch.zeros(self.count, dtype=torch.float64, device=flags.device)
        return hits.index_add_(0, self.ids, (self.trainable & flags).double()) > 0


def level_log_ratio(log_ratio: torch.Tensor, seqs: TokenSequences, level: CorrectionLevel) -> torch.Tensor:
    """Per token, the log of the ratio at `level`: its own (token), its sequence's sum (sequence: the product of the
    ratios) or mean (geometric: their geometric mean)."""
    if level == "token":
        return log_ratio
    total, size = seqs.sums(log_ratio)
    per_seq = total if level == "sequence" else total / size.clamp(min=1.0)
    return per_seq[seqs.ids].to(log_ratio.dtype)


def ratio_at(log_ratio: torch.Tensor, seqs: TokenSequences, level: CorrectionLevel) -> torch.Tensor:
    return torch.exp(level_log_ratio(log_ratio, seqs, level).clamp(max=MAX_LOG_RATIO))


@dataclass(frozen=True)
class Correction:
    """Per token, no gradient: the weight on its loss (the importance weight, 1 without `is`; 0 when dropped),
    whether it was kept (not rejected, not vetoed) and whether its importance weight was truncated."""

    weight: torch.Tensor  # float32 [N]
    kept: torch.Tensor  # bool [N]
    truncated: torch.Tensor  # bool [N]


def correct(log_ratio: torch.Tensor, seqs: TokenSequences, cfg: RolloutCorrection) -> Correction:
    log_ratio = torch.where(seqs.trainable, log_ratio.detach(), torch.zeros_like(log_ratio))  # masked: may be NaN
    weight = torch.ones_like(log_ratio)
    truncated = torch.zeros_like(seqs.trainable)
    if cfg.is_level != "off":
        weight = ratio_at(log_ratio, seqs, cfg.is_level)
        low = 0.0 if cfg.is_min is None else cfg.is_min
        high = math.inf if cfg.is_cap is None else cfg.is_cap
        truncated = seqs.trainable & ((weight < low) | (weight > high))
        weight = weight.clamp(min=low, max=high)
    kept = torch.ones_like(seqs.trainable)
    if cfg.rejection != "off":
        assert cfg.high is not None  # the config requires it
        ratio = ratio_at(log_ratio, seqs, cfg.rejection)
        kept = (ratio >= cfg.low_bound) & (ratio <= cfg.high)
    if cfg.veto is not None:
        kept = kept & ~seqs.flagged(log_ratio < math.log(cfg.veto))[seqs.ids]
    return Correction(weight=torch.where(kept, weight, torch.zeros_like(weight)), kept=kept, truncated=truncated)


def mismatch_metrics(
    log_ratio: torch.Tensor, rollout_log_probs: torch.Tensor, seqs: TokenSequences, cfg: RolloutCorrection
) -> dict[str, float]:
    """The step's training-inference mismatch over its trainable tokens with a finite ratio (verl's
    compute_offpolicy_metrics; docs/algorithms.md): KL(behaviour || trainer) by k1 and k3, the perplexity ratio, chi^2,
    the ratio's range and quantiles, and what the correction dropped or truncated (fractions of tokens and of
    sequences). Empty when no token qualifies."""
    valid = seqs.trainable & torch.isfinite(log_ratio) & torch.isfinite(rollout_log_probs)
    if not bool(valid.any()):
        return {}
    lr = log_ratio.double()
    picked = lr[valid]
    seqs = TokenSequences(seqs.ids, seqs.count, valid)
    total, size = seqs.sums(lr)
    has_tokens = size > 0
    # ppl_ratio: per sequence, trainer perplexity / behaviour perplexity = exp(mean(behaviour - trainer)); batch mean
    ppl_ratio = torch.exp(-(total[has_tokens] / size[has_tokens])).mean()
    ratio = torch.exp(picked.clamp(max=MAX_LOG_RATIO))
    out = {
        "mismatch/kl": float((-picked).mean()),
        "mismatch/kl_k3": float((torch.exp(picked) - picked - 1.0).mean()),
        "mismatch/ppl_ratio": float(ppl_ratio),
        "mismatch/chi2": float(torch.exp(picked.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).square().mean() - 1.0),
        "mismatch/ratio_min": float(ratio.min()),
        "mismatch/ratio_max": float(ratio.max()),
    }
    qs = torch.quantile(ratio, torch.tensor(QUANTILES, dtype=torch.float64, device=ratio.device))
    out.update({f"mismatch/ratio_p{round(q * 100):02d}": float(v) for q, v in zip(QUANTILES, qs, strict=True)})
    corr = correct(log_ratio.masked_fill(~valid, 0.0), seqs, cfg)
    num_seqs = float(has_tokens.sum())
    for name, flags in (("masked", ~corr.kept), ("truncated", corr.truncated)):
        hit = valid & flags
        out[f"mismatch/token_{name}_frac"] = float(hit[valid].double().mean())
        out[f"mismatch/seq_{name}_frac"] = float(seqs.flagged(flags).sum()) / num_seqs
    return out

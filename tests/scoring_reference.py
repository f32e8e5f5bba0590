"""The trainer's scoring before chunking (issue 31), kept as the reference the chunked head is tested against and the
"old path" bench/bench_train_step.py measures: full [tokens x vocab] logits, then whole-vocabulary tables per
sampling distribution (a sort over the vocabulary for top-p), gathered and differentiated by autograd.

`reference_scores` returns what `services.trainer.algo.head_scoring.ChunkedScores` returns, [3, N]: the behaviour
log-prob (sampling space floored at LOG_PROB_FLOOR, or tempered), the entropy of the sampling distribution and the
tempered log-prob.
"""

from __future__ import annotations

import torch

from services.contracts.sampling_spec import SamplingSpec
from services.trainer.algo.scoring import LOG_PROB_FLOOR, TokenSampling


def table_log_probs(logits: torch.Tensor, sampling: SamplingSpec) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 log-probs of the sampling distribution (-inf where truncated)."""
    logits = logits.float()
    if sampling.temperature == 0.0:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / sampling.temperature
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= sampling.top_p
        drop_sorted[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sampling_log_prob_table(logits: torch.Tensor, sampling: TokenSampling) -> torch.Tensor:
    """[N, V] -> [N, V] log-probs of each row's sampling distribution, one pass per distinct distribution."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for i, spec in enumerate(sampling.specs):
        rows = torch.nonzero(sampling.group == i).flatten()
        if rows.numel():
            out[rows] = table_log_probs(logits[rows], spec)
    return out


def tempered_token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / T)[target] per row, no truncation (T = 0, greedy, counts as 1)."""
    t = torch.where(temperature == 0, torch.ones_like(temperature), temperature).to(logits.device)
    x = logits.float() / t.unsqueeze(-1)
    return x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


def entropy_from_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy per row of a [N, V] log-prob table; truncated (-inf) entries count 0 (and pass no NaN gradient)."""
    finite = torch.isfinite(log_probs)
    safe = log_probs.masked_fill(~finite, 0.0)
    return -(safe.exp().masked_fill(~finite, 0.0) * safe).sum(dim=-1)


def reference_scores(
    logits: torch.Tensor,
    targets: torch.Tensor,
    sampling: TokenSampling,
    *,
    tempered: bool = False,
    entropy_grad: bool = True,
) -> torch.Tensor:
    """[N, V] logits -> [3, N] (behaviour, entropy, tempered), as the actor and the frozen passes scored them: the
    KL's reference pass (`tempered`) from logits / T alone; the actor's from the sampling table, and from logits / T
    again only where some distribution truncates (else the table is the tempered distribution); the entropy from
    the table detached unless `entropy_grad` (the entropy is in the loss)."""
    if tempered:
        temp = tempered_token_log_probs(logits, targets, sampling.temperature)
        return torch.stack([temp, torch.zeros_like(temp), temp])
    table = sampling_log_prob_table(logits, sampling)
    at_target = table.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    truncates = any(s.temperature != 0 and (s.top_p < 1.0 or 0 < s.top_k < logits.shape[-1]) for s in sampling.specs)
    temp = tempered_token_log_probs(logits, targets, sampling.temperature) if truncates else at_target
    behaviour = torch.where(sampling.tempered.to(logits.device), temp, at_target.clamp(min=LOG_PROB_FLOOR))
    return torch.stack([behaviour, entropy_from_log_probs(table if entropy_grad else table.detach()), temp])


def chunked_scores_of_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    sampling: TokenSampling,
    *,
    chunk_tokens: int = 7,
    tempered: bool = False,
    entropy_grad: bool = True,
) -> torch.Tensor:
    """The chunked head's [3, N] scores of given [N, V] logits: hidden = the logits, weight = the identity (so the
    head's logits are exactly these); differentiable in `logits`."""
    from services.trainer.algo.head_scoring import ChunkedScores
    from services.trainer.algo.scoring import score_request
    from services.trainer.batching import MicroBatch

    n, vocab = logits.shape
    row = torch.zeros(1, n + 1, dtype=torch.long)
    mb = MicroBatch(
        input_ids=row,
        attention_mask=torch.ones_like(row),
        rows=torch.zeros(n, dtype=torch.long),
        positions=torch.arange(n),
        targets=targets,
        token_index=torch.arange(n),
        num_tokens=n + 1,
    )
    request = score_request(
        mb,
        sampling,
        vocab=vocab,
        chunk_tokens=chunk_tokens,
        tempered=tempered,
        entropy=not tempered,
        entropy_grad=entropy_grad,
    )
    return ChunkedScores.apply(logits, torch.eye(vocab, dtype=logits.dtype, device=logits.device), request)

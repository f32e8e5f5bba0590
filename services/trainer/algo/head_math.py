"""The per-chunk math of the chunked scoring head (head_scoring.py): scores and d scores / d logits of a chunk of
tokens, from their hidden states and the head's weight, never holding more than a chunk's logits.

Two layouts of a chunk:
- vocabulary blocks (no row truncates): [rows x block] logits at a time, the log-sum-exp and the entropy
  accumulated online across blocks (a running maximum m, s = sum exp(a - m), q = sum exp(a - m) (a - m));
- whole rows (some row truncates by top-k / top-p, whose support needs its row sorted): fewer rows at a time, the
  same number of logits. The backward recomputes the same row sets with the same matrix shapes as the forward, so
  the support it rebuilds from its threshold is the forward's bit for bit.

With a = logits / T, p_t = softmax(a), p_s the truncated renormalised distribution on the support S, lp_s = log p_s
and H = -sum p_s lp_s:  d lp_t[y] / da = e_y - p_t;  d lp_s[y] / da = e_y - p_s (0 where y lies outside S or the
floor clamps it);  d H / da = -p_s (lp_s + H) on S, 0 outside;  d / dlogits = (d / da) / T.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.tensors.sampling_dist import NEG_INF, RowSampling, Truncation, scaled_logits, truncation

# A token outside a row's top-k / nucleus has log-prob -inf; scored log-probs are floored here instead, so a
# ratio of two of them is 1 (not NaN) and its gradient 0 (no gradient passes below the floor).
LOG_PROB_FLOOR = -1.0e4
BEHAVIOUR_ROW, ENTROPY_ROW, TEMPERED_ROW = 0, 1, 2  # the rows of the [3, N] scores
LSE_T, LSE_S, ENTROPY, PASSES = 0, 1, 2, 3  # the rows of the [4, N] statistics the backward reads


@dataclass(frozen=True)
class ChunkTask:
    """One chunk of a score request: its rows' hidden states and distributions, and what to compute."""

    hidden: torch.Tensor  # [C, H]
    targets: torch.Tensor  # [C]
    rows: RowSampling
    tempered_space: torch.Tensor  # bool [C]
    entropy: bool
    entropy_grad: bool


@dataclass(frozen=True)
class Upstream:
    """The chunk's incoming gradients, as coefficients of e_y, p_t and p_s, and the entropy's (module docstring)."""

    at_target: torch.Tensor  # times e_y
    coef_t: torch.Tensor  # times -p_t
    coef_s: torch.Tensor  # times -p_s
    entropy: torch.Tensor  # times -p_s (lp_s + H)

    @classmethod
    def of(cls, grad: torch.Tensor, stats: torch.Tensor, tempered_space: torch.Tensor) -> Upstream:
        g_b, g_h, g_t = (grad[i].float() for i in (BEHAVIOUR_ROW, ENTROPY_ROW, TEMPERED_ROW))
        passes, zero = stats[PASSES] > 0, torch.zeros_like(g_b)
        return cls(
            at_target=g_t + torch.where(tempered_space | passes, g_b, zero),
            coef_t=g_t + torch.where(tempered_space, g_b, zero),
            coef_s=torch.where(~tempered_space & passes, g_b, zero),
            entropy=g_h,
        )


def _scores(
    task: ChunkTask,
    target: torch.Tensor,
    in_support: torch.Tensor,
    top: torch.Tensor,
    sum_t: torch.Tensor,
    sum_s: torch.Tensor,
    entropy: torch.Tensor | None,
    out: torch.Tensor,
    stats: torch.Tensor,
) -> None:
    """Writes the chunk's [3, C] scores and [4, C] statistics from its per-row sums (`target`: a[y] - top, the
    sums of exp(a - top) over the vocabulary and over the support), rounding as log_softmax does."""
    log_t, log_s = sum_t.log(), sum_s.log()
    tempered = target - log_t
    sampled = torch.where(in_support, target - log_s, torch.full_like(target, NEG_INF))
    passes = sampled >= LOG_PROB_FLOOR  # the clamp passes a gradient here only
    out[BEHAVIOUR_ROW] = torch.where(task.tempered_space, tempered, sampled.clamp(min=LOG_PROB_FLOOR))
    out[TEMPERED_ROW] = tempered
    stats[LSE_T], stats[LSE_S], stats[PASSES] = top + log_t, top + log_s, passes.float()
    if entropy is not None:
        out[ENTROPY_ROW] = stats[ENTROPY] = entropy


def forward_rows(task: ChunkTask, weight: torch.Tensor, out: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """Whole rows: scores and statistics; returns each row's support threshold."""
    scaled = scaled_logits(task.hidden @ weight.t(), task.rows)
    cut = truncation(scaled, task.rows)
    keep = cut.keep(scaled)
    targets = task.targets.unsqueeze(-1)
    top = scaled.amax(dim=-1)  # always in the support
    shifted = scaled.sub_(top.unsqueeze(-1))
    target, in_support = shifted.gather(-1, targets).squeeze(-1), keep.gather(-1, targets).squeeze(-1)
    weights = shifted.exp()
    sum_t = weights.sum(dim=-1)
    weights.masked_fill_(~keep, 0.0)
    sum_s = weights.sum(dim=-1)
    entropy = sum_s.log() - torch.linalg.vecdot(weights, shifted) / sum_s if task.entropy else None
    _scores(task, target, in_support, top, sum_t, sum_s, entropy, out, stats)
    return cut.threshold


def block_stats(
    logits: torch.Tensor, temperature: torch.Tensor, columns: torch.Tensor, inside: torch.Tensor, moments: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One vocabulary block of [C, cols] logits: its row maximum m of a = logits / T, sum exp(a - m),
    sum exp(a - m) (a - m) (when `moments`), and a[y] where the target lies in the block (0 elsewhere).
    Pure tensor math: on a GPU torch.compile fuses it into a pass or two over the block (`compiled`)."""
    scaled = logits / temperature.unsqueeze(-1)
    top = scaled.amax(dim=-1)
    picked = torch.where(inside, scaled.gather(-1, columns.unsqueeze(-1)).squeeze(-1), torch.zeros_like(top))
    shifted = scaled.sub_(top.unsqueeze(-1))
    weights = shifted.exp()
    moment = torch.linalg.vecdot(weights, shifted) if moments else torch.zeros_like(top)
    return top, weights.sum(dim=-1), moment, picked


def _merge(
    acc: tuple[torch.Tensor, torch.Tensor, torch.Tensor], block: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online log-sum-exp and moment: (m, s, q) of two column sets, each relative to its own maximum."""
    (top_a, sum_a, mom_a), (top_b, sum_b, mom_b) = acc, block
    top = torch.maximum(top_a, top_b)
    scale_a, scale_b = torch.exp(top_a - top), torch.exp(top_b - top)  # 0 for an empty accumulator (m = -inf)
    shift_a = torch.where(sum_a > 0, (top - top_a) * sum_a, torch.zeros_like(sum_a))
    return (
        top,
        sum_a * scale_a + sum_b * scale_b,
        scale_a * (mom_a - shift_a) + scale_b * (mom_b - (top - top_b) * sum_b),
    )


def forward_blocks(
    task: ChunkTask, weight: torch.Tensor, block: int, out: torch.Tensor, stats: torch.Tensor, compiled: bool = False
) -> None:
    """No truncation: scores and statistics over vocabulary blocks, accumulated online."""
    n, vocab = task.hidden.shape[0], weight.shape[0]
    stats_of = _compiled("block_stats") if compiled else block_stats
    acc = (
        torch.full((n,), NEG_INF, device=task.hidden.device),
        torch.zeros(n, device=task.hidden.device),
        torch.zeros(n, device=task.hidden.device),
    )
    target = torch.zeros(n, device=task.hidden.device)
    for start in range(0, vocab, block):
        logits = task.hidden @ weight[start : start + block].t()
        columns, inside = _columns(task.targets, start, logits.shape[1])
        top, total, moment, picked = stats_of(logits, task.rows.temperature, columns, inside, task.entropy)
        target = target + picked
        acc = _merge(acc, (top, total, moment))
    top, total, moment = acc
    entropy = total.log() - moment / total if task.entropy else None
    _scores(task, target - top, torch.ones_like(target, dtype=torch.bool), top, total, total, entropy, out, stats)


def _columns(targets: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's column in the block [start, start + width) (clamped) and whether it lies there."""
    inside = (targets >= start) & (targets < start + width)
    return (targets - start).clamp(0, width - 1), inside


def _grad(
    scaled: torch.Tensor, keep: torch.Tensor, stats: torch.Tensor, up: Upstream, with_entropy: bool
) -> torch.Tensor:
    """-(coef_t p_t + p_s (coef_s + g_H (lp_s + H))) over whole rows' scaled logits (consumed), without e_y."""
    lse_t, lse_s, entropy = (stats[i].unsqueeze(-1) for i in (LSE_T, LSE_S, ENTROPY))
    lp_s = scaled.sub(lse_s)
    g = lp_s.exp().masked_fill_(~keep, 0.0)  # p_s
    if with_entropy:
        g.mul_(lp_s.add_(entropy).mul_(up.entropy.unsqueeze(-1)).add_(up.coef_s.unsqueeze(-1))).neg_()
    else:
        g.mul_(-up.coef_s.unsqueeze(-1))
    del lp_s
    return g.sub_(scaled.sub_(lse_t).exp_().mul_(up.coef_t.unsqueeze(-1)))  # p_t, in place over the logits


def _finish(
    g: torch.Tensor, columns: torch.Tensor, inside: torch.Tensor, at_target: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """Adds e_y for the targets inside these columns, divides by T: d loss / d logits."""
    g.scatter_add_(-1, columns.unsqueeze(-1), torch.where(inside, at_target, torch.zeros_like(at_target)).unsqueeze(-1))
    return g.div_(temperature.unsqueeze(-1))


def block_grad(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    coef: torch.Tensor,
    entropy_coef: torch.Tensor,
    columns: torch.Tensor,
    inside: torch.Tensor,
    at_target: torch.Tensor,
    with_entropy: bool,
) -> torch.Tensor:
    """d loss / d logits of one untruncated block, in the logits' dtype: -p (coef + g_H (lp + H)) + e_y, over T.
    Pure tensor math, compiled on a GPU like `block_stats`."""
    lp = logits / temperature.unsqueeze(-1) - lse.unsqueeze(-1)
    g = lp.exp()
    inner = coef.unsqueeze(-1)
    if with_entropy:
        inner = lp.add_(entropy.unsqueeze(-1)).mul_(entropy_coef.unsqueeze(-1)).add_(inner)
    g.mul_(inner).neg_()
    return _finish(g, columns, inside, at_target, temperature).to(logits.dtype)


def grad_rows(
    task: ChunkTask, weight: torch.Tensor, stats: torch.Tensor, up: Upstream, threshold: torch.Tensor
) -> torch.Tensor:
    """Whole rows, the forward's row set: d loss / d logits [C, V] in the weight's dtype."""
    scaled = scaled_logits(task.hidden @ weight.t(), task.rows)
    keep = Truncation(threshold).keep(scaled)
    g = _grad(scaled, keep, stats, up, task.entropy and task.entropy_grad)
    columns, inside = _columns(task.targets, 0, g.shape[1])
    return _finish(g, columns, inside, up.at_target, task.rows.temperature).to(weight.dtype)


def grad_blocks(
    task: ChunkTask,
    weight: torch.Tensor,
    stats: torch.Tensor,
    up: Upstream,
    block: int,
    grad_weight: torch.Tensor | None,
    compiled: bool = False,
) -> torch.Tensor:
    """No truncation, by vocabulary blocks: adds each block's G^T h to `grad_weight` (float32) and returns
    d loss / d hidden [C, H] (float32)."""
    grad_of = _compiled("block_grad") if compiled else block_grad
    grad_hidden = torch.zeros(task.hidden.shape, dtype=torch.float32, device=task.hidden.device)
    coef = up.coef_t + up.coef_s  # p_s = p_t without truncation
    for start in range(0, weight.shape[0], block):
        part = weight[start : start + block]
        logits = task.hidden @ part.t()
        columns, inside = _columns(task.targets, start, logits.shape[1])
        g = grad_of(
            logits,
            task.rows.temperature,
            stats[LSE_T],
            stats[ENTROPY],
            coef,
            up.entropy,
            columns,
            inside,
            up.at_target,
            task.entropy and task.entropy_grad,
        ).to(weight.dtype)
        grad_hidden += (g @ part).float()
        if grad_weight is not None:
            grad_weight[start : start + block] += (g.t() @ task.hidden).float()
    return grad_hidden


_COMPILED: dict[str, Callable[..., Any]] = {}


def _compiled(name: str) -> Callable[..., Any]:
    """torch.compile of block_stats / block_grad (dynamic shapes: chunks and blocks at the ends are shorter),
    made once per process."""
    if name not in _COMPILED:
        plain: Callable[..., Any] = block_stats if name == "block_stats" else block_grad
        _COMPILED[name] = torch.compile(plain, dynamic=True)
    return _COMPILED[name]

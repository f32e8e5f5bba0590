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

    def rows(self, start: int, stop: int) -> Upstream:
        """A chunk's rows (views: the coefficients are computed once for the whole request)."""
        return Upstream(*(x[start:stop] for x in (self.at_target, self.coef_t, self.coef_s, self.entropy)))


@dataclass(frozen=True)
class RowSums:
    """Per row, what its scores come from (a = logits / T): the maximum of a (`top`, always in the support), a[y] -
    top, sum exp(a - top) over the vocabulary and (None: no row truncates, the support is the vocabulary) over the
    support with whether y lies in it, sum over the support of exp(a - top) (a - top) (None: no entropy asked) and
    the support's threshold (whole rows only). Each chunk writes its rows' into one [N, fields] buffer of the
    request (one op), and the scores are computed once from it (`row_scores`): a chunk's own ops are its passes over
    its logits, and no chunk leaves small tensors behind between the big ones (the CPU allocator's peak would grow
    with them)."""

    top: torch.Tensor
    target: torch.Tensor
    sum_t: torch.Tensor
    sum_s: torch.Tensor | None = None
    in_support: torch.Tensor | None = None  # bool
    moment: torch.Tensor | None = None
    threshold: torch.Tensor | None = None

    @staticmethod
    def fields(*, support: bool, moment: bool) -> int:
        return 3 + 3 * support + moment

    def write(self, out: torch.Tensor) -> None:
        """Into `out` [rows, fields], in the order `read` expects."""
        columns = [self.top, self.target, self.sum_t]
        if self.sum_s is not None and self.in_support is not None and self.threshold is not None:
            columns += [self.sum_s, self.in_support.float(), self.threshold]
        if self.moment is not None:
            columns.append(self.moment)
        torch.stack(columns, dim=1, out=out)

    @classmethod
    def read(cls, buffer: torch.Tensor, *, support: bool, moment: bool) -> RowSums:
        """What the chunks wrote into `buffer` [N, fields] (column views)."""
        top, target, sum_t = buffer[:, 0], buffer[:, 1], buffer[:, 2]
        sum_s, in_support, threshold = (buffer[:, 3], buffer[:, 4] > 0, buffer[:, 5]) if support else (None,) * 3
        return cls(top, target, sum_t, sum_s, in_support, buffer[:, -1] if moment else None, threshold)


def row_scores(sums: RowSums, tempered_space: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The [3, N] scores and the [4, N] statistics the backward reads, from the rows' sums, rounding as log_softmax
    does; a token outside its row's support has log-prob -inf in the sampling space, floored at LOG_PROB_FLOOR."""
    log_t = sums.sum_t.log()
    tempered = sums.target - log_t
    if sums.sum_s is None or sums.in_support is None:
        sum_s, log_s, sampled = sums.sum_t, log_t, tempered
    else:
        sum_s, log_s = sums.sum_s, sums.sum_s.log()
        sampled = torch.where(sums.in_support, sums.target - log_s, torch.full_like(tempered, NEG_INF))
    passes = sampled >= LOG_PROB_FLOOR  # the clamp passes a gradient here only
    behaviour = torch.where(tempered_space, tempered, sampled.clamp(min=LOG_PROB_FLOOR))
    entropy = torch.zeros_like(tempered) if sums.moment is None else log_s - sums.moment / sum_s
    scores = {BEHAVIOUR_ROW: behaviour, ENTROPY_ROW: entropy, TEMPERED_ROW: tempered}
    stats = {LSE_T: sums.top + log_t, LSE_S: sums.top + log_s, ENTROPY: entropy, PASSES: passes.float()}
    return torch.stack([scores[i] for i in range(3)]), torch.stack([stats[i] for i in range(4)])


def forward_rows(task: ChunkTask, weight: torch.Tensor) -> RowSums:
    """Whole rows: their sums over the vocabulary and over each row's support, and its threshold."""
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
    moment = torch.linalg.vecdot(weights, shifted) if task.entropy else None
    return RowSums(top, target, sum_t, sum_s, in_support, moment, cut.threshold)


def block_stats(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    columns: torch.Tensor,
    inside: torch.Tensor | None,
    moments: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One vocabulary block of [C, cols] logits: its row maximum m of a = logits / T, sum exp(a - m),
    sum exp(a - m) (a - m) (when `moments`), and a[y] where the target lies in the block (0 elsewhere; `inside`
    None: every target does).
    Pure tensor math: on a GPU torch.compile fuses it into a pass or two over the block (`compiled`)."""
    scaled = logits / temperature.unsqueeze(-1)
    top = scaled.amax(dim=-1)
    picked = scaled.gather(-1, columns.unsqueeze(-1)).squeeze(-1)
    if inside is not None:
        picked = torch.where(inside, picked, torch.zeros_like(top))
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


def forward_blocks(task: ChunkTask, weight: torch.Tensor, block: int, compiled: bool = False) -> RowSums:
    """No truncation: the sums over vocabulary blocks, accumulated online; one block (the whole vocabulary, what
    `scoring_chunk_tokens: auto` makes) is one pass with nothing to merge."""
    vocab = weight.shape[0]
    stats_of = _compiled("block_stats") if compiled else block_stats
    acc: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    target = torch.zeros(0)
    for start in range(0, vocab, block):
        logits = task.hidden @ weight[start : start + block].t()
        columns, inside = _columns(task.targets, start, logits.shape[1], vocab)
        top, total, moment, picked = stats_of(logits, task.rows.temperature, columns, inside, task.entropy)
        if acc is None:  # the first block: nothing to merge with (a running maximum of -inf would make NaNs)
            acc, target = (top, total, moment), picked
        else:
            acc, target = _merge(acc, (top, total, moment)), target + picked
    assert acc is not None  # a vocabulary has a column
    top, total, moment = acc
    return RowSums(top, target - top, total, moment=moment if task.entropy else None)


def _columns(targets: torch.Tensor, start: int, width: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each target's column in the block [start, start + width) (clamped) and whether it lies there (None: the
    block is the whole vocabulary, every target lies in it)."""
    if start == 0 and width == vocab:
        return targets, None
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
    g: torch.Tensor,
    columns: torch.Tensor,
    inside: torch.Tensor | None,
    at_target: torch.Tensor,
    temperature: torch.Tensor,
) -> torch.Tensor:
    """Adds e_y for the targets inside these columns (None: all), divides by T: d loss / d logits."""
    if inside is not None:
        at_target = torch.where(inside, at_target, torch.zeros_like(at_target))
    g.scatter_add_(-1, columns.unsqueeze(-1), at_target.unsqueeze(-1))
    return g.div_(temperature.unsqueeze(-1))


def block_grad(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    coef: torch.Tensor,
    entropy_coef: torch.Tensor,
    columns: torch.Tensor,
    inside: torch.Tensor | None,
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
    columns, inside = _columns(task.targets, 0, g.shape[1], g.shape[1])
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
    d loss / d hidden [C, H] (float32 summed over blocks; one block: in the weight's dtype, nothing to sum)."""
    grad_of = _compiled("block_grad") if compiled else block_grad
    grad_hidden: torch.Tensor | None = None
    coef = up.coef_t + up.coef_s  # p_s = p_t without truncation
    vocab = weight.shape[0]
    for start in range(0, vocab, block):
        part = weight[start : start + block]
        logits = task.hidden @ part.t()
        columns, inside = _columns(task.targets, start, logits.shape[1], vocab)
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
        block_grad_hidden = g @ part
        grad_hidden = block_grad_hidden if grad_hidden is None else grad_hidden.float().add_(block_grad_hidden)
        if grad_weight is not None:
            grad_weight[start : start + block].add_(g.t() @ task.hidden)  # in float32: bf16 products are exact
    assert grad_hidden is not None  # a vocabulary has a column
    return grad_hidden


_COMPILED: dict[str, Callable[..., Any]] = {}


def _compiled(name: str) -> Callable[..., Any]:
    """torch.compile of block_stats / block_grad (dynamic shapes: chunks and blocks at the ends are shorter),
    made once per process."""
    if name not in _COMPILED:
        plain: Callable[..., Any] = block_stats if name == "block_stats" else block_grad
        _COMPILED[name] = torch.compile(plain, dynamic=True)
    return _COMPILED[name]

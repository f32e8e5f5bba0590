"""Token scores straight from the last hidden states, a chunk of tokens at a time: no [tokens x vocab] table lives
longer than one chunk, forward or backward.

A real vocabulary makes the output head the biggest tensor of a step: at 151,936 tokens one fp32 [tokens x vocab]
table of a 2,253-token micro-batch is 1.4 GB, and scoring through the model's logits kept about six of them alive
(bench/RESULTS.md). Here the output head's forward is replaced (`install`): while a `ScoreRequest` is active it
takes the hidden states at the response tokens' predicting positions and returns, per token, three scores instead
of logits (`ChunkedScores`): the log-prob of the target in its behaviour space, the entropy of the sampling
distribution and the tempered log-prob of the target (the KL term's); outside a request it is the plain head. The
scores come out of the model's forward, so DeepSpeed's ZeRO-3 hooks gather the head's weight around it as they do
around any layer.

`ChunkedScores` is a torch.autograd.Function over (hidden [N, H], weight [V, H]): per chunk of `chunk_tokens` rows
it computes the chunk's logits, the rows' truncation (services.tensors.sampling, one definition with the engines),
log-sum-exps and the scores, and keeps only [N] vectors. Its backward recomputes each chunk's logits and writes
d scores / d logits in closed form (below), then d hidden = G W and d W += G^T h (accumulated in fp32), so the
weight's gradient reaches a tied input embedding like any other use of it. Per chunk, forward or backward, about
three fp32 [chunk x V] tables are alive at once; the recomputation costs one more [chunk x H x V] product.

With a = logits / T (per row), p_t = softmax(a), p_s the truncated renormalised distribution on the support S,
lp_s = log p_s and H = -sum p_s lp_s:
  d lp_t[y] / da = e_y - p_t;   d lp_s[y] / da = e_y - p_s (0 where y lies outside S or the floor clamps it);
  d H / da = -p_s (lp_s + H) on S, 0 outside;   d / dlogits = (d / da) / T.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from services.tensors.sampling import NEG_INF, RowSampling, Truncation, scaled_logits, truncation

# A token outside a row's top-k / nucleus has log-prob -inf; scored log-probs are floored here instead, so a
# ratio of two of them is 1 (not NaN) and its gradient 0 (no gradient passes below the floor).
LOG_PROB_FLOOR = -1.0e4
BEHAVIOUR_ROW, ENTROPY_ROW, TEMPERED_ROW = 0, 1, 2   # the rows of the [3, N] scores


@dataclass(frozen=True)
class ScoreRequest:
    """What one forward scores: the response tokens of a micro-batch (on the model's device)."""

    rows: torch.Tensor          # [N] row of the micro-batch whose hidden state predicts the token
    positions: torch.Tensor     # [N] its position in that row
    targets: torch.Tensor       # [N] the token
    sampling: RowSampling       # the token's sampling distribution (its truncation: the behaviour and the entropy)
    tempered_space: torch.Tensor   # bool [N]: the token's behaviour log-prob is of logits / T, untruncated
    chunk_tokens: int
    sampling_space: bool = True  # host: some token's behaviour log-prob is in the sampling space
    entropy: bool = True         # compute the entropy (else its row is 0)
    entropy_grad: bool = False   # the entropy is in the loss (its backward pass is skipped otherwise)

    @property
    def needs_support(self) -> bool:
        """Whether the truncation is computed: some row truncates, and is scored in the sampling space or by its
        entropy (a request of tempered log-probs alone never sorts)."""
        return self.sampling.truncates and (self.entropy or self.sampling_space)


_ACTIVE: ContextVar[ScoreRequest | None] = ContextVar("tandem_score_request", default=None)


@contextmanager
def scoring(request: ScoreRequest) -> Iterator[None]:
    """While active, an installed head returns the request's [3, N] scores instead of logits."""
    token = _ACTIVE.set(request)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def scores_of(output: Any, request: ScoreRequest) -> torch.Tensor:
    """The [3, N] scores a model's forward returned under `scoring(request)` (its `logits`)."""
    scores = output.logits if hasattr(output, "logits") else output
    if not isinstance(scores, torch.Tensor) or scores.shape != (3, request.targets.shape[0]):
        raise RuntimeError("the model's output head returned logits under a score request: it was not installed "
                           "(services.trainer.head_scoring.install)")
    return scores


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, torch.nn.Module):
        raise ValueError(f"{type(model).__name__} has no output head (get_output_embeddings) to score through")
    return head


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Makes `model`'s output head (an nn.Linear without bias, or peft's LoRA layer around one) answer score
    requests; returns the head. Idempotent. Before deepspeed.initialize: a LoRA head is made a ZeRO-3 leaf, so its
    base weight and adapter factors are gathered together around its forward."""
    head = output_head(model)
    if getattr(head, "_tandem_plain_forward", None) is not None:
        return head
    if getattr(head, "bias", None) is not None:
        raise ValueError("the output head has a bias; Tandem's chunked scoring supports heads without one")
    if _is_lora(head):
        from deepspeed.utils import set_z3_leaf_module

        set_z3_leaf_module(head, True)
    # plain attributes, not nn.Module ones: the instance's forward is looked up before the class's
    object.__setattr__(head, "_tandem_plain_forward", head.forward)
    object.__setattr__(head, "forward", types.MethodType(_head_forward, head))
    return head


def _is_lora(head: torch.nn.Module) -> bool:
    return all(hasattr(head, a) for a in ("base_layer", "lora_A", "lora_B", "scaling", "lora_dropout"))


def _head_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    request = _ACTIVE.get()
    if request is None:
        return self._tandem_plain_forward(hidden_states)
    hidden = hidden_states[request.rows, request.positions]
    hidden, weight = _operands(self, hidden)
    return ChunkedScores.apply(hidden, weight, request)


def _operands(head: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, W) with logits = h W^T. A LoRA head with active, unmerged adapters adds its low-rank path as extra
    columns: [h, s dropout(h) A^T] [W, B]^T = h W^T + s dropout(h) A^T B^T, exact under dropout too."""
    if not _is_lora(head):
        return hidden, head.weight
    base = head.get_base_layer().weight
    if head.disable_adapters or head.merged:
        return hidden, base
    extra_h, extra_w = [hidden], [base]
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        a, b = head.lora_A[name].weight, head.lora_B[name].weight
        dropped = head.lora_dropout[name](hidden.to(a.dtype))
        extra_h.append((dropped @ a.t() * head.scaling[name]).to(hidden.dtype))
        extra_w.append(b.to(base.dtype))
    return torch.cat(extra_h, dim=-1), torch.cat(extra_w, dim=-1)


@dataclass(frozen=True)
class _Chunk:
    """One chunk's recomputed pieces: the scaled logits and, where the rows truncate, their support."""

    scaled: torch.Tensor          # float32 [C, V]
    keep: torch.Tensor | None     # bool [C, V]; None: no row of the batch truncates


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, rows: RowSampling, truncates: bool,
           cut: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[_Chunk, tuple[torch.Tensor, torch.Tensor]]:
    """The chunk's scaled logits and support; `cut` (threshold, ties) from the forward rebuilds the support without
    sorting again."""
    scaled = scaled_logits(hidden @ weight.t(), rows)
    if not truncates:
        return _Chunk(scaled, None), (torch.empty(0), torch.empty(0))
    if cut is None:
        found = truncation(scaled, rows)
        cut = (found.threshold, found.ties)
    keep = Truncation(threshold=cut[0], ties=cut[1], cuts_ties=rows.uses_top_p).keep(scaled)
    return _Chunk(scaled, keep), cut


class ChunkedScores(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], request) -> float32 [3, N]: behaviour log-prob, entropy, tempered log-prob."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, request: ScoreRequest) -> torch.Tensor:
        n = hidden.shape[0]
        out = torch.zeros(3, n, dtype=torch.float32, device=hidden.device)
        # per token: log-sum-exp of the tempered and of the truncated distribution, the entropy, the floor's mask
        saved = torch.zeros(4, n, dtype=torch.float32, device=hidden.device)
        truncates = request.needs_support
        cuts: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if truncates else None
        for start in range(0, n, request.chunk_tokens):
            stop = min(n, start + request.chunk_tokens)
            rows = request.sampling.rows(start, stop)
            chunk, cut = _chunk(hidden[start:stop], weight, rows, truncates)
            if cuts is not None:
                cuts.append(cut)
            _forward_chunk(chunk, request, start, stop, out, saved)
        ctx.request, ctx.truncates, ctx.autocast = request, truncates, _autocast_state(hidden.device)
        thresholds = torch.cat([c[0] for c in cuts]) if cuts else torch.empty(0, device=hidden.device)
        ties = torch.cat([c[1] for c in cuts]) if cuts else torch.empty(0, device=hidden.device, dtype=torch.long)
        ctx.save_for_backward(hidden, weight, saved, thresholds, ties)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        hidden, weight, saved, thresholds, ties = ctx.saved_tensors
        request: ScoreRequest = ctx.request
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad is None or not (want_h or want_w):
            return None, None, None
        grad_h = torch.zeros_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        device_type, enabled, dtype = ctx.autocast
        for start in range(0, hidden.shape[0], request.chunk_tokens):
            stop = min(hidden.shape[0], start + request.chunk_tokens)
            rows = request.sampling.rows(start, stop)
            cut = (thresholds[start:stop], ties[start:stop]) if ctx.truncates else None
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):   # the forward's logits, bit for bit
                chunk, _ = _chunk(hidden[start:stop], weight, rows, ctx.truncates, cut)
            g = _logit_grad(chunk, request, grad[:, start:stop], saved[:, start:stop], start, stop)
            g = g.to(weight.dtype)
            if grad_h is not None:
                grad_h[start:stop] = g @ weight
            if grad_w is not None:
                grad_w += (g.t() @ hidden[start:stop]).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None


def _autocast_state(device: torch.device) -> tuple[str, bool, torch.dtype]:
    return device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


def _forward_chunk(chunk: _Chunk, request: ScoreRequest, start: int, stop: int, out: torch.Tensor,
                   saved: torch.Tensor) -> None:
    a = chunk.scaled
    targets = request.targets[start:stop].unsqueeze(-1)
    lse_t = torch.logsumexp(a, dim=-1)
    target = a.gather(-1, targets).squeeze(-1)
    if chunk.keep is None:
        lse_s, in_support = lse_t, torch.ones_like(target, dtype=torch.bool)
    else:
        lse_s = torch.logsumexp(a.masked_fill(~chunk.keep, NEG_INF), dim=-1)
        in_support = chunk.keep.gather(-1, targets).squeeze(-1)
    tempered = target - lse_t
    sampled = torch.where(in_support, target - lse_s, torch.full_like(target, NEG_INF))
    passes = sampled >= LOG_PROB_FLOOR   # the clamp passes a gradient here only
    space = request.tempered_space[start:stop]
    out[BEHAVIOUR_ROW, start:stop] = torch.where(space, tempered, sampled.clamp(min=LOG_PROB_FLOOR))
    out[TEMPERED_ROW, start:stop] = tempered
    saved[0, start:stop], saved[1, start:stop], saved[3, start:stop] = lse_t, lse_s, passes.float()
    if request.entropy:
        lp = a.sub_(lse_s.unsqueeze(-1))   # the scaled logits are not needed any more: log p_s in place
        p = lp.exp()
        if chunk.keep is not None:
            p.masked_fill_(~chunk.keep, 0.0)
        entropy = -torch.linalg.vecdot(p, lp)
        out[ENTROPY_ROW, start:stop] = entropy
        saved[2, start:stop] = entropy


def _logit_grad(chunk: _Chunk, request: ScoreRequest, grad: torch.Tensor, saved: torch.Tensor, start: int,
                stop: int) -> torch.Tensor:
    """d loss / d logits of one chunk [C, V] float32 (module docstring)."""
    a, keep = chunk.scaled, chunk.keep
    g_b, g_h, g_t = grad[BEHAVIOUR_ROW].float(), grad[ENTROPY_ROW].float(), grad[TEMPERED_ROW].float()
    lse_t, lse_s, entropy, passes = saved[0], saved[1], saved[2], saved[3] > 0
    space = request.tempered_space[start:stop]
    zero = torch.zeros_like(g_b)
    at_target = g_t + torch.where(space | passes, g_b, zero)
    coef_t = g_t + torch.where(space, g_b, zero)           # times p_t
    coef_s = torch.where(~space & passes, g_b, zero)       # times p_s
    with_entropy = request.entropy and request.entropy_grad
    if keep is None:   # p_s = p_t: the tables are computed in place over the scaled logits
        if with_entropy:
            lp = a.sub_(lse_t.unsqueeze(-1))
            g = lp.exp()
            lp.add_(entropy.unsqueeze(-1)).mul_(g_h.unsqueeze(-1)).add_((coef_t + coef_s).unsqueeze(-1))
            g.mul_(lp).neg_()
            del lp
        else:
            g = a.sub_(lse_t.unsqueeze(-1)).exp_().mul_(-(coef_t + coef_s).unsqueeze(-1))
    else:
        lp_s = a.sub(lse_s.unsqueeze(-1))
        g = lp_s.exp().masked_fill_(~keep, 0.0)   # p_s
        if with_entropy:
            g.mul_(lp_s.add_(entropy.unsqueeze(-1)).mul_(g_h.unsqueeze(-1)).add_(coef_s.unsqueeze(-1))).neg_()
        else:
            g.mul_(-coef_s.unsqueeze(-1))
        del lp_s
        g.sub_(a.sub_(lse_t.unsqueeze(-1)).exp_().mul_(coef_t.unsqueeze(-1)))   # p_t, in place over a
    g.scatter_add_(-1, request.targets[start:stop].unsqueeze(-1), at_target.unsqueeze(-1))
    return g.div_(request.sampling.temperature[start:stop].unsqueeze(-1))

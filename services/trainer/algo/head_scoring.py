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

`ChunkedScores` is a torch.autograd.Function over (hidden [N, H], weight [V, H]). Its forward goes through
`chunk_tokens` tokens at a time, over vocabulary blocks of `vocab_block` columns with an online log-sum-exp and
entropy (prime-rl's FusedOutputLinear and verl's chunked entropy do the same), or, when some row truncates (top-k,
top-p: its row must be sorted), through whole rows, as many as make the same number of logits; it keeps [N]
vectors only. Its backward recomputes each chunk's logits and writes d scores / d logits in closed form
(head_math.py), then d hidden = G W and d W += G^T h accumulated in fp32, so the weight's gradient reaches a tied
input embedding like any other use of it. The recomputation costs one more [chunk x H x V] product.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

import torch

from services.contracts.untyped import AutogradContext
from services.tensors.sampling_dist import RowSampling
from services.trainer.algo.head_math import (
    BEHAVIOUR_ROW,
    ENTROPY_ROW,
    LOG_PROB_FLOOR,
    TEMPERED_ROW,
    ChunkTask,
    RowSums,
    Upstream,
    forward_blocks,
    forward_rows,
    grad_blocks,
    grad_rows,
    row_scores,
)

__all__ = [
    "BEHAVIOUR_ROW",
    "ENTROPY_ROW",
    "LOG_PROB_FLOOR",
    "TEMPERED_ROW",
    "VOCAB_BLOCK",
    "ChunkSetting",
    "ChunkedScores",
    "ScoreRequest",
    "chunk_layout",
    "install",
    "output_head",
    "scores_of",
    "scoring",
]

VOCAB_BLOCK = 8192  # vocabulary columns per block (prime-rl's): with 1,024-token chunks, 33 MB fp32 tables
ChunkSetting = int | Literal["auto"]  # trainer.scoring_chunk_tokens
# `auto`: one float32 [rows x vocabulary] table of a chunk holds at most AUTO_GPU_LOGITS logits (1 GiB: 1,766 rows at
# 151,936 tokens, ~10 chunks to a 16,384-token micro-batch) and at most 1/AUTO_GPU_MEMORY_SHARE of a smaller GPU's
# memory, or AUTO_CPU_LOGITS on a CPU (256 MiB: 441 rows). The backward keeps a few table-sized temporaries alive at
# once (bf16 logits, float32 probabilities, the gradient), so the table's size is several times its share of the
# peak: at 1/32 of an 80 GB H100 (2.7 GB, 4,372 rows) prime-rl's shape peaked at 13.2 GiB, over its 12.5. A chunk of
# 1,766 rows is still ~1.4 TFLOP of head products at Qwen2.5-0.5B's width (~2 ms against ~0.4 ms of its ~54 launches),
# and launches were not what bounded that step (133k -> 77k launches left its time unchanged). On an H100 at
# Qwen2.5-0.5B's shape the head of 1,024-token chunks over 8,192-column blocks made ~100k launches a step and ran
# more than 5x slower than 8,192-token chunks (bench/RESULTS.md, issue 39).
AUTO_GPU_LOGITS = 2**28
AUTO_GPU_MEMORY_SHARE = 32
AUTO_CPU_LOGITS = 2**26


def chunk_layout(setting: ChunkSetting, vocab: int, device: torch.device) -> tuple[int, int]:
    """(tokens per chunk, vocabulary columns per block) of `trainer.scoring_chunk_tokens`: a number is that many
    tokens over VOCAB_BLOCK columns at a time; `auto` is whole rows (one block: no online merge, a handful of ops a
    chunk) as many as fit the device's budget of logits, so a chunk's launches do not grow with the vocabulary."""
    if setting != "auto":
        return setting, VOCAB_BLOCK
    return max(1, _auto_logits(device) // vocab), vocab


@functools.cache
def _auto_logits(device: torch.device) -> int:
    if device.type != "cuda":
        return AUTO_CPU_LOGITS
    share = int(torch.cuda.get_device_properties(device).total_memory) // AUTO_GPU_MEMORY_SHARE // 4
    return min(AUTO_GPU_LOGITS, share)


@dataclass(frozen=True)
class ScoreRequest:
    """What one forward scores: the response tokens of a micro-batch (on the model's device)."""

    rows: torch.Tensor  # [N] row of the micro-batch whose hidden state predicts the token
    positions: torch.Tensor  # [N] its position in that row
    targets: torch.Tensor  # [N] the token
    sampling: RowSampling  # the token's sampling distribution (its truncation: the behaviour and the entropy)
    tempered_space: torch.Tensor  # bool [N]: the token's behaviour log-prob is of logits / T, untruncated
    chunk_tokens: int
    vocab_block: int = VOCAB_BLOCK
    sampling_space: bool = True  # host: some token's behaviour log-prob is in the sampling space
    entropy: bool = True  # compute the entropy (else its row is 0)
    entropy_grad: bool = False  # the entropy is in the loss (its backward pass is skipped otherwise)
    compiled: bool = False  # untruncated blocks through torch.compile (fused passes; on a GPU)

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


def scores_of(output: object, request: ScoreRequest) -> torch.Tensor:
    """The [3, N] scores a model's forward returned under `scoring(request)` (its `logits`)."""
    scores = getattr(output, "logits", output)  # a ModelOutput, or the tensor itself
    if not isinstance(scores, torch.Tensor) or scores.shape != (3, request.targets.shape[0]):
        raise RuntimeError(
            "the model's output head returned logits under a score request: it was not installed "
            "(services.trainer.algo.head_scoring.install)"
        )
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


def rows_per_chunk(request: ScoreRequest, vocab: int) -> int:
    """Rows per chunk: `chunk_tokens` over vocabulary blocks, or as many whole rows as hold as many logits when the
    support is needed (at 151,936 tokens, 1,024 x 8,192 / 151,936 = 55 rows)."""
    if not request.needs_support:
        return request.chunk_tokens
    return max(1, request.chunk_tokens * min(request.vocab_block, vocab) // vocab)


def _task(request: ScoreRequest, hidden: torch.Tensor, start: int, stop: int) -> ChunkTask:
    return ChunkTask(
        hidden=hidden[start:stop],
        targets=request.targets[start:stop],
        rows=request.sampling.rows(start, stop),
        entropy=request.entropy,
        entropy_grad=request.entropy_grad,
    )


class ChunkedScores(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], request) -> float32 [3, N]: behaviour log-prob, entropy, tempered log-prob."""

    @staticmethod
    def forward(
        ctx: AutogradContext, hidden: torch.Tensor, weight: torch.Tensor, request: ScoreRequest
    ) -> torch.Tensor:
        step, support = rows_per_chunk(request, weight.shape[0]), request.needs_support
        n, fields = hidden.shape[0], RowSums.fields(support=support, moment=request.entropy)
        buffer = torch.empty(n, fields, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, step):
            task = _task(request, hidden, start, start + step)
            part = (
                forward_rows(task, weight)
                if support
                else forward_blocks(task, weight, request.vocab_block, request.compiled)
            )
            part.write(buffer[start : start + step])
        sums = RowSums.read(buffer, support=support, moment=request.entropy)
        out, stats = row_scores(sums, request.tempered_space)  # stats: what the backward reads
        thresholds = torch.empty(0, device=hidden.device) if sums.threshold is None else sums.threshold
        ctx.request, ctx.step, ctx.autocast = request, step, _autocast_state(hidden.device)
        ctx.save_for_backward(hidden, weight, stats, thresholds)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(
        ctx: AutogradContext, grad: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        hidden, weight, stats, thresholds = ctx.saved_tensors
        request: ScoreRequest = ctx.request
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad is None or not (want_h or want_w):
            return None, None, None
        grad_h = torch.empty_like(hidden) if want_h else None  # every row is written below
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        device_type, enabled, dtype = ctx.autocast
        upstream = Upstream.of(grad, stats, request.tempered_space)  # once, sliced per chunk
        for start in range(0, hidden.shape[0], ctx.step):
            part = slice(start, start + ctx.step)
            task, up = _task(request, hidden, start, start + ctx.step), upstream.rows(start, start + ctx.step)
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):  # the forward's logits, bit for bit
                if request.needs_support:
                    g = grad_rows(task, weight, stats[:, part], up, thresholds[part])
                    chunk_grad = g @ weight
                    if grad_w is not None:
                        grad_w.add_(g.t() @ task.hidden)  # in float32: bf16 products are exact
                else:
                    chunk_grad = grad_blocks(
                        task, weight, stats[:, part], up, request.vocab_block, grad_w, request.compiled
                    )
            if grad_h is not None:
                grad_h[part] = chunk_grad  # copy_ rounds to the hidden states' dtype as .to() does
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None


def _autocast_state(device: torch.device) -> tuple[str, bool, torch.dtype]:
    return device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)

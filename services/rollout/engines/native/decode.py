"""The native engine's sampling loops over one left-padded chunk of prompts.

- `decode_dynamic`: the model's own forward with a Hugging Face DynamicCache; finished rows are dropped from the
  batch (and its KV cache) once a quarter of them are done, so short answers do not pay for long ones.
- `decode_static`: fixed-shape decode through static_decode.py's runners (a preallocated KV cache, CUDA graphs
  or torch.compile); every row steps until the whole batch is done and the host looks every `_SYNC_EVERY` tokens.
Both call `hooks.boundary()` between tokens (the engine's DecodeGate: it may park the call there while a weight update
lands, rollout.inflight_update) and read `hooks.version()` before each forward pass, so every token is stamped with the
weight version whose logits it was sampled from. After a park by in_place (Step.KEPT) the loop goes on with the KV
cache of the old weights; after retract (Step.REFILL) it first recomputes the KV of the prompt and the tokens so far
under the new weights (one prefill), so the rest of the sample is exactly the new policy's continuation. Both end rows
at stop strings when the request has some (stop_strings.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.contracts.sampling_spec import SamplingSpec
from services.rollout.engines.gate import Step
from services.rollout.engines.interface import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SampleOutput
from services.rollout.engines.native.sampler import sample_next
from services.rollout.engines.native.static_decode import Runner, RunnerCache
from services.rollout.engines.native.stop_strings import StopStrings

if TYPE_CHECKING:
    from transformers import DynamicCache

REASONS = (None, FINISH_STOP, FINISH_LENGTH, FINISH_ABORT)  # codes 0..3 in the loop's reason tensor
STOP, LENGTH, ABORT = 1, 2, 3
_SYNC_EVERY = 8  # static path: tokens between host checks for "every row finished"

# (ids, mask, positions, cache) -> logits
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "DynamicCache"], torch.Tensor]


@dataclass(frozen=True)
class Hooks:
    """What a decode loop asks its engine between two steps."""

    boundary: Callable[[], Step]  # the engine's gate: it may park the call inside (a weight update may land)
    version: Callable[[], int]  # the weight version the next forward pass computes with


@dataclass
class Chunk:
    """One left-padded batch of prompts, on the engine's device."""

    input_ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    budget: torch.Tensor  # new tokens each row may produce (max_new_tokens, capped by the context)
    steps: int
    stop_ids: torch.Tensor
    n: int
    width: int


@dataclass
class Decoded:
    """What a loop produced per row: tokens and log-probs (the first `lengths[i]` count), why it ended, and the
    weight version of each step (every row's token i was sampled at step i)."""

    tokens: torch.Tensor
    log_probs: torch.Tensor
    lengths: torch.Tensor
    reason: torch.Tensor
    step_versions: list[int]

    @classmethod
    def empty(cls, n: int, steps: int, device: torch.device) -> Decoded:
        return cls(
            tokens=torch.zeros((n, steps), dtype=torch.long, device=device),
            log_probs=torch.zeros((n, steps), dtype=torch.float32, device=device),
            lengths=torch.zeros(n, dtype=torch.long, device=device),
            reason=torch.zeros(n, dtype=torch.long, device=device),  # index into REASONS; 0 = running
            step_versions=[],
        )

    def samples(self, version: int) -> list[SampleOutput]:
        """`version`: the one the call started with (a sample's version when it has no token)."""
        tokens_l, lps_l = self.tokens.cpu().tolist(), self.log_probs.cpu().tolist()
        lengths_l, reason_l = self.lengths.cpu().tolist(), self.reason.cpu().tolist()
        steps = self.step_versions
        return [
            SampleOutput(
                token_ids=tuple(t[:k]),
                log_probs=tuple(lp[:k]),
                finish_reason=REASONS[r] or FINISH_LENGTH,
                weight_version=steps[0] if k else version,
                token_versions=tuple(steps[:k]),
            )
            for t, lp, k, r in zip(tokens_l, lps_l, lengths_l, reason_l, strict=True)
        ]


def prepare_chunk(
    prompts: Sequence[Sequence[int]],
    sampling: SamplingSpec,
    *,
    device: torch.device,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    max_context: int,
    budgets: Sequence[int] | None = None,
) -> Chunk:
    """`budgets`: each prompt's new tokens at most (default sampling.max_new_tokens); the context caps them too."""
    n = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, built on the host and copied once
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    caps = torch.tensor(list(budgets) if budgets is not None else [sampling.max_new_tokens] * n, device=device)
    budget = torch.minimum(max_context - lengths, caps)
    stop_ids = torch.tensor(
        sorted(set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_token_ids))),
        dtype=torch.long,
        device=device,
    )
    return Chunk(
        input_ids=input_ids,
        mask=mask,
        positions=(mask.cumsum(-1) - 1).clamp(min=0),
        budget=budget,
        steps=int(budget.max()),
        stop_ids=stop_ids,
        n=n,
        width=width,
    )


def decode_dynamic(
    c: Chunk,
    sampling: SamplingSpec,
    generator: torch.Generator | None,
    *,
    new_cache: Callable[[], DynamicCache],
    forward: Forward,
    hooks: Hooks,
    stops: StopStrings | None = None,
) -> Decoded:
    dev, n, steps, budget, stop_ids, mask = c.input_ids.device, c.n, c.steps, c.budget, c.stop_ids, c.mask
    out = Decoded.empty(n, steps, dev)
    rows = torch.arange(n, device=dev)  # original index of each row still in the batch
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    version = hooks.version()
    cache = new_cache()
    logits = forward(c.input_ids, mask, c.positions, cache)
    next_pos = c.positions[:, -1] + 1
    for step in range(steps):
        out.step_versions.append(version)
        tokens, lps = sample_next(logits, sampling, generator)
        # No boolean-mask indexing here: it would cost a device sync per op on a GPU.
        out.tokens[rows, step], out.log_probs[rows, step] = tokens, lps
        lengths_now = out.lengths[rows] + (~done).long()
        out.lengths[rows] = lengths_now
        hit_stop = ~done & torch.isin(tokens, stop_ids)
        hit_len = ~done & ~hit_stop & (lengths_now >= budget[rows])
        out.reason[rows] = torch.where(hit_stop, STOP, torch.where(hit_len, LENGTH, out.reason[rows]))
        done = done | hit_stop | hit_len
        if stops is not None:
            ended = _end_at_stop_strings(stops, out, step, step + 1)
            if ended is not None:
                done = done | ended[rows]
        n_done = int(done.sum())  # the loop's one host sync per token
        if n_done == done.numel():
            break
        after = hooks.boundary()
        if after is Step.ABORT:
            out.reason[rows[~done]] = ABORT
            break
        version = hooks.version()
        if n_done * 4 >= done.numel():  # compact when a quarter of the rows are finished
            keep = (~done).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            rows, done, mask, next_pos, tokens = rows[keep], done[keep], mask[keep], next_pos[keep], tokens[keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        if after is Step.REFILL:  # the rows' prompts and tokens so far, under the current weights
            cache = new_cache()
            ids = torch.cat([c.input_ids[rows], out.tokens[rows, : step + 1]], dim=-1)
            logits = forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache)
        else:
            logits = forward(tokens.unsqueeze(-1), mask, next_pos.unsqueeze(-1), cache)
        next_pos = next_pos + 1
    return out


def decode_static(
    c: Chunk,
    sampling: SamplingSpec,
    generator: torch.Generator | None,
    *,
    runners: RunnerCache,
    hooks: Hooks,
    stops: StopStrings | None = None,
) -> Decoded:
    """Finished rows keep computing but their tokens are not counted; no host sync except every _SYNC_EVERY (stop
    strings are scanned there too, over the tokens since the last scan: a row is cut back to its match)."""
    n, steps = c.n, c.steps
    runner = runners.get(n, c.width + steps)
    version = hooks.version()
    logits = _prefill(runner, c.input_ids, c.mask)  # [runner.batch, vocab]: padded rows sampled too
    next_pos = c.positions[:, -1] + 1
    out = Decoded.empty(n, steps, c.input_ids.device)
    done = torch.zeros(n, dtype=torch.bool, device=c.input_ids.device)
    scanned = 0  # stop strings: positions before this are scanned
    for step in range(steps):
        out.step_versions.append(version)
        tokens, lps = runners.sample(logits, sampling, generator)
        tokens, lps = tokens[:n], lps[:n]
        out.tokens[:, step], out.log_probs[:, step] = tokens, lps
        out.lengths += (~done).long()
        hit_stop = ~done & torch.isin(tokens, c.stop_ids)
        hit_len = ~done & ~hit_stop & (out.lengths >= c.budget)
        out.reason = torch.where(hit_stop, STOP, torch.where(hit_len, LENGTH, out.reason))
        done = done | hit_stop | hit_len
        at_sync = step == steps - 1 or step % _SYNC_EVERY == _SYNC_EVERY - 1
        if stops is not None and at_sync:
            done, scanned = _scan_stops(stops, out, done, scanned, step + 1)
        if step == steps - 1 or (at_sync and bool(done.all())):
            break
        after = hooks.boundary()
        if after is Step.ABORT:
            if stops is not None:
                done, scanned = _scan_stops(stops, out, done, scanned, step + 1)
            out.reason = torch.where(done, out.reason, ABORT)
            break
        if after is not Step.GO and not runner.current():  # parameters moved while parked (a first cuda_ipc sync)
            runner, after = runners.get(n, c.width + steps), Step.REFILL
        version = hooks.version()
        if after is Step.REFILL:  # slots 0 .. width + step again, under the current weights
            generated = out.tokens[:, : step + 1]
            logits = _prefill(
                runner,
                torch.cat([c.input_ids, generated], dim=-1),
                torch.cat([c.mask, torch.ones_like(generated)], dim=-1),
            )
        else:
            logits = runner.step(tokens, next_pos, c.width + step)
        next_pos = next_pos + 1
    return out


def _prefill(runner: Runner, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Left-padded rows into the runner's cache from slot 0 (rotary positions count each row's own tokens); rows
    beyond ids' own up to the runner's batch repeat row 0 (their results are dropped)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    if runner.batch > ids.shape[0]:
        pad = runner.batch - ids.shape[0]
        ids, mask, positions = (torch.cat([t, t[:1].expand(pad, -1)]) for t in (ids, mask, positions))
    return runner.prefill(ids, positions, mask)


def _end_at_stop_strings(stops: StopStrings, out: Decoded, start: int, end: int) -> torch.Tensor | None:
    """Rows whose text completes a stop string at a position in [start, end) end there (length, reason stop; the
    tokens after it are dropped). Returns the rows it ended (bool [n]), or None."""
    first = stops.scan(out.tokens, out.lengths, start, end)
    if not first:
        return None
    dev = out.lengths.device
    rows = torch.tensor(list(first), dtype=torch.long, device=dev)
    out.lengths[rows] = torch.tensor([p + 1 for p in first.values()], dtype=out.lengths.dtype, device=dev)
    out.reason[rows] = STOP
    ended = torch.zeros_like(out.lengths, dtype=torch.bool)
    ended[rows] = True
    return ended


def _scan_stops(stops: StopStrings, out: Decoded, done: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, int]:
    ended = _end_at_stop_strings(stops, out, start, end)
    return (done if ended is None else done | ended), end

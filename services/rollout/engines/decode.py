"""The native engine's sampling loops over one left-padded chunk of prompts.

- `decode_dynamic`: the model's own forward with a Hugging Face DynamicCache; finished rows are dropped from the
  batch (and its KV cache) once a quarter of them are done, so short answers do not pay for long ones.
- `decode_static`: fixed-shape decode through static_decode.py's runners (a preallocated KV cache, CUDA graphs
  or torch.compile); every row steps until the whole batch is done and the host looks every `_SYNC_EVERY` tokens.
Both call `boundary()` between tokens (the engine's DecodeGate: True = abort now, or it parks the call there), and
end rows at stop strings when the request has some (stop_strings.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.contracts.sampling import SamplingSpec
from services.rollout.engines.base import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SampleOutput
from services.rollout.engines.sampling import sample_next
from services.rollout.engines.static_decode import RunnerCache
from services.rollout.engines.stop_strings import StopStrings

_REASONS = (None, FINISH_STOP, FINISH_LENGTH, FINISH_ABORT)   # codes 0..3 in the loop's reason tensor
_STOP, _LENGTH, _ABORT = 1, 2, 3
_SYNC_EVERY = 8        # static path: tokens between host checks for "every row finished"

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]  # ids, mask, positions, cache


@dataclass
class Chunk:
    """One left-padded batch of prompts, on the engine's device."""

    input_ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    budget: torch.Tensor        # new tokens each row may produce (max_new_tokens, capped by the context)
    steps: int
    stop_ids: torch.Tensor
    n: int
    width: int


@dataclass
class Decoded:
    """What a loop produced per row: tokens and log-probs (the first `lengths[i]` count), why it ended."""

    tokens: torch.Tensor
    log_probs: torch.Tensor
    lengths: torch.Tensor
    reason: torch.Tensor

    @classmethod
    def empty(cls, n: int, steps: int, device: torch.device) -> Decoded:
        return cls(tokens=torch.zeros((n, steps), dtype=torch.long, device=device),
                   log_probs=torch.zeros((n, steps), dtype=torch.float32, device=device),
                   lengths=torch.zeros(n, dtype=torch.long, device=device),
                   reason=torch.zeros(n, dtype=torch.long, device=device))   # index into _REASONS; 0 = running

    def samples(self, version: int) -> list[SampleOutput]:
        tokens_l, lps_l = self.tokens.cpu().tolist(), self.log_probs.cpu().tolist()
        lengths_l, reason_l = self.lengths.cpu().tolist(), self.reason.cpu().tolist()
        return [SampleOutput(token_ids=tuple(t[:k]), log_probs=tuple(lp[:k]),
                             finish_reason=_REASONS[r] or FINISH_LENGTH, weight_version=version)
                for t, lp, k, r in zip(tokens_l, lps_l, lengths_l, reason_l, strict=True)]


def prepare_chunk(prompts: Sequence[Sequence[int]], sampling: SamplingSpec, *, device: torch.device,
                  pad_token_id: int, eos_token_ids: Sequence[int], max_context: int) -> Chunk:
    n = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):      # left padding, built on the host and copied once
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    budget = torch.clamp(max_context - lengths, max=sampling.max_new_tokens)
    stop_ids = torch.tensor(sorted(set(sampling.stop_token_ids)
                                   | (set() if sampling.ignore_eos else set(eos_token_ids))),
                            dtype=torch.long, device=device)
    return Chunk(input_ids=input_ids, mask=mask, positions=(mask.cumsum(-1) - 1).clamp(min=0), budget=budget,
                 steps=int(budget.max()), stop_ids=stop_ids, n=n, width=width)


def decode_dynamic(c: Chunk, sampling: SamplingSpec, generator: torch.Generator | None, *, cache: Any,
                   forward: Forward, boundary: Callable[[], bool], stops: StopStrings | None = None) -> Decoded:
    dev, n, steps, budget, stop_ids, mask = c.input_ids.device, c.n, c.steps, c.budget, c.stop_ids, c.mask
    out = Decoded.empty(n, steps, dev)
    rows = torch.arange(n, device=dev)      # original index of each row still in the batch
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    logits = forward(c.input_ids, mask, c.positions, cache)
    next_pos = c.positions[:, -1] + 1
    for step in range(steps):
        tokens, lps = sample_next(logits, sampling, generator)
        # No boolean-mask indexing here: it would cost a device sync per op on a GPU.
        out.tokens[rows, step], out.log_probs[rows, step] = tokens, lps
        lengths_now = out.lengths[rows] + (~done).long()
        out.lengths[rows] = lengths_now
        hit_stop = ~done & torch.isin(tokens, stop_ids)
        hit_len = ~done & ~hit_stop & (lengths_now >= budget[rows])
        out.reason[rows] = torch.where(hit_stop, _STOP, torch.where(hit_len, _LENGTH, out.reason[rows]))
        done = done | hit_stop | hit_len
        if stops is not None:
            ended = _end_at_stop_strings(stops, out, step, step + 1)
            if ended is not None:
                done = done | ended[rows]
        n_done = int(done.sum())                  # the loop's one host sync per token
        if n_done == done.numel():
            break
        if boundary():
            out.reason[rows[~done]] = _ABORT
            break
        if n_done * 4 >= done.numel():            # compact when a quarter of the rows are finished
            keep = (~done).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            rows, done, mask, next_pos, tokens = rows[keep], done[keep], mask[keep], next_pos[keep], tokens[keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        logits = forward(tokens.unsqueeze(-1), mask, next_pos.unsqueeze(-1), cache)
        next_pos = next_pos + 1
    return out


def decode_static(c: Chunk, sampling: SamplingSpec, generator: torch.Generator | None, *, runners: RunnerCache,
                  boundary: Callable[[], bool], stops: StopStrings | None = None) -> Decoded:
    """Finished rows keep computing but their tokens are not counted; no host sync except every _SYNC_EVERY (stop
    strings are scanned there too, over the tokens since the last scan: a row is cut back to its match)."""
    n, steps = c.n, c.steps
    runner = runners.get(n, c.width + steps)
    ids, mask, positions = c.input_ids, c.mask, c.positions
    if runner.batch > n:                          # batch padding: repeat row 0, results dropped
        pad = runner.batch - n
        ids, mask, positions = (torch.cat([t, t[:1].expand(pad, -1)]) for t in (ids, mask, positions))
    logits = runner.prefill(ids, positions, mask)          # [runner.batch, vocab]: padded rows sampled too
    next_pos = c.positions[:, -1] + 1
    out = Decoded.empty(n, steps, c.input_ids.device)
    done = torch.zeros(n, dtype=torch.bool, device=c.input_ids.device)
    scanned = 0                                   # stop strings: positions before this are scanned
    for step in range(steps):
        tokens, lps = runners.sample(logits, sampling, generator)
        tokens, lps = tokens[:n], lps[:n]
        out.tokens[:, step], out.log_probs[:, step] = tokens, lps
        out.lengths += (~done).long()
        hit_stop = ~done & torch.isin(tokens, c.stop_ids)
        hit_len = ~done & ~hit_stop & (out.lengths >= c.budget)
        out.reason = torch.where(hit_stop, _STOP, torch.where(hit_len, _LENGTH, out.reason))
        done = done | hit_stop | hit_len
        at_sync = step == steps - 1 or step % _SYNC_EVERY == _SYNC_EVERY - 1
        if stops is not None and at_sync:
            done, scanned = _scan_stops(stops, out, done, scanned, step + 1)
        if step == steps - 1 or (at_sync and bool(done.all())):
            break
        if boundary():
            if stops is not None:
                done, scanned = _scan_stops(stops, out, done, scanned, step + 1)
            out.reason = torch.where(done, out.reason, _ABORT)
            break
        logits = runner.step(tokens, next_pos, c.width + step)
        next_pos = next_pos + 1
    return out


def _end_at_stop_strings(stops: StopStrings, out: Decoded, start: int, end: int) -> torch.Tensor | None:
    """Rows whose text completes a stop string at a position in [start, end) end there (length, reason stop; the
    tokens after it are dropped). Returns the rows it ended (bool [n]), or None."""
    first = stops.scan(out.tokens, out.lengths, start, end)
    if not first:
        return None
    dev = out.lengths.device
    rows = torch.tensor(list(first), dtype=torch.long, device=dev)
    out.lengths[rows] = torch.tensor([p + 1 for p in first.values()], dtype=out.lengths.dtype, device=dev)
    out.reason[rows] = _STOP
    ended = torch.zeros_like(out.lengths, dtype=torch.bool)
    ended[rows] = True
    return ended


def _scan_stops(stops: StopStrings, out: Decoded, done: torch.Tensor, start: int,
                end: int) -> tuple[torch.Tensor, int]:
    ended = _end_at_stop_strings(stops, out, start, end)
    return (done if ended is None else done | ended), end

"""Continuous batching (rollout.continuous_batching): the samples of concurrent generate calls decode as one batch on
the native engine, and the row a finished sample leaves goes to a waiting sample between two decode steps, so short
samples do not wait for long ones and a call returns as soon as its own samples are done. The rows' keys and values
live in a row_kv store: the dynamic path's DynamicCache, or one static cache stepped by a CUDA graph replay (the
engine's static, graph and compile decode modes).

The batch lives here, between calls. One call at a time steps it (`serve`, inside the engine's compute lock) until its
own samples are done, then lets go; the other calls wait for their samples (and return as soon as they are done) or for
their turn to step, so no thread of its own is needed. Waiting samples join when at least `max_rows // 8` rows are free
(or the batch is empty): they are prefilled as one chunk and their KV rows appended. Finished rows leave when a quarter
of the batch is done or rows are wanted. A call's samples join only a batch of their own distribution (temperature,
top-p, top-k, stop tokens and strings, EOS handling), in the order the calls came; the batch's random stream is seeded
by the call that started it, so a seeded call is reproducible when it runs alone. Between two steps the engine's hooks
may park the batch for a weight update (rollout.inflight_update) exactly as decode.py's loops do, and every token
carries its step's version. A row whose new token completes a stop string ends at that token (stop_strings.py), like one
that draws a stop token.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from services.contracts.sampling_spec import SamplingSpec
from services.rollout.engines.gate import Step
from services.rollout.engines.interface import FINISH_ABORT, FINISH_LENGTH, SampleOutput
from services.rollout.engines.native.decode import ABORT, LENGTH, REASONS, STOP, Hooks, prepare_chunk
from services.rollout.engines.native.row_kv import RowKV, RowStore
from services.rollout.engines.native.sampler import make_generator, sample_next
from services.rollout.engines.native.stop_strings import StopStrings, StopStringTables


def distribution(s: SamplingSpec) -> tuple[float, float, int, tuple[int, ...], bool, tuple[str, ...]]:
    """What samples decoded in one batch must share."""
    return s.temperature, s.top_p, s.top_k, tuple(sorted(s.stop_token_ids)), s.ignore_eos, s.stop


@dataclass(eq=False)
class Ticket:
    """One generate call's samples: queued until they join the batch, their outputs filled as they finish."""

    prompts: list[list[int]]
    sampling: SamplingSpec
    budgets: list[int]  # each sample's new tokens at most
    start_version: int
    outputs: list[SampleOutput | None] = field(default_factory=list)
    queued: deque[int] = field(default_factory=deque)
    left: int = 0
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.outputs = [None] * len(self.prompts)
        self.queued = deque(range(len(self.prompts)))
        self.left = len(self.prompts)

    def done(self) -> bool:
        return self.left == 0 or self.error is not None

    def finish(self, index: int, output: SampleOutput) -> None:
        self.outputs[index] = output
        self.left -= 1

    def results(self) -> list[SampleOutput]:
        if self.error is not None:
            raise self.error
        assert all(o is not None for o in self.outputs)
        return [o for o in self.outputs if o is not None]


@dataclass
class _Rows:
    """The running batch, rows in cache order (device tensors, except the owners and prompts)."""

    kv: RowKV
    logits: torch.Tensor  # [R, vocab] of the next token to sample
    next_pos: torch.Tensor  # [R] rotary position of the token fed next
    budget: torch.Tensor  # [R] tokens each row may produce
    length: torch.Tensor  # [R] tokens produced
    done: torch.Tensor  # [R] bool
    reason: torch.Tensor  # [R] index into decode.REASONS
    tokens: torch.Tensor  # [R, cap]
    log_probs: torch.Tensor  # [R, cap]
    owners: list[tuple[Ticket, int]]
    prompts: list[list[int]]
    first_step: list[int]  # the batch step of each row's first token

    _PER_ROW = ("logits", "next_pos", "budget", "length", "done", "reason", "tokens", "log_probs")

    def select(self, keep: torch.Tensor) -> None:
        kept = keep.tolist()
        self.kv.select(keep, kept)
        for name in self._PER_ROW:
            setattr(self, name, getattr(self, name)[keep])
        self.owners = [self.owners[i] for i in kept]
        self.prompts = [self.prompts[i] for i in kept]
        self.first_step = [self.first_step[i] for i in kept]

    def append(self, other: _Rows) -> None:
        cap = max(self.tokens.shape[1], other.tokens.shape[1])
        self.kv.append(other.kv)
        for name in self._PER_ROW:
            mine, theirs = getattr(self, name), getattr(other, name)
            if name in ("tokens", "log_probs"):
                mine, theirs = (F.pad(t, (0, cap - t.shape[1])) for t in (mine, theirs))
            setattr(self, name, torch.cat([mine, theirs]))
        self.owners += other.owners
        self.prompts += other.prompts
        self.first_step += other.first_step


class ContinuousBatcher:
    def __init__(
        self,
        *,
        store: RowStore,
        hooks: Hooks,
        device: torch.device,
        max_rows: int,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        max_context: int,
        stop_tables: StopStringTables | None = None,
    ):
        self.store, self.hooks, self.device = store, hooks, device
        self.max_rows, self.pad_token_id, self.eos_token_ids = max_rows, pad_token_id, tuple(eos_token_ids)
        self.max_context = max_context
        self.join_at = max(1, max_rows // 8)  # free rows that make waiting samples join a running batch
        self._queue: deque[Ticket] = deque()
        self._queue_lock = threading.Lock()  # submit runs on any thread; everything else under compute
        self._turns = threading.Condition()  # a call's samples finished, or the stepping call let go
        self._stepping = False
        self._rows: _Rows | None = None
        self._spec: SamplingSpec | None = None  # the batch's distribution
        self._generator: torch.Generator | None = None
        self._step_versions: list[int] = []  # the weight version of each batch step's logits
        self._version = 0  # the version of the pending logits
        self._stop_ids = torch.zeros(0, dtype=torch.long, device=device)
        self.stop_tables = stop_tables
        self._stops: StopStrings | None = None  # the batch's stop strings
        self.peak_rows = 0  # most rows decoded together so far

    def submit(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec, *, budgets: Sequence[int], version: int
    ) -> Ticket:
        ticket = Ticket(
            prompts=[list(p) for p in prompts], sampling=sampling, budgets=list(budgets), start_version=version
        )
        with self._queue_lock:
            self._queue.append(ticket)
        return ticket

    def serve(self, ticket: Ticket, computing: Callable[[], AbstractContextManager[None]]) -> list[SampleOutput]:
        """The ticket's outputs. While no other call steps the batch this one does (inside `computing`, the engine's
        compute lock), until its own samples are done; meanwhile it waits for its samples or for its turn."""
        while True:
            with self._turns:
                self._turns.wait_for(lambda: ticket.done() or not self._stepping)
                if ticket.done():
                    return ticket.results()
                self._stepping = True
            try:
                with computing():
                    self.run(until=ticket.done)
            except BaseException as exc:  # e.g. the engine cannot serve (memory released): not for anyone else
                self._withdraw(ticket, exc)
                raise
            finally:
                with self._turns:
                    self._stepping = False
                    self._turns.notify_all()

    def _withdraw(self, ticket: Ticket, exc: BaseException) -> None:
        """The ticket's waiting samples leave the queue (its samples in the batch go on: their rows finish)."""
        with self._queue_lock:
            self._queue = deque(t for t in self._queue if t is not ticket)
        ticket.error = ticket.error or exc

    def run(self, until: Callable[[], bool]) -> None:
        """Steps the batch until `until()`; call it holding the engine's compute lock."""
        try:
            while not until():
                self._step()
        except BaseException as exc:
            self._fail_all(exc)
            raise

    # ---- one step -------------------------------------------------------------------------------------

    def _step(self) -> None:
        self._join_waiting()
        rows = self._rows
        if rows is None:
            return
        assert self._spec is not None
        self._step_versions.append(self._version)
        tokens, lps = sample_next(rows.logits, self._spec, self._generator)
        live = ~rows.done
        at = rows.length.clamp(max=rows.tokens.shape[1] - 1).unsqueeze(-1)
        rows.tokens.scatter_(1, at, torch.where(live, tokens, rows.tokens.gather(1, at).squeeze(-1)).unsqueeze(-1))
        rows.log_probs.scatter_(1, at, torch.where(live, lps, rows.log_probs.gather(1, at).squeeze(-1)).unsqueeze(-1))
        rows.length += live.long()
        hit_stop = live & torch.isin(tokens, self._stop_ids)
        if self._stops is not None:  # the row's new token completes a stop string: kept, the row ends
            hit_stop = hit_stop | self._stops.completed(rows.tokens, rows.length, live & ~hit_stop)
        hit_len = live & ~hit_stop & (rows.length >= rows.budget)
        rows.reason = torch.where(hit_stop, STOP, torch.where(hit_len, LENGTH, rows.reason))
        rows.done = rows.done | hit_stop | hit_len
        self._deliver((hit_stop | hit_len).nonzero().flatten().tolist())
        if bool(rows.done.all()):
            self._drop_rows()
            return
        after = self.hooks.boundary()
        if after is Step.ABORT:
            self._abort_all()
            return
        self._version = self.hooks.version()
        refill = after is Step.REFILL or self.store.stale()  # stale: the engine dropped the static cache
        if int(rows.done.sum()) * 4 >= rows.done.numel() or refill:
            rows.select((~rows.done).nonzero().flatten())
        self._forward_next(rows, refill=refill)

    def _forward_next(self, rows: _Rows, *, refill: bool) -> None:
        """The logits of every row's next token: its last token fed on the KV cache, or (refill) every row's prompt and
        tokens so far prefilled into a new cache under the current weights."""
        if refill:
            sequences = [p + rows.tokens[i, : int(rows.length[i])].tolist() for i, p in enumerate(rows.prompts)]
            chunk = prepare_chunk(
                sequences,
                self._spec_or_fail(),
                device=self.device,
                pad_token_id=self.pad_token_id,
                eos_token_ids=self.eos_token_ids,
                max_context=self.max_context,
            )
            rows.kv.release()
            need = max(len(p) + b for p, b in zip(rows.prompts, rows.budget.tolist(), strict=True))
            rows.kv, rows.logits = self.store.admit(chunk, need)
            rows.next_pos = chunk.positions[:, -1] + 1
            return
        last = rows.tokens.gather(1, (rows.length - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
        rows.logits = rows.kv.step(last, rows.next_pos)
        rows.next_pos = rows.next_pos + 1

    # ---- joining and leaving --------------------------------------------------------------------------

    def _join_waiting(self) -> None:
        """Waiting samples of the batch's distribution (the next call's, when the batch is empty) join it."""
        live = 0 if self._rows is None else int((~self._rows.done).sum())
        if live and self.store.stale():  # its rows are prefilled again after this step first
            return
        free = self.max_rows - live
        if free <= 0 or (live and free < self.join_at):
            return
        picked = self._take_waiting(free)
        if not picked:
            return
        if self._rows is not None:
            self._rows.select((~self._rows.done).nonzero().flatten())
        try:
            new = self._prefill(picked)
        except BaseException as exc:  # no longer queued: the calls of the picked samples hear of it here
            for ticket, _ in picked:
                ticket.error = ticket.error or exc
            raise
        if self._rows is None:
            self._rows = new
        else:
            self._rows.append(new)
        self.peak_rows = max(self.peak_rows, len(self._rows.owners))

    def _take_waiting(self, free: int) -> list[tuple[Ticket, int]]:
        picked: list[tuple[Ticket, int]] = []
        with self._queue_lock:
            while self._queue and len(picked) < free:
                ticket = self._queue[0]
                if self._rows is None and not picked:  # a new batch takes the first call's distribution
                    self._start_batch(ticket.sampling)
                elif distribution(ticket.sampling) != distribution(self._spec_or_fail()):
                    break  # in call order: it waits for the batch to empty
                while ticket.queued and len(picked) < free:
                    picked.append((ticket, ticket.queued.popleft()))
                if not ticket.queued:
                    self._queue.popleft()
        return picked

    def _start_batch(self, sampling: SamplingSpec) -> None:
        self._spec, self._generator = sampling, make_generator(sampling.seed, self.device)
        self._step_versions = []
        self._version = self.hooks.version()
        self._stop_ids = torch.tensor(
            sorted(set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids))),
            dtype=torch.long,
            device=self.device,
        )
        self._stops = self.stop_tables.for_request(sampling.stop) if sampling.stop and self.stop_tables else None

    def _prefill(self, picked: list[tuple[Ticket, int]]) -> _Rows:
        prompts = [t.prompts[i] for t, i in picked]
        chunk = prepare_chunk(
            prompts,
            self._spec_or_fail(),
            device=self.device,
            pad_token_id=self.pad_token_id,
            eos_token_ids=self.eos_token_ids,
            max_context=self.max_context,
            budgets=[t.budgets[i] for t, i in picked],
        )
        budget = chunk.budget
        kv, logits = self.store.admit(chunk, int((chunk.mask.sum(-1) + budget).max()))
        n, cap = len(picked), int(budget.max())
        return _Rows(
            kv=kv,
            logits=logits,
            next_pos=chunk.positions[:, -1] + 1,
            budget=budget,
            length=torch.zeros(n, dtype=torch.long, device=self.device),
            done=torch.zeros(n, dtype=torch.bool, device=self.device),
            reason=torch.zeros(n, dtype=torch.long, device=self.device),
            tokens=torch.zeros((n, cap), dtype=torch.long, device=self.device),
            log_probs=torch.zeros((n, cap), dtype=torch.float32, device=self.device),
            owners=list(picked),
            prompts=prompts,
            first_step=[len(self._step_versions)] * n,
        )

    def _deliver(self, finished: list[int]) -> None:
        rows = self._rows
        if not finished or rows is None:
            return
        lengths, reasons = rows.length[finished].tolist(), rows.reason[finished].tolist()
        tokens, lps = rows.tokens[finished].tolist(), rows.log_probs[finished].tolist()
        for k, row in enumerate(finished):
            ticket, index = rows.owners[row]
            n, start = lengths[k], rows.first_step[row]
            versions = tuple(self._step_versions[start : start + n])
            ticket.finish(
                index,
                SampleOutput(
                    token_ids=tuple(tokens[k][:n]),
                    log_probs=tuple(lps[k][:n]),
                    finish_reason=REASONS[reasons[k]] or FINISH_LENGTH,
                    weight_version=versions[0] if n else ticket.start_version,
                    token_versions=versions,
                ),
            )
        self._wake()

    def _wake(self) -> None:
        """Calls whose samples just finished return without waiting for their turn."""
        with self._turns:
            self._turns.notify_all()

    def _abort_all(self) -> None:
        """pause(abort): every sample of the batch ends now, and every waiting sample with no token."""
        rows = self._rows
        if rows is not None:
            running = (~rows.done).nonzero().flatten()
            rows.reason[running] = ABORT
            self._deliver(running.tolist())
            self._drop_rows()
        with self._queue_lock:
            waiting, self._queue = list(self._queue), deque()
        for ticket in waiting:
            while ticket.queued:
                ticket.finish(ticket.queued.popleft(), SampleOutput((), (), FINISH_ABORT, ticket.start_version))
        self._wake()

    def _fail_all(self, exc: BaseException) -> None:
        """A step failed: the batch is gone; every call in it or waiting fails with the error."""
        tickets = {id(t): t for t, _ in (self._rows.owners if self._rows is not None else [])}
        with self._queue_lock:
            tickets.update((id(t), t) for t in self._queue)
            self._queue = deque()
        self._drop_rows()
        for ticket in tickets.values():
            ticket.error = exc
        self._wake()

    def _drop_rows(self) -> None:
        """The batch is over: its rows go back to the store."""
        if self._rows is not None:
            self._rows.kv.release()
        self._rows = None

    def _spec_or_fail(self) -> SamplingSpec:
        assert self._spec is not None
        return self._spec

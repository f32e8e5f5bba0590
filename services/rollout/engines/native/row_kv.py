"""Where continuous batching (continuous.py) keeps its rows' keys and values: two stores behind one small interface.

- `DynamicStore`: each join prefills a Hugging Face DynamicCache of its own, joined to the batch's (kv_rows.join) and
  cut down when rows leave; the model's own forward steps it (eager, a host sync a token).
- `StaticStore`: one preallocated cache of `max_rows` rows (static_decode.Runner) for the whole batch, stepped by the
  static path's decode step, a CUDA graph replay on a GPU. A joining sample is prefilled into a free row, its tokens
  from slot 0, and every row writes its next token at its own slot, so rows of different lengths and starts decode in
  one replay; a leaving row is only marked free. A step computes only the cache's first rows, as many as the highest
  row in use needs (a power of two; free rows are taken lowest first), and attends only over the slots its rows have
  reached (the store bounds each row's slot on the host: its prompt's width plus the steps since it joined), a graph
  each such view, so a few short samples pay for neither all `max_rows` nor the longest budget's slots. The cache is
  as long as the longest prompt plus budget seen; a
  longer one copies the rows over. When the engine drops its runners (parameter storage moved, memory released) the
  store is stale: the batch prefills its rows again into a new cache (what in-flight refill does).

Both answer `admit` (a chunk's rows in, their next-token logits out) and hand back a `RowKV` that the batch selects,
appends and steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from services.rollout.engines.native import kv_rows
from services.rollout.engines.native.decode import Chunk, Forward

if TYPE_CHECKING:
    from transformers import DynamicCache

    from services.rollout.engines.native.static_decode import Runner, RunnerCache


MIN_VIEW_ROWS = 8  # the fewest rows a static step computes (fewer graphs to capture)


class RowKV(ABC):
    """The keys and values of the batch's rows, in the batch's row order."""

    @abstractmethod
    def select(self, keep: torch.Tensor, kept: list[int]) -> None:
        """Only rows `keep` stay, in that order (`kept`: the same indices on the host)."""

    @abstractmethod
    def append(self, other: RowKV) -> None:
        """`other`'s rows (from the same store) after these."""

    @abstractmethod
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Every row feeds one token at its rotary position; returns the next-token logits [rows, vocab]."""

    @abstractmethod
    def release(self) -> None:
        """The rows are gone (before the batch prefills them again)."""


class RowStore(Protocol):
    def admit(self, chunk: Chunk, need: int) -> tuple[RowKV, torch.Tensor]:
        """The chunk's left-padded rows prefilled: their KV and next-token logits. `need`: the most slots a row of
        it takes (its tokens plus what it may still generate)."""
        ...

    def stale(self) -> bool:
        """The batch's rows must be prefilled again before the next step (the store lost their cache)."""
        ...


class DynamicRows(RowKV):
    def __init__(self, cache: DynamicCache, mask: torch.Tensor, forward: Forward):
        self.cache, self.mask, self.forward = cache, mask, forward  # mask [R, W]: 1 = a real token in that column

    def select(self, keep: torch.Tensor, kept: list[int]) -> None:
        self.cache.batch_select_indices(keep)
        self.mask = kv_rows.crop_left(self.cache, self.mask[keep])

    def append(self, other: RowKV) -> None:
        assert isinstance(other, DynamicRows)
        self.mask = kv_rows.join(self.cache, self.mask, other.cache, other.mask)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=-1)
        return self.forward(tokens.unsqueeze(-1), self.mask, positions.unsqueeze(-1), self.cache)

    def release(self) -> None:
        pass


class DynamicStore:
    def __init__(self, forward: Forward, new_cache: Callable[[], DynamicCache]):
        self.forward, self.new_cache = forward, new_cache

    def admit(self, chunk: Chunk, need: int) -> tuple[RowKV, torch.Tensor]:
        cache = self.new_cache()
        logits = self.forward(chunk.input_ids, chunk.mask, chunk.positions, cache)
        return DynamicRows(cache, chunk.mask, self.forward), logits

    def stale(self) -> bool:
        return False


class StaticRows(RowKV):
    def __init__(self, store: StaticStore, rows: list[int]):
        self.store, self.rows = store, rows  # the cache row of each batch row
        self._index = store.index(rows)

    def select(self, keep: torch.Tensor, kept: list[int]) -> None:
        left = set(self.rows) - {self.rows[i] for i in kept}
        self.rows = [self.rows[i] for i in kept]
        self._index = self._index[keep]
        self.store.free(left)

    def append(self, other: RowKV) -> None:
        assert isinstance(other, StaticRows) and other.store is self.store
        self.rows = self.rows + other.rows
        self._index = torch.cat([self._index, other._index])

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.store.step(self._index, tokens, positions)

    def release(self) -> None:
        self.store.free(set(self.rows))
        self.rows = []
        self._index = self._index[:0]


class StaticStore:
    """`max_rows` rows of one static cache; `runners`: the engine's RunnerCache (made on first use)."""

    def __init__(self, runners: Callable[[], RunnerCache], *, max_rows: int, device: torch.device):
        self.runners, self.max_rows, self.device = runners, max_rows, device
        self.runner: Runner | None = None
        self._free = list(range(max_rows))
        self._dropped = False  # the cache went while rows held it
        self._top = 0  # 1 + the highest row in use
        self._steps = 0  # steps taken by this store's rows
        self._slot_from: dict[int, int] = {}  # row in use -> its slot's bound less _steps (host side: no sync)

    def index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def admit(self, chunk: Chunk, need: int) -> tuple[RowKV, torch.Tensor]:
        n = chunk.n
        if n > len(self._free):
            raise RuntimeError(f"continuous batching: {n} rows wanted, {len(self._free)} free")
        self._ensure(need)
        runner = self.runner_or_fail()
        rows, self._free = self._free[:n], self._free[n:]
        self._top = max(self._top, rows[-1] + 1)
        self._slot_from.update((row, chunk.width - self._steps) for row in rows)  # next slot <= the prompt's width
        lengths = chunk.mask.sum(-1)
        # left padding to right padding: row i's tokens from column 0
        shift = (torch.arange(chunk.width, device=chunk.mask.device) + (chunk.width - lengths)[:, None]) % chunk.width
        ids = chunk.input_ids.gather(1, shift)
        index = self.index(rows)
        logits = runner.prefill_rows(index, ids, lengths)
        return StaticRows(self, rows), logits

    def _ensure(self, need: int) -> None:
        """A runner at least `need` slots long, the live rows' keys and values carried over to a new one."""
        if self.runner is not None and self.runner.length >= need:
            return
        if self._dropped or (self.runner is not None and not self.runner.current()):
            if len(self._free) < self.max_rows:
                raise RuntimeError("continuous batching: the static cache went while rows held it (prefill them)")
            self.runner, self._dropped = None, False
        old = self.runner
        self.runner = self.runners().get(self.max_rows, max(need, old.length if old is not None else 0))
        if old is not None and old is not self.runner and len(self._free) < self.max_rows:
            self.runner.take_rows_from(old)

    def step(self, index: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows `index` step. The step runs over the cache's first rows, as many as the highest row in use needs (a
        power of two, at least MIN_VIEW_ROWS), and only the slots up to the furthest next slot of a row in use (see
        Runner.view)."""
        runner = self.runner_or_fail()
        rows = MIN_VIEW_ROWS
        while rows < self._top:
            rows *= 2
        below = min(runner.length, max(self._slot_from.values(), default=0) + self._steps + 1)
        logits = runner.step_rows(index, tokens, positions, first_rows=min(rows, runner.batch), below_slot=below)
        self._steps += 1
        return logits

    def free(self, rows: set[int]) -> None:
        if rows and self.runner is not None and not self._dropped:
            self.runner.free_rows(self.index(sorted(rows)))
        for row in rows:
            self._slot_from.pop(row, None)
        self._free = sorted(self._free + list(rows))  # the lowest rows first: live rows stay near the front
        used = set(range(self.max_rows)).difference(self._free)
        self._top = max(used) + 1 if used else 0
        if len(self._free) == self.max_rows and self._dropped:
            self.runner, self._dropped = None, False

    def stale(self) -> bool:
        return self._dropped

    def drop(self) -> None:
        """The engine dropped its runners (storage moved, memory released): rows held must be prefilled again."""
        if self.runner is not None:
            self._dropped = len(self._free) < self.max_rows
            if not self._dropped:
                self.runner = None

    def runner_or_fail(self) -> Runner:
        if self.runner is None or self._dropped:
            raise RuntimeError("continuous batching: no static cache (the engine dropped it; prefill the rows)")
        return self.runner

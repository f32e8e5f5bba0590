"""The rollout service's retry ledger: a Generate repeated with the same key (stream, rollout id, group ids) while the
first is in flight or after it succeeded gets the first one's result, so a client retry never writes a second batch.

Like the trainer's TrainLedger (services/trainer/ledger.py) it is bounded, the oldest forgotten first; unlike it, it
lives only in memory: a restarted replica has written nothing it could be asked again about. A failed call is
forgotten, so its retry computes afresh. New weights clear it (`clear`): a later call with a known key is then a new
request, not a retry.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")

RECENT_CALLS = 32  # the results kept: more than a coordinator retries at once


class RecentCalls(Generic[T]):
    def __init__(self, *, size: int = RECENT_CALLS):
        self.size = size
        self._lock = threading.Lock()
        self._calls: OrderedDict[Hashable, Future[T]] = OrderedDict()

    def run(self, key: Hashable, compute: Callable[[], T]) -> T:
        """`compute()` once per key: a call with the key of one in flight waits for it, one with the key of one
        done gets its result; one after a failure computes again."""
        while True:
            with self._lock:
                earlier = self._calls.get(key)
                if earlier is None or (earlier.done() and earlier.exception() is not None):
                    mine: Future[T] = Future()
                    self._calls[key] = mine
                    while len(self._calls) > self.size:
                        self._calls.popitem(last=False)
                    break
            try:
                return earlier.result()  # a retry of a call in flight or done: the same result
            except Exception:  # noqa: BLE001 - that attempt failed; compute afresh
                continue
        try:
            result = compute()
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        mine.set_result(result)
        return result

    def clear(self) -> None:
        with self._lock:
            self._calls.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._calls)

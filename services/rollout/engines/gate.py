"""Pause and resume of an engine's generate calls: one `PauseGate` for every engine.

`PauseGate` is what the SGLang engine needs (the server pauses its own requests): calls are admitted while it
is open, wait up to their timeout while it is closed, and `drain` waits for the admitted ones to finish.
`DecodeGate` adds what an engine that runs the decode loop itself needs (the native engine): one forward pass
at a time, calls parked at a token boundary by in_place / retract (a weight update lands between two decode steps:
rollout.inflight_update; after retract the call recomputes its KV cache), and exclusive access for weight loads and
memory moves.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from enum import Enum

from services.rollout.engines.engine_errors import EngineUnavailable

PAUSE_MODES = ("drain", "abort", "retract", "in_place")
_PARKING_MODES = ("in_place", "retract")  # running calls stop at the next token and continue on resume


class Step(Enum):
    """What a decode loop does after a token boundary (DecodeGate.boundary)."""

    GO = "go"  # not parked: carry on
    ABORT = "abort"  # pause(abort): the call ends now
    KEPT = "kept"  # parked by in_place and resumed: carry on with the KV cache computed so far
    REFILL = "refill"  # parked by retract and resumed: the KV cache was given up, recompute it (current weights)


def check_pause_mode(mode: str) -> str:
    mode = mode or "drain"
    if mode not in PAUSE_MODES:
        raise ValueError(f"unknown pause mode {mode!r}; known: {', '.join(PAUSE_MODES)}")
    return mode


class BusyClock:
    """Wall seconds during which a count was above zero (an engine's busy time); call `up` / `down` under a lock."""

    def __init__(self) -> None:
        self._count = 0
        self._since = 0.0
        self._total = 0.0

    def up(self) -> None:
        self._count += 1
        if self._count == 1:
            self._since = time.monotonic()

    def down(self) -> None:
        self._count -= 1
        if self._count == 0:
            self._total += time.monotonic() - self._since

    @property
    def seconds(self) -> float:
        return self._total + (time.monotonic() - self._since if self._count else 0.0)


class PauseGate:
    """`admitted` counts calls inside generate; `mode` is the pause mode while `paused`; `busy_s` the wall seconds
    with a call inside (an engine that computes elsewhere, like SGLang, is busy then)."""

    def __init__(self, *, engine: str) -> None:
        self.cv = threading.Condition()
        self.paused = False
        self.mode = ""
        self.admitted = 0
        self._engine = engine  # how messages name the engine
        self._busy = BusyClock()

    @property
    def busy_s(self) -> float:
        with self.cv:
            return self._busy.seconds

    @property
    def pause_mode(self) -> str:
        return self.mode if self.paused else ""

    @contextlib.contextmanager
    def admit(self, wait_timeout_s: float | None) -> Iterator[None]:
        with self.cv:
            if not self.cv.wait_for(lambda: not self.paused, timeout=wait_timeout_s):
                raise EngineUnavailable(
                    f"{self._engine} is paused ({self.mode}, e.g. for a weight update) and "
                    f"was not resumed within {wait_timeout_s:.0f}s"
                )
            self.admitted += 1
            self._busy.up()
        try:
            yield
        finally:
            with self.cv:
                self.admitted -= 1
                self._busy.down()
                self.cv.notify_all()

    def close(self, mode: str) -> None:
        """New calls wait from now on; the admitted ones carry on (see `drain`)."""
        with self.cv:
            self.paused, self.mode = True, mode
            self.cv.notify_all()

    def drain(self, timeout_s: float | None) -> None:
        self._wait(
            lambda: self.admitted == 0,
            timeout_s,
            lambda: f"pause(drain): {self.admitted} generate calls still running after {timeout_s}s",
        )

    def open(self) -> None:
        with self.cv:
            self.paused, self.mode = False, ""
            self.cv.notify_all()

    def _wait(self, done: Callable[[], bool], timeout_s: float | None, message: Callable[[], str]) -> None:
        with self.cv:
            if not self.cv.wait_for(done, timeout=timeout_s):
                raise TimeoutError(message())


class DecodeGate(PauseGate):
    """A PauseGate for an engine that runs its own decode loop. `running` counts the calls computing right now
    (holding the compute lock and not parked), and `busy_s` is the wall time with one computing. Pausing waits for
    the mode's condition; weight loads and memory moves (`exclusive`) wait for running == 0 and keep everyone out
    while they work."""

    def __init__(self, *, engine: str, shared: bool = False) -> None:
        """`shared`: admitted calls do not compute one after the other (`admit` takes no compute lock); they share
        one batch and take turns stepping it inside `computing` (continuous batching)."""
        super().__init__(engine=engine)
        self.compute = threading.Lock()
        self.shared = shared
        self.exclusive_held = False
        self.running = 0
        self.retracts = 0  # pauses with mode retract so far: a call parked across one recomputes its KV cache
        self._computing = BusyClock()

    @property
    def busy_s(self) -> float:
        with self.cv:
            return self._computing.seconds

    def _started(self) -> None:
        self.running += 1
        self._computing.up()

    def _stopped(self) -> None:
        self.running -= 1
        self._computing.down()

    def close(self, mode: str) -> None:
        with self.cv:
            self.retracts += mode == "retract"
        super().close(mode)

    @contextlib.contextmanager
    def admit(self, wait_timeout_s: float | None) -> Iterator[None]:
        with super().admit(wait_timeout_s):
            if self.shared:
                yield
                return
            with self.computing():
                yield

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """The compute lock, counted in `running` (forward passes run inside, parked ones at a boundary)."""
        with self.compute:
            with self.cv:
                self.cv.wait_for(lambda: not self.exclusive_held)
                self._started()
            try:
                yield
            finally:
                with self.cv:
                    self._stopped()
                    self.cv.notify_all()

    def boundary(self) -> Step:
        """Called between decode steps: parks the call while paused by in_place / retract (a weight update may land
        meanwhile) and says how to go on."""
        with self.cv:
            if self.paused and self.mode == "abort":
                return Step.ABORT
            if not (self.paused and self.mode in _PARKING_MODES):
                return Step.GO
            retracted, retracts = self.mode == "retract", self.retracts
            self._stopped()
            self.cv.notify_all()
            self.cv.wait_for(lambda: not (self.paused and self.mode in _PARKING_MODES) and not self.exclusive_held)
            self._started()
            return Step.REFILL if retracted or self.retracts != retracts else Step.KEPT

    def pause(self, mode: str, timeout_s: float | None) -> None:
        """Closes the gate and waits until no call computes (in_place / retract: parked) or none is inside."""
        self.close(mode)
        done = (lambda: self.running == 0) if mode in _PARKING_MODES else (lambda: self.admitted == 0)
        self._wait(
            done,
            timeout_s,
            lambda: f"pause({mode}) did not complete within {timeout_s}s ({self.admitted} generate calls in flight)",
        )

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No forward pass runs while inside. Without a pause this waits for the running call to finish
        (its samples keep one weight version); parked in_place / retract calls stay parked."""
        with self.cv:
            self.cv.wait_for(lambda: not self.exclusive_held)
            self.exclusive_held = True
            self.cv.wait_for(lambda: self.running == 0)
        try:
            yield
        finally:
            with self.cv:
                self.exclusive_held = False
                self.cv.notify_all()

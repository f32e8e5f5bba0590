"""The endpoint's calls to the engine: the calls that arrive while the engine is busy go in as one batch.

Agents call one turn at a time, each in its own HTTP request; one engine call per request would decode batches of
one. Requests wait here while the engine runs; the next engine call takes every waiting request of one sampling
distribution (SGLang and the native engine both batch what one call holds). Each engine call draws from its own
random stream (a seed mixed with a counter): a seeded run is not one stream replayed for every call.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from services.contracts.sampling_spec import SamplingSpec
from services.rollout.engines.interface import Engine, SampleOutput


class Busy(RuntimeError):
    """More calls wait for the engine than rollout.openai_api.max_pending_requests."""


@dataclass
class _Request:
    prompts: list[list[int]]
    sampling: SamplingSpec
    future: asyncio.Future[list[SampleOutput]] = field(repr=False)


class EngineBatcher:
    """Lives on the endpoint's event loop; one engine call at a time, on a worker thread."""

    def __init__(self, engine: Engine, *, wait_timeout_s: float, max_pending: int):
        self.engine = engine
        self.wait_timeout_s = wait_timeout_s
        self.max_pending = max_pending
        self._waiting: list[_Request] = []
        self._runner: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openai-engine")
        self._calls = itertools.count()
        self.engine_calls = 0
        self.batched_requests = 0

    async def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec) -> list[SampleOutput]:
        if sum(len(r.prompts) for r in self._waiting) >= self.max_pending:
            raise Busy(
                f"{self.max_pending} samples already wait for the engine (rollout.openai_api.max_pending_requests)"
            )
        future: asyncio.Future[list[SampleOutput]] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Request([list(p) for p in prompts], sampling, future))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            await asyncio.sleep(0)  # the requests of this tick join
            key = _distribution(self._waiting[0].sampling)
            batch = [r for r in self._waiting if _distribution(r.sampling) == key]
            self._waiting = [r for r in self._waiting if _distribution(r.sampling) != key]
            batch = [r for r in batch if not r.future.cancelled()]
            if not batch:
                continue
            longest = max(r.sampling.max_new_tokens for r in batch)
            spec = replace(batch[0].sampling, max_new_tokens=longest)
            spec = spec.with_seed(_mix(spec.seed, next(self._calls)))
            prompts = [p for r in batch for p in r.prompts]
            caps = [r.sampling.max_new_tokens for r in batch for _ in r.prompts]
            try:
                outputs = await loop.run_in_executor(self._executor, self._call, prompts, spec, caps)
            except Exception as exc:  # noqa: BLE001 - every request of the batch gets the engine's error
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            self.engine_calls += 1
            self.batched_requests += len(batch)
            at = 0
            for r in batch:
                if not r.future.done():
                    r.future.set_result(outputs[at : at + len(r.prompts)])
                at += len(r.prompts)

    def _call(self, prompts: list[list[int]], spec: SamplingSpec, caps: list[int]) -> list[SampleOutput]:
        lower = any(c < spec.max_new_tokens for c in caps)
        return self.engine.generate(
            prompts, spec, wait_timeout_s=self.wait_timeout_s, max_new_tokens=caps if lower else None
        )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _distribution(spec: SamplingSpec) -> SamplingSpec:
    """What one engine call's samples share (each keeps its own max_new_tokens)."""
    return replace(spec, seed=None, max_new_tokens=1)


def _mix(seed: int | None, call: int) -> int | None:
    if seed is None:
        return None
    return (seed * 1_000_003 + call * 0x9E37_79B9 + 1) & 0x7FFF_FFFF_FFFF_FFFF

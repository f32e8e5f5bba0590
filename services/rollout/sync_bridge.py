"""Running a coroutine to its end from synchronous code, wherever that code is called from."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import TypeVar

T = TypeVar("T")


def run_coroutine(coro: Coroutine[object, object, T]) -> T:
    """asyncio.run, or, when called from inside a running event loop (an async caller, a notebook), asyncio.run on a
    fresh loop in another thread: a loop cannot be re-entered."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()

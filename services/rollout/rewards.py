"""Reward functions: built-ins and a plug-in point.

`rollout.reward` is a built-in name (`exact_match`, `numeric_match`, `math_answer`, `math_verify`, `digit_task`;
services/rollout/math_rewards.py has the math ones; `none`, 0 for every sample, for pure distillation) or
`module:function` (`my_pkg.rewards:score`) or `path/to/file.py:function` (a relative path is tried against the working
directory, then the repository root). A function is either

- per sample: `fn(prompt, response, label, metadata) -> float`, or
- batched: `fn(prompts, responses, labels, metadatas) -> list[float]` — marked with `@batched`, or
  recognised by a first parameter named `prompts` or `responses`;

and either may be `async def` (per-sample coroutines run concurrently). Parameters are passed by
keyword when the function names only known ones (so `fn(response, label)` works), positionally otherwise.
A result may be a number, a bool, or a dict with a `score` / `reward` entry; a string, even "1.0", is refused.
A function that raises fails the request with the sample named (`RewardError`, not retried), unless what it
raised is a ConnectionError or TimeoutError (`RewardUnavailable`, retried like any transient failure).

Under a deadline (`score(timeout_s=...)`, rollout.reward_timeout_s in the rollout service) each call gets that long:
each sample's call for a per-sample function (async ones run concurrently, each with its own deadline), the one
call of a batched function. One that does not return fails the request with `RewardTimeout`, naming the function,
the deadline and the sample; that is not retried either (another replica would wait just as long). A sync function
cannot be interrupted: its call is left running on a daemon thread, which dies with the process.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import contextvars
import functools
import importlib
import importlib.util
import inspect
import math
import re
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from services.contracts.errors import Unavailable
from services.contracts.reward_spec import RewardSpecError
from services.contracts.rollout_config import NO_REWARD
from services.rollout import math_rewards
from services.rollout.sync_bridge import run_coroutine

REPO_ROOT = Path(__file__).resolve().parents[2]
_PER_SAMPLE = ("prompt", "response", "label", "metadata")
_BATCHED = ("prompts", "responses", "labels", "metadatas")


@dataclass(frozen=True)
class RewardScores:
    """A reward's answer for a batch: one value per sample, and what it reports about them (a model's sub-scores,
    a judge's parse failures, the reward service's queue time) as metrics of the batch."""

    values: list[float]
    metrics: dict[str, float] = field(default_factory=dict)


class DetailedReward(abc.ABC):
    """A reward that answers `score_detailed` (values and metrics); its `score` is the values alone."""

    @abc.abstractmethod
    def score_detailed(
        self,
        *,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[str],
        metadatas: Sequence[dict[str, str]],
        timeout_s: float | None = None,
        tokens: Sequence[int] | None = None,
    ) -> RewardScores: ...

    def score(
        self,
        *,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[str],
        metadatas: Sequence[dict[str, str]],
        timeout_s: float | None = None,
    ) -> list[float]:
        return self.score_detailed(
            prompts=prompts, responses=responses, labels=labels, metadatas=metadatas, timeout_s=timeout_s
        ).values


class RewardError(ValueError):
    """A reward function raised or returned something that is not a finite number. Deterministic: the request
    fails (INVALID_ARGUMENT) and is not retried on another replica. `hint` says what to do (the failure record
    that ends the run shows it)."""

    def __init__(self, message: str, *, hint: str = ""):
        super().__init__(message)
        self.hint = hint or "fix the reward function"


class RewardTimeout(RewardError):
    """A reward function did not return within its deadline (rollout.reward_timeout_s)."""


class RewardUnavailable(Unavailable):
    """A reward function could not reach what it depends on (ConnectionError, TimeoutError: a remote judge or
    sandbox): transient, so the request fails with UNAVAILABLE and is retried."""


RewardFn = TypeVar("RewardFn", bound=Callable[..., object])


def batched(fn: RewardFn) -> RewardFn:
    """Marks a reward function as taking lists (one call per batch)."""
    fn.batched = True  # type: ignore[attr-defined]
    return fn


# ---- built-ins ----------------------------------------------------------------------------------


def exact_match(prompt: str, response: str, label: str, metadata: dict[str, str]) -> float:
    """1 if the response equals the label after stripping surrounding whitespace."""
    return float(response.strip() == label.strip())


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


extract_boxed = math_rewards.last_boxed  # the content of the last \\boxed{...} (nested braces allowed), or None


def parse_number(text: str) -> float | None:
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip("%").strip()
    try:
        if "/" in cleaned:
            num, den = cleaned.split("/", 1)
            return float(num) / float(den)
        return float(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str) -> str | None:
    """The \\boxed{} content if there is one, else the last number in the text."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def numeric_match(prompt: str, response: str, label: str, metadata: dict[str, str]) -> float:
    """1 if the response's answer (last \\boxed{}, else last number) equals the label's numerically
    (relative tolerance 1e-6); a label like '#### 42' is reduced to its answer the same way."""
    predicted = extract_answer(response)
    if predicted is None:
        return 0.0
    gold_text = label.strip()
    if "####" in gold_text:  # GSM8K: the answer follows the last ####
        gold_text = gold_text.rsplit("####", 1)[1].strip()
    elif "\\boxed{" in gold_text:
        gold_text = extract_boxed(gold_text) or gold_text
    gold = parse_number(gold_text)
    value = parse_number(predicted)
    if gold is None or value is None:
        return float(predicted.replace(" ", "") == gold_text.replace(" ", ""))
    return float(abs(value - gold) <= 1e-6 * max(1.0, abs(gold)))


def digit_task(prompt: str, response: str, label: str, metadata: dict[str, str]) -> float:
    """The example digit task (examples/digit_max): 1 if the response is exactly the label digit."""
    return float(response.split() == [label.strip()])


def no_reward(prompt: str, response: str, label: str, metadata: dict[str, str]) -> float:
    """`rollout.reward: none`: 0 for every sample, for pure distillation (the config refuses it without a teacher)."""
    return 0.0


BUILTIN_REWARDS: dict[str, Callable[..., float]] = {
    NO_REWARD: no_reward,
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "digit_task": digit_task,
    "math_answer": math_rewards.math_answer,
    "math_verify": math_rewards.math_verify,
}
# built-ins that need an optional package: (module, what to install)
_BUILTIN_NEEDS = {"math_verify": ("math_verify", "pip install 'tandem-rl[math]'")}


# ---- resolution ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardFunction:
    spec: str
    fn: Callable[..., Any]
    batched: bool
    keywords: tuple[str, ...] | None  # parameter names to pass by keyword; None = positional

    def score(
        self,
        *,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[str],
        metadatas: Sequence[dict[str, str]],
        timeout_s: float | None = None,
    ) -> list[float]:
        """One reward per sample; with `timeout_s` each call must return within it (RewardTimeout otherwise)."""
        n = len(responses)
        if not (len(prompts) == len(labels) == len(metadatas) == n):
            raise ValueError("reward inputs differ in length")
        if n == 0:
            return []
        if self.batched:

            def job(watch: _Watch) -> list[Any]:
                with watch.running(BATCH):
                    return _run_maybe_async(
                        lambda: self._call(prompts, responses, labels, metadatas, timeout_s=timeout_s, batch_size=n)
                    )

            raw = job(_Watch()) if timeout_s is None else self._within(job, timeout_s, n=n)
            if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or len(raw) != n:
                raise RewardError(
                    f"batched reward {self.spec} returned {type(raw).__name__} "
                    f"{_len_of(raw)} for {n} samples; expected a list of {n} numbers"
                )
            return [_to_float(v, spec=self.spec, index=i) for i, v in enumerate(raw)]

        def each(watch: _Watch) -> list[Any]:
            calls: list[Callable[[], Any]] = [
                functools.partial(self._call, p, r, lb, m, index=i, timeout_s=timeout_s, watch=watch)
                for i, (p, r, lb, m) in enumerate(zip(prompts, responses, labels, metadatas, strict=True))
            ]
            if inspect.iscoroutinefunction(self.fn):
                return _run_coroutines(calls)  # each coroutine is watched while it runs (_awaited)
            out = []
            for i, call in enumerate(calls):
                with watch.running(i):
                    out.append(_run_maybe_async(call))
            return out

        raw = each(_Watch()) if timeout_s is None else self._within(each, timeout_s, n=n)
        return [_to_float(v, spec=self.spec, index=i) for i, v in enumerate(raw)]

    def score_detailed(
        self,
        *,
        prompts: Sequence[str],
        responses: Sequence[str],
        labels: Sequence[str],
        metadatas: Sequence[dict[str, str]],
        timeout_s: float | None = None,
        tokens: Sequence[int] | None = None,
    ) -> RewardScores:
        """`score` as a Reward (reward_mix.py) answers; `tokens` is for remote rewards' batching."""
        return RewardScores(
            self.score(prompts=prompts, responses=responses, labels=labels, metadatas=metadatas, timeout_s=timeout_s)
        )

    def _within(self, job: Callable[[_Watch], list[Any]], timeout_s: float, *, n: int) -> list[Any]:
        """`job` on a daemon thread (a sync call cannot be interrupted; one that hangs is left there), watched: the
        first call running longer than timeout_s fails the scoring with RewardTimeout."""
        watch, done = _Watch(), threading.Event()
        values: list[list[Any]] = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                values.append(job(watch))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
                errors.append(exc)
            finally:
                done.set()

        context = contextvars.copy_context()  # the reward's own spans stay under rl.reward
        threading.Thread(target=context.run, args=(run,), name=f"reward {self.spec}", daemon=True).start()
        while not done.wait(watch.wait_s(timeout_s)):
            late = watch.overdue(timeout_s)
            if late is not None:
                raise self._timeout(late, timeout_s, n=n)
        if errors:
            raise errors[0]
        return values[0]

    def _timeout(self, index: int, timeout_s: float, *, n: int) -> RewardTimeout:
        which = f"sample {index}" if index != BATCH else f"the {n} samples of its one batched call"
        return RewardTimeout(
            f"reward function {self.spec} did not return within {timeout_s:g} s (rollout.reward_timeout_s) for {which}",
            hint=f"make {self.spec} return sooner (give what it waits for a timeout of its own), "
            "or raise rollout.reward_timeout_s",
        )

    def _call(
        self,
        *args: Any,
        index: int | None = None,
        timeout_s: float | None = None,
        watch: _Watch | None = None,
        batch_size: int = 0,
    ) -> Any:
        names = _BATCHED if self.batched else _PER_SAMPLE
        try:
            if self.keywords is None:
                result = self.fn(*args)
            else:
                result = self.fn(**{k: v for k, v in zip(names, args, strict=True) if k in self.keywords})
        except Exception as exc:
            raise self._failure(exc, index) from exc
        if not inspect.isawaitable(result):
            return result
        return self._guarded(result, index, timeout_s, watch, batch_size=batch_size)

    async def _guarded(
        self,
        result: Awaitable[Any],
        index: int | None,
        timeout_s: float | None,
        watch: _Watch | None,
        *,
        batch_size: int,
    ) -> Any:
        """An async call: cancelled at its deadline (the watchdog of _within catches one that blocks its loop)."""
        try:
            return await asyncio.wait_for(self._awaited(result, index, watch), timeout_s)
        except TimeoutError:  # wait_for's own: what the function raised is a RewardUnavailable by now
            raise self._timeout(BATCH if index is None else index, timeout_s or 0.0, n=batch_size) from None

    async def _awaited(self, result: Awaitable[Any], index: int | None, watch: _Watch | None) -> Any:
        # watched from its first step: coroutines queued behind one that blocks the loop are not yet running
        with watch.running(index) if watch is not None and index is not None else contextlib.nullcontext():
            try:
                return await result
            except Exception as exc:
                raise self._failure(exc, index) from exc

    def _failure(self, exc: Exception, index: int | None) -> Exception:
        where = f" on sample {index}" if index is not None else ""
        if isinstance(exc, ConnectionError | TimeoutError):
            return RewardUnavailable(
                f"reward function {self.spec} could not reach a dependency{where}: {type(exc).__name__}: {exc}"
            )
        return RewardError(f"reward function {self.spec} raised {type(exc).__name__}{where}: {exc}")


def _len_of(value: Any) -> str:
    return f"of length {len(value)}" if hasattr(value, "__len__") else ""


def _to_float(value: Any, *, spec: str, index: int) -> float:
    if isinstance(value, dict):
        value = value.get("score", value.get("reward"))
    if isinstance(value, str | bytes):  # float("1.0") would pass: a text where a score belongs is a bug upstream
        raise RewardError(
            f"reward function {spec} returned the {type(value).__name__} {value!r} for sample {index}; "
            "expected a number (int, float or bool)"
        )
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise RewardError(f"reward function {spec} returned {value!r} for sample {index}; expected a number") from None
    if not math.isfinite(out):
        raise RewardError(f"reward function {spec} returned {out} for sample {index}")
    return out


def _run_maybe_async(call: Callable[[], Any]) -> Any:
    result = call()
    if inspect.isawaitable(result):
        return run_coroutine(_await(result))
    return result


async def _await(aw: Awaitable[Any]) -> Any:
    return await aw


def _run_coroutines(calls: list[Callable[[], Any]]) -> list[Any]:
    async def gather() -> list[Any]:
        return list(await asyncio.gather(*(_await(c()) for c in calls)))

    return run_coroutine(gather())


BATCH = -1  # _Watch's key of a batched function's one call


class _Watch:
    """Which reward calls of a scoring job are running, and since when: the caller's watchdog reads it."""

    _POLL_S = 0.05  # when nothing is running (between two calls): look again this soon

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[int, float] = {}

    @contextlib.contextmanager
    def running(self, index: int) -> Iterator[None]:
        with self._lock:
            self._since[index] = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._since.pop(index, None)

    def _oldest(self) -> tuple[int, float] | None:
        with self._lock:
            return min(self._since.items(), key=lambda item: (item[1], item[0]), default=None)

    def overdue(self, timeout_s: float) -> int | None:
        oldest = self._oldest()
        return oldest[0] if oldest is not None and time.monotonic() - oldest[1] >= timeout_s else None

    def wait_s(self, timeout_s: float) -> float:
        oldest = self._oldest()
        if oldest is None:
            return min(self._POLL_S, timeout_s)
        return max(0.0, oldest[1] + timeout_s - time.monotonic())


@functools.lru_cache(maxsize=64)
def resolve_reward(spec: str) -> RewardFunction:
    """Built-in name, `module:function` or `file.py:function` -> RewardFunction (RewardSpecError if not)."""
    spec = spec.strip()
    if not spec:
        raise RewardSpecError(f"reward: empty name; use a built-in ({', '.join(BUILTIN_REWARDS)}) or module:function")
    if spec in _BUILTIN_NEEDS and importlib.util.find_spec(_BUILTIN_NEEDS[spec][0]) is None:
        raise RewardSpecError(
            f"reward {spec} needs the {_BUILTIN_NEEDS[spec][0].replace('_', '-')} package: {_BUILTIN_NEEDS[spec][1]}"
        )
    fn = BUILTIN_REWARDS.get(spec) or load_callable(
        spec,
        kind="reward",
        error=RewardSpecError,
        builtins=BUILTIN_REWARDS,
        attr_name="function",
        callable_as="a function",
    )
    return _describe(spec, fn)


def load_callable(
    spec: str, *, kind: str, error: type[ValueError], builtins: Iterable[str], attr_name: str, callable_as: str
) -> Callable[..., object]:
    """A plug-in that is no built-in: the callable `module:attr` or `path/to/file.py:attr` names (`error`, naming
    `kind`, the built-ins and the forms, when the spec is neither)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise error(
            f"{kind} {spec!r} is not a built-in ({', '.join(builtins)}) "
            f"and not of the form module:{attr_name} or path/to/file.py:{attr_name}"
        )
    fn = load_attribute(spec, kind=kind, error=error)
    if not callable(fn):
        raise error(f"{kind} {spec!r}: {attr} is a {type(fn).__name__}, not {callable_as}")
    return fn


def load_attribute(spec: str, *, kind: str, error: type[ValueError]) -> object:
    """The object `module:attr` or `path/to/file.py:attr` names (a plug-in: a reward, an environment); `error`
    (a ValueError naming `kind` and `spec`) when it cannot be loaded. A file is imported once per process."""
    target, _, attr = spec.rpartition(":")
    module = (
        _load_file(target, spec, kind, error)
        if target.endswith(".py") or "/" in target
        else _import(target, spec, kind, error)
    )
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise error(f"{kind} {spec!r}: {target} has no attribute {attr!r}")
    return obj


def _import(name: str, spec: str, kind: str, error: type[ValueError]) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise error(f"{kind} {spec!r}: module {exc.name!r} not found") from None
    except Exception as exc:  # noqa: BLE001 - user code may raise anything; the spec error names it
        raise error(f"{kind} {spec!r}: importing {name} failed: {type(exc).__name__}: {exc}") from None


def _load_file(path_text: str, spec: str, kind: str, error: type[ValueError]) -> Any:
    path = Path(path_text)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, REPO_ROOT / path]
    file = next((c.resolve() for c in candidates if c.is_file()), None)
    if file is None:
        raise error(f"{kind} {spec!r}: file {path_text} not found (tried {', '.join(str(c) for c in candidates)})")
    # one module per file, whichever plug-in asks first: a file may hold an environment and a reward
    name = f"tandem_plugin_{abs(hash(str(file))):x}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before it runs: a dataclass in it looks its module up there
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - user code may raise anything; the spec error names it
        del sys.modules[name]
        raise error(f"{kind} {spec!r}: loading {file} failed: {type(exc).__name__}: {exc}") from None
    return module


def _describe(spec: str, fn: Callable[..., Any]) -> RewardFunction:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    flag = getattr(fn, "batched", None)
    is_batched = bool(flag) if flag is not None else bool(named) and named[0] in ("prompts", "responses")
    known = _BATCHED if is_batched else _PER_SAMPLE
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return RewardFunction(spec=spec, fn=fn, batched=is_batched, keywords=known)
    if named and all(n in known for n in named):
        return RewardFunction(spec=spec, fn=fn, batched=is_batched, keywords=tuple(named))
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if params and len(positional) < 4 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise RewardSpecError(
            f"reward {spec!r}: {getattr(fn, '__name__', fn)} must take "
            f"({', '.join(known)}) or name a subset of them as parameters"
        )
    return RewardFunction(spec=spec, fn=fn, batched=is_batched, keywords=None)

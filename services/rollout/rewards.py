"""Reward functions: built-ins and a plug-in point.

`rollout.reward` is a built-in name (`exact_match`, `numeric_match`, `digit_task`) or `module:function`
(`my_pkg.rewards:score`) or `path/to/file.py:function` (a relative path is tried against the working
directory, then the repository root). A function is either

- per sample: `fn(prompt, response, label, metadata) -> float`, or
- batched: `fn(prompts, responses, labels, metadatas) -> list[float]` — marked with `@batched`, or
  recognised by a first parameter named `prompts` or `responses`;

and either may be `async def` (per-sample coroutines run concurrently). Parameters are passed by
keyword when the function names only known ones (so `fn(response, label)` works), positionally otherwise.
A result may be a number, a bool, or a dict with a `score` / `reward` entry; a string, even "1.0", is refused.
A function that raises fails the request with the sample named (`RewardError`, not retried), unless what it
raised is a ConnectionError or TimeoutError (`RewardUnavailable`, retried like any transient failure).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.rpc.grpc_util import Unavailable

REPO_ROOT = Path(__file__).resolve().parents[2]
_PER_SAMPLE = ("prompt", "response", "label", "metadata")
_BATCHED = ("prompts", "responses", "labels", "metadatas")


class RewardSpecError(ValueError):
    """`rollout.reward` (or a request's reward) does not name a usable function."""


class RewardError(ValueError):
    """A reward function raised or returned something that is not a finite number. Deterministic: the request
    fails (INVALID_ARGUMENT) and is not retried on another replica."""


class RewardUnavailable(Unavailable):
    """A reward function could not reach what it depends on (ConnectionError, TimeoutError: a remote judge or
    sandbox): transient, so the request fails with UNAVAILABLE and is retried."""


def batched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a reward function as taking lists (one call per batch)."""
    fn.batched = True  # type: ignore[attr-defined]
    return fn


# ---- built-ins ----------------------------------------------------------------------------------


def exact_match(prompt: str, response: str, label: str, metadata: dict[str, str]) -> float:
    """1 if the response equals the label after stripping surrounding whitespace."""
    return float(response.strip() == label.strip())


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


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
    if "####" in gold_text:                      # GSM8K: the answer follows the last ####
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


BUILTIN_REWARDS: dict[str, Callable[..., float]] = {
    "exact_match": exact_match, "numeric_match": numeric_match, "digit_task": digit_task}


# ---- resolution ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardFunction:
    spec: str
    fn: Callable[..., Any]
    batched: bool
    keywords: tuple[str, ...] | None     # parameter names to pass by keyword; None = positional

    def score(self, *, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[str],
              metadatas: Sequence[dict[str, str]]) -> list[float]:
        n = len(responses)
        if not (len(prompts) == len(labels) == len(metadatas) == n):
            raise ValueError("reward inputs differ in length")
        if n == 0:
            return []
        if self.batched:
            raw = _run_maybe_async(lambda: self._call(prompts, responses, labels, metadatas))
            if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or len(raw) != n:
                raise RewardError(f"batched reward {self.spec} returned {type(raw).__name__} "
                                  f"{_len_of(raw)} for {n} samples; expected a list of {n} numbers")
            return [_to_float(v, spec=self.spec, index=i) for i, v in enumerate(raw)]
        calls: list[Callable[[], Any]] = [
            functools.partial(self._call, p, r, lb, m, index=i)
            for i, (p, r, lb, m) in enumerate(zip(prompts, responses, labels, metadatas, strict=True))]
        raw = _run_coroutines(calls) if inspect.iscoroutinefunction(self.fn) else [_run_maybe_async(c) for c in calls]
        return [_to_float(v, spec=self.spec, index=i) for i, v in enumerate(raw)]

    def _call(self, *args: Any, index: int | None = None) -> Any:
        names = _BATCHED if self.batched else _PER_SAMPLE
        try:
            if self.keywords is None:
                result = self.fn(*args)
            else:
                result = self.fn(**{k: v for k, v in zip(names, args, strict=True) if k in self.keywords})
        except Exception as exc:
            raise self._failure(exc, index) from exc
        return self._guarded(result, index) if inspect.isawaitable(result) else result

    async def _guarded(self, result: Awaitable[Any], index: int | None) -> Any:
        try:
            return await result
        except Exception as exc:
            raise self._failure(exc, index) from exc

    def _failure(self, exc: Exception, index: int | None) -> Exception:
        where = f" on sample {index}" if index is not None else ""
        if isinstance(exc, ConnectionError | TimeoutError):
            return RewardUnavailable(f"reward function {self.spec} could not reach a dependency{where}: "
                                     f"{type(exc).__name__}: {exc}")
        return RewardError(f"reward function {self.spec} raised {type(exc).__name__}{where}: {exc}")


def _len_of(value: Any) -> str:
    return f"of length {len(value)}" if hasattr(value, "__len__") else ""


def _to_float(value: Any, *, spec: str, index: int) -> float:
    if isinstance(value, dict):
        value = value.get("score", value.get("reward"))
    if isinstance(value, str | bytes):   # float("1.0") would pass: a text where a score belongs is a bug upstream
        raise RewardError(f"reward function {spec} returned the {type(value).__name__} {value!r} for sample {index}; "
                          "expected a number (int, float or bool)")
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
        return _run_async(_await(result))
    return result


async def _await(aw: Awaitable[Any]) -> Any:
    return await aw


def _run_coroutines(calls: list[Callable[[], Any]]) -> list[Any]:
    async def gather() -> list[Any]:
        return list(await asyncio.gather(*(_await(c()) for c in calls)))
    return _run_async(gather())


def _run_async(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # Called from inside an event loop (a notebook, an async caller): run on a fresh loop elsewhere.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


@functools.lru_cache(maxsize=64)
def resolve_reward(spec: str) -> RewardFunction:
    """Built-in name, `module:function` or `file.py:function` -> RewardFunction (RewardSpecError if not)."""
    spec = spec.strip()
    if not spec:
        raise RewardSpecError("reward: empty name; use a built-in "
                              f"({', '.join(BUILTIN_REWARDS)}) or module:function")
    fn = BUILTIN_REWARDS.get(spec) or _load_callable(spec)
    return _describe(spec, fn)


def _load_callable(spec: str) -> Callable[..., Any]:
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise RewardSpecError(f"reward {spec!r} is not a built-in ({', '.join(BUILTIN_REWARDS)}) "
                              "and not of the form module:function or path/to/file.py:function")
    fn = load_attribute(spec, kind="reward", error=RewardSpecError)
    if not callable(fn):
        raise RewardSpecError(f"reward {spec!r}: {attr} is a {type(fn).__name__}, not a function")
    return fn


def load_attribute(spec: str, *, kind: str, error: type[ValueError]) -> Any:
    """The object `module:attr` or `path/to/file.py:attr` names (a plug-in: a reward, an environment); `error`
    (a ValueError naming `kind` and `spec`) when it cannot be loaded. A file is imported once per process."""
    target, _, attr = spec.rpartition(":")
    module = _load_file(target, spec, kind, error) if target.endswith(".py") or "/" in target else \
        _import(target, spec, kind, error)
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
        raise error(f"{kind} {spec!r}: file {path_text} not found (tried "
                    f"{', '.join(str(c) for c in candidates)})")
    # one module per file, whichever plug-in asks first: a file may hold an environment and a reward
    name = f"tandem_plugin_{abs(hash(str(file))):x}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module   # before it runs: a dataclass in it looks its module up there
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
        raise RewardSpecError(f"reward {spec!r}: {getattr(fn, '__name__', fn)} must take "
                              f"({', '.join(known)}) or name a subset of them as parameters")
    return RewardFunction(spec=spec, fn=fn, batched=is_batched, keywords=None)

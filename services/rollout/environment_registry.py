"""The environments `rollout.environment` can name: the built-ins, by name, in one explicit table; anything else as
`module:Class` or `path/to/file.py:Class` (loaded like a reward's `module:function`).

A built-in's module is imported only when it is resolved, and it registers nothing itself, so the table does not
depend on what was imported before. The config key stays a free string (a spec is a path), so this table is the one
list of names: the resolver and its error message read it, and a test keeps the config's description and
docs/own-task.md naming the same ones.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from services.rollout.environments import EnvironmentPlugin, EnvironmentSpecError
from services.rollout.rewards import load_callable

EnvironmentFactory = Callable[[], object]  # one episode's environment (checked where it is called)


@dataclass(frozen=True)
class BuiltinEnvironment:
    name: str
    load: Callable[[], EnvironmentFactory]  # imports the environment's module: called only when it is resolved


def _math_feedback() -> EnvironmentFactory:
    from services.rollout.math_feedback import MathFeedbackEnvironment

    return MathFeedbackEnvironment


BUILTIN_ENVIRONMENTS: Mapping[str, BuiltinEnvironment] = MappingProxyType(
    {e.name: e for e in (BuiltinEnvironment("math_feedback", _math_feedback),)}
)


@functools.lru_cache(maxsize=16)
def resolve_environment(spec: str) -> EnvironmentPlugin:
    """A built-in name, `module:Class` or `file.py:Class` -> EnvironmentPlugin (EnvironmentSpecError naming the
    problem if not)."""
    spec = spec.strip()
    builtin = BUILTIN_ENVIRONMENTS.get(spec)
    if builtin is not None:
        factory = builtin.load()
    else:
        factory = load_callable(
            spec,
            kind="environment",
            error=EnvironmentSpecError,
            builtins=sorted(BUILTIN_ENVIRONMENTS),
            attr_name="Class",
            callable_as="a class or factory",
        )
    if isinstance(factory, type):
        _check_class(spec, factory)
    return EnvironmentPlugin(spec=spec, factory=factory)


def _check_class(spec: str, cls: type) -> None:
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvironmentSpecError(
            f"environment {spec!r}: {cls.__name__} has no {' or '.join(missing)} "
            "method (see services.rollout.environments.Environment)"
        )
    if inspect.isabstract(cls):
        abstract = sorted(getattr(cls, "__abstractmethods__", ()))
        raise EnvironmentSpecError(
            f"environment {spec!r}: {cls.__name__} leaves abstract methods unimplemented ({', '.join(abstract)})"
        )

"""Multi-turn environments: the plug-in point beside the reward function.

`rollout.environment` names a built-in environment or a class (or any factory callable) as `module:Class` or
`path/to/file.py:Class`, resolved like `rollout.reward` (services/rollout/environment_registry.py). The rollout
makes one instance per episode (`factory()`, no arguments), so an instance keeps that episode's state. The contract
(`Environment`; subclassing it is optional, the methods are what counts):

- `reset(sample: EpisodeSample) -> observation`: the episode starts; the observation (may be empty) is
  appended to the prompt, so it is context, never trained on.
- `step(action: Action) -> (observation, reward, done)`: the policy's turn (`action.text`, `action.token_ids`);
  the observation is appended after it with loss_mask 0; `reward` is added to the episode's reward. After the
  turn that is `action.last_turn` (rollout.max_turns) the episode ends whatever `done` says: an environment that
  returns done there ends it as done (finish reason stop) rather than cut (length).

An observation is text, a message `{"role": ..., "content": ...}`, or a sequence of token ids (used as they are).
When the episode's prompt is a chat, text and messages are rendered with the chat template as a turn of the
conversation (text takes the role rollout.observation_role), closing the policy's turn and opening the next one
(services/rollout/chat_template.py); otherwise text (a message's content) is tokenized without special tokens.

Either method may be `async def`: the calls of a round then run concurrently, each within
`rollout.environment_timeout_s`. A sync method runs inline, one episode after another (a thread per call cost more
than a cheap step itself: ~1 ms against ~10 µs on the CI machine), so a step that waits on I/O should be
`async def` (or hand its blocking work to `asyncio.to_thread`). A method that raises fails the request naming
the episode (`EnvironmentFailure`, not retried), unless it raised ConnectionError or TimeoutError, or timed out
(`EnvironmentUnavailable`, retried like any transient failure).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from services.contracts.chat_messages import ChatMessage
from services.contracts.errors import Unavailable

Observation = str | Sequence[int] | Mapping[str, str]


class EnvironmentSpecError(ValueError):
    """`rollout.environment` does not name a built-in or a usable environment class or factory."""


class EnvironmentFailure(ValueError):
    """An environment raised or returned something unusable. Deterministic: the request fails (INVALID_ARGUMENT)."""


class EnvironmentUnavailable(Unavailable):
    """An environment could not reach what it depends on, or timed out: transient, retried (UNAVAILABLE)."""


@dataclass(frozen=True)
class EpisodeSample:
    """What an episode starts from: one prompt of the request (the same for every sample of its group)."""

    prompt: str
    prompt_ids: tuple[int, ...]
    label: str
    metadata: Mapping[str, str]
    group_id: int
    sample_index: int  # 0..n-1 within the group
    messages: tuple[ChatMessage, ...] = ()  # the prompt as a chat (empty for a text prompt)


@dataclass(frozen=True)
class Action:
    """One policy turn."""

    text: str  # decoded, special tokens removed
    token_ids: tuple[int, ...]
    finish_reason: str  # the engine's: stop (EOS or a stop token) or length (max_new_tokens or the context)
    turn: int  # 0-based
    last_turn: bool  # rollout.max_turns is reached: no turn follows, whatever step returns


class StepResult(NamedTuple):
    observation: Observation
    reward: float
    done: bool


RawStep = StepResult | tuple[Observation, float, bool]  # what a step may return (as_step_result checks it)


class Environment(ABC):
    """The plug-in contract; see the module docstring."""

    @abstractmethod
    def reset(self, sample: EpisodeSample) -> Observation | Awaitable[Observation]: ...

    @abstractmethod
    def step(self, action: Action) -> RawStep | Awaitable[RawStep]: ...


@dataclass(frozen=True)
class EnvironmentPlugin:
    """A resolved `rollout.environment`: `make()` builds one episode's environment."""

    spec: str
    factory: Callable[[], object] = field(repr=False)

    def make(self) -> object:
        """A new environment: the user's object, checked where it is called (call_environment)."""
        try:
            env = self.factory()
        except Exception as exc:
            raise EnvironmentFailure(
                f"environment {self.spec}: constructing it raised {type(exc).__name__}: {exc}"
            ) from exc
        return env


async def call_environment(
    env: object, method: str, arg: object, *, spec: str, episode: int, timeout_s: float
) -> object:
    """`env.<method>(arg)`: a sync method inline, an awaitable it returns (an `async def`) within `timeout_s`."""
    fn = getattr(env, method, None)
    where = f"environment {spec}: {method} of episode {episode}"
    if not callable(fn):
        raise EnvironmentFailure(f"{where}: the object {type(env).__name__} has no {method} method")
    try:
        result = fn(arg)
        return await asyncio.wait_for(result, timeout_s) if inspect.isawaitable(result) else result
    except TimeoutError as exc:
        raise EnvironmentUnavailable(
            f"{where} took longer than rollout.environment_timeout_s ({timeout_s} s) or raised TimeoutError: {exc}"
        ) from exc
    except ConnectionError as exc:
        raise EnvironmentUnavailable(f"{where} could not reach a dependency: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise EnvironmentFailure(f"{where} raised {type(exc).__name__}: {exc}") from exc


def as_step_result(raw: object, *, spec: str, episode: int) -> StepResult:
    """A step's return value checked: (observation, finite reward, bool done)."""
    where = f"environment {spec}: step of episode {episode}"
    if not isinstance(raw, tuple | list) or len(raw) != 3:
        raise EnvironmentFailure(f"{where} returned {type(raw).__name__}; expected (observation, reward, done)")
    observation, reward, done = raw
    if not isinstance(reward, numbers.Real):  # a text like "1.0" is a bug upstream, as for rewards
        raise EnvironmentFailure(f"{where} returned the reward {reward!r}; expected a number")
    if not math.isfinite(float(reward)):
        raise EnvironmentFailure(f"{where} returned the reward {float(reward)}")
    if not (isinstance(done, bool) or type(done).__name__ == "bool_"):  # numpy's bool too; not 0/1 or None
        raise EnvironmentFailure(f"{where} returned done={done!r}; expected True or False")
    return StepResult(observation=observation, reward=float(reward), done=bool(done))


def observation_message(observation: object, *, role: str, spec: str, episode: int) -> ChatMessage | None:
    """Text or a {role, content} message as a chat message (None for token ids or nothing)."""
    if isinstance(observation, str):
        return ChatMessage(role=role, content=observation) if observation else None
    if isinstance(observation, Mapping):
        named, content = observation.get("role"), observation.get("content")
        if not isinstance(named, str) or not named or not isinstance(content, str):
            raise EnvironmentFailure(
                f"environment {spec}: the observation of episode {episode} is a mapping without "
                f"text 'role' and 'content': {dict(observation)!r:.200}"
            )
        return ChatMessage(role=named, content=content)
    return None


def observation_ids(
    observation: object, *, encode: Callable[[str], list[int]], vocab_size: int | None, spec: str, episode: int
) -> list[int]:
    """An observation as token ids without a chat template: text (a message's content) is encoded, ids are checked
    against the vocabulary."""
    message = observation_message(observation, role="", spec=spec, episode=episode)
    if message is not None:
        return encode(message.content) if message.content else []
    if observation is None or isinstance(observation, str):
        return []
    where = f"environment {spec}: the observation of episode {episode}"
    if isinstance(observation, bytes) or not isinstance(observation, Sequence):
        raise EnvironmentFailure(f"{where} is a {type(observation).__name__}; expected text or a list of token ids")
    ids = []
    for token in observation:
        if (
            isinstance(token, bool)
            or not isinstance(token, int)
            or token < 0
            or (vocab_size is not None and token >= vocab_size)
        ):
            raise EnvironmentFailure(f"{where} holds {token!r}; token ids are ints in [0, {vocab_size or 'vocab'})")
        ids.append(int(token))
    return ids

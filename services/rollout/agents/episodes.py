"""Episodes: every call to the endpoint belongs to one, and each keeps what its turns generated, token for token.

A turn records its prompt's and response's token ids, the response's log-probs (in the engine's reported space),
its finish reason and each token's policy version. A turn whose prompt extends the previous turn's tokens (prompt,
then response) continues the episode's current sample: the tokens in between (tool results, the user's reply, the
next assistant header) go in with loss_mask 0, the turn's own with 1. A turn whose prompt does not (the agent
rewrote the history: summarised, dropped or edited turns) starts a new sample. An episode that was never rewritten
is one sample.

Nothing is re-tokenized: when a chat request's messages are the previous request's messages followed by the
assistant message this endpoint answered (as the agent got it back), the new prompt is the previous turn's prompt
and generated ids, then only the new messages rendered by the chat template after an assistant turn (chat_template.py's
continuation_text). Re-encoding the decoded answer would often split it into other tokens (prime-rl #1334,
verl #2618), and the policy would be trained on tokens it never sampled.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.contracts.sampling_spec import SamplingSpec
from services.contracts.untyped import JsonObject, JsonValue
from services.rollout.engines.interface import FINISH_STOP, SampleOutput

OPEN, FINISHED, FAILED = "open", "finished", "failed"


class EpisodeError(ValueError):
    """An episode that is unknown, closed, or asked for something it cannot do; `status` is the HTTP status."""

    def __init__(self, message: str, *, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AgentRow:
    """The data row of an episode, as an agent gets it."""

    text: str  # a text prompt ("" for a chat)
    messages: tuple[Mapping[str, str], ...]  # a chat prompt
    label: str
    metadata: Mapping[str, str]
    group_id: int
    sample_index: int
    rendered: str = ""  # the prompt as the model reads it (a chat rendered by the template)

    @property
    def conversation(self) -> list[dict[str, str]]:
        """The row as chat messages: its own, or its text as the user's message."""
        return [dict(m) for m in self.messages] or [{"role": "user", "content": self.text}]

    def as_json(self) -> JsonObject:
        return {
            "text": self.text,
            "messages": [dict(m) for m in self.messages],
            "label": self.label,
            "metadata": dict(self.metadata),
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "conversation": self.conversation,
        }


Message = tuple[str, str, str, tuple[tuple[str, str], ...]]  # role, content, tool_call_id, ((name, args), ...)


def normalized(message: Mapping[str, JsonValue]) -> Message:
    """What makes two messages the same turn: role, text, the tool call answered, the calls made (ids and key order
    of the arguments aside: an agent rebuilds them)."""
    calls = tuple((c["function"]["name"], _canonical(c["function"].get("arguments"))) for c in tool_calls_of(message))
    return (str(message.get("role")), content_text(message), str(message.get("tool_call_id") or ""), calls)


def content_text(message: Mapping[str, JsonValue]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)  # parts are checked text-only by requests.py


def tool_calls_of(message: Mapping[str, JsonValue]) -> list[Mapping[str, JsonValue]]:
    return list(message.get("tool_calls") or [])


def _canonical(arguments: JsonValue) -> str:
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return str(arguments)
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def template_message(message: Mapping[str, JsonValue]) -> JsonObject:
    """A message as chat templates read it (Hugging Face's convention): text content, tool-call arguments as
    objects."""
    out: JsonObject = {"role": message["role"], "content": content_text(message)}
    calls = tool_calls_of(message)
    if calls:
        out["tool_calls"] = [
            {
                "id": c.get("id", ""),
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": _arguments_object(c["function"])},
            }
            for c in calls
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def _arguments_object(function: Mapping[str, JsonValue]) -> JsonValue:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments or {}


@dataclass
class _Sample:
    """One training sample of an episode: a prompt, then turns and what came between them."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = FINISH_STOP
    turns: int = 0

    @property
    def context(self) -> list[int]:
        return [*self.prompt_ids, *self.tokens]

    def add_turn(self, between: Sequence[int], output: SampleOutput) -> None:
        before = self.versions[-1] if self.versions else output.versions[0] if output.token_ids else 0
        self.tokens += [*between, *output.token_ids]
        self.mask += [0] * len(between) + [1] * len(output.token_ids)
        self.log_probs += [0.0] * len(between) + list(output.log_probs)
        self.versions += [before] * len(between) + list(output.versions)
        self.finish_reason = output.finish_reason
        self.turns += 1

    def output(self, version: int) -> SampleOutput:
        return SampleOutput(
            token_ids=tuple(self.tokens),
            log_probs=tuple(self.log_probs),
            finish_reason=self.finish_reason,
            weight_version=min(self.versions, default=version),
            token_versions=tuple(self.versions),
        )


@dataclass(frozen=True)
class EpisodeSample:
    prompt_ids: tuple[int, ...]
    output: SampleOutput
    loss_mask: tuple[int, ...]


@dataclass
class _LastTurn:
    prompt_ids: tuple[int, ...]
    output: SampleOutput
    messages: tuple[Message, ...]  # the request's messages and the answer, normalized (chat turns only)
    text: str  # the prompt's text and the answer's (completions turns only)


class Episode:
    """One agent's run over one data row (or a free episode, trained on by nobody, when `sampling` is None)."""

    def __init__(self, episode_id: str, row: AgentRow | None, sampling: SamplingSpec | None, deadline: float):
        self.id = episode_id
        self.row = row
        self.sampling = sampling  # the run's distribution: a training episode's turns are all drawn from it
        self.deadline = deadline  # time.monotonic()
        self.status = OPEN
        self.reward: float | None = None
        self.error = ""
        self.claimed = False
        self.turns = 0
        self.rewritten = 0  # turns that did not extend the previous one's tokens
        self.reused_turns = 0  # turns whose prompt reused the previous turn's generated ids
        self.transcript: list[Mapping[str, JsonValue]] = []  # the last chat request's messages and its answer
        self.last_answer = ""  # the text of the last turn's answer (what rollout.reward scores)
        self.samples: list[_Sample] = []
        self._last: _LastTurn | None = None
        self.lock = threading.Lock()
        self.finished = threading.Event()

    def check_open(self) -> None:
        if self.status != OPEN:
            raise EpisodeError(
                f"episode {self.id} is {self.status}" + (f": {self.error}" if self.error else ""), status=409
            )
        if time.monotonic() > self.deadline:
            raise EpisodeError(f"episode {self.id} is past its deadline (rollout.agent_timeout_s)", status=409)

    def reused_prefix(
        self, messages: Sequence[Mapping[str, JsonValue]]
    ) -> tuple[list[int], SampleOutput, list[Mapping[str, JsonValue]]] | None:
        """When `messages` continue the last chat turn (its request's messages, then the answer it got): that turn's
        prompt ids, its output and the messages after it; else None."""
        last = self._last
        if last is None or not last.messages:
            return None
        known = len(last.messages)
        if len(messages) < known or tuple(normalized(m) for m in messages[:known]) != last.messages:
            return None
        return list(last.prompt_ids), last.output, list(messages[known:])

    def reused_text_prefix(self, prompt: str) -> tuple[list[int], str] | None:
        """A completions prompt that starts with the last turn's prompt text and answer: those ids, and the rest."""
        last = self._last
        if last is None or not last.text or not prompt.startswith(last.text):
            return None
        return [*last.prompt_ids, *last.output.token_ids], prompt[len(last.text) :]

    def record(
        self,
        prompt_ids: Sequence[int],
        output: SampleOutput,
        *,
        messages: Sequence[Mapping[str, JsonValue]] = (),
        answer: Mapping[str, JsonValue] | None = None,
        text: str = "",
        answer_text: str = "",
        reused: bool = False,
    ) -> None:
        """A turn: continues the current sample when its prompt extends it, else starts a new one."""
        with self.lock:
            current = self.samples[-1] if self.samples else None
            context = current.context if current is not None else None
            if current is not None and context is not None and list(prompt_ids[: len(context)]) == context:
                current.add_turn(prompt_ids[len(context) :], output)
            else:
                if current is not None:
                    self.rewritten += 1
                fresh = _Sample(prompt_ids=list(prompt_ids))
                fresh.add_turn((), output)
                self.samples.append(fresh)
            self.turns += 1
            self.reused_turns += int(reused)
            self.last_answer = answer_text
            chat = tuple(normalized(m) for m in [*messages, *([answer] if answer is not None else [])])
            self._last = _LastTurn(tuple(prompt_ids), output, chat if answer is not None else (), text)
            if answer is not None:
                self.transcript = [*messages, answer]

    def training_samples(self, version: int) -> list[EpisodeSample]:
        with self.lock:
            return [
                EpisodeSample(prompt_ids=tuple(s.prompt_ids), output=s.output(version), loss_mask=tuple(s.mask))
                for s in self.samples
            ]

    def finish(self, reward: float) -> None:
        with self.lock:
            if self.status != OPEN:
                raise EpisodeError(f"episode {self.id} is already {self.status}; a reward is posted once", status=409)
            if not self.samples:
                self.status, self.error = FAILED, "it finished without a single call to the endpoint"
            else:
                self.status, self.reward = FINISHED, float(reward)
        self.finished.set()

    def fail(self, error: str) -> None:
        with self.lock:
            if self.status != OPEN:
                return
            self.status, self.error = FAILED, error
        self.finished.set()


class EpisodeStore:
    """The episodes of a rollout service, by id; thread-safe (the endpoint's loop and the gRPC threads share it)."""

    def __init__(self) -> None:
        self._episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()

    def open(
        self, row: AgentRow | None, sampling: SamplingSpec | None, *, timeout_s: float, claimed: bool = True
    ) -> Episode:
        episode = Episode(f"ep-{uuid.uuid4().hex}", row, sampling, time.monotonic() + timeout_s)
        episode.claimed = claimed
        with self._lock:
            self._episodes[episode.id] = episode
        return episode

    def get(self, episode_id: str) -> Episode:
        with self._lock:
            episode = self._episodes.get(episode_id)
        if episode is None:
            raise EpisodeError(f"episode {episode_id!r} is not open on this rollout service", status=404)
        return episode

    def claim(self, limit: int) -> list[Episode]:
        """Up to `limit` open episodes no agent has taken yet, each handed out once."""
        with self._lock:
            free = [e for e in self._episodes.values() if not e.claimed and e.status == OPEN][:limit]
            for e in free:
                e.claimed = True
        return free

    def close(self, episodes: Sequence[Episode]) -> None:
        with self._lock:
            for e in episodes:
                self._episodes.pop(e.id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._episodes)

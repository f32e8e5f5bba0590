"""The request bodies the endpoint takes, checked before any work: what it honours, and what it refuses by name.

Honoured: model (any name: the endpoint serves the run's policy), messages / prompt, n, temperature, top_p,
max_tokens (max_completion_tokens), stop, logprobs (each token's log-prob; no top alternatives), tools, tool_choice
(auto, none), stream (stream_options.include_usage), seed, user, parallel_tool_calls. Taken at their no-op value only:
frequency_penalty and presence_penalty 0, logit_bias empty, response_format text, top_logprobs 0. Anything else is
refused: a 400 whose OpenAI-style body names the parameter, never a silent change to what was asked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from services.contracts.rollout_config import stop_strings_problem
from services.contracts.untyped import JsonValue

MAX_N = 128
_ROLES = ("system", "developer", "user", "assistant", "tool")
_COMMON = {
    "model",
    "n",
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "stream",
    "stream_options",
    "seed",
    "user",
    "logprobs",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
}
_CHAT = _COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
}
_COMPLETIONS = _COMMON | {"prompt"}


class Refused(ValueError):
    """A parameter the endpoint cannot honour, or a malformed one: HTTP 400 naming it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class Params:
    """The generation parameters of a request; None where the request left them out."""

    model: str
    n: int
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    stop: tuple[str, ...]
    logprobs: bool
    seed: int | None
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class ChatRequest:
    params: Params
    messages: tuple[Mapping[str, JsonValue], ...]
    tools: tuple[Mapping[str, JsonValue], ...]  # () when tool_choice is none
    offered_tools: tuple[Mapping[str, JsonValue], ...]  # as sent (the template renders them even with tool_choice none)


@dataclass(frozen=True)
class CompletionRequest:
    params: Params
    prompt: str | tuple[int, ...]


def chat_request(body: JsonValue) -> ChatRequest:
    body = _object(body)
    _known(body, _CHAT)
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
        raise Refused("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise Refused("top_logprobs", "top alternatives are not computed; logprobs: true gives each token's log-prob")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise Refused("response_format", "constrained output (json_object, json_schema) is not supported")
    if body.get("parallel_tool_calls") is False:
        raise Refused("parallel_tool_calls", "false cannot be enforced; the model may call several tools")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise Refused("logprobs", f"must be true or false, got {logprobs!r}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Refused("messages", "must be a non-empty list of messages")
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise Refused("tool_choice", f"{choice!r} cannot be enforced; auto (the default) or none")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params = _params(body, max_tokens=max_tokens, logprobs=bool(logprobs))
    return ChatRequest(
        params=params,
        messages=tuple(_message(m, i) for i, m in enumerate(messages)),
        tools=() if choice == "none" else tools,
        offered_tools=tools,
    )


def completion_request(body: JsonValue) -> CompletionRequest:
    body = _object(body)
    _known(body, _COMPLETIONS)
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0) and logprobs is not True:
        raise Refused("logprobs", "top alternatives are not computed; 0 gives each token's log-prob")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str) and prompt:
        text: str | tuple[int, ...] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
        text = tuple(prompt)
    else:
        raise Refused("prompt", "must be one non-empty string or one list of token ids (one prompt per request)")
    return CompletionRequest(
        params=_params(body, max_tokens=body.get("max_tokens"), logprobs=logprobs is not None), prompt=text
    )


def _object(body: JsonValue) -> Mapping[str, JsonValue]:
    if not isinstance(body, dict):
        raise Refused("body", "must be a JSON object")
    return body


def _known(body: Mapping[str, JsonValue], honoured: set[str]) -> None:
    for key in body:
        if key not in honoured:
            raise Refused(key, "not supported by this endpoint")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise Refused(key, "penalties would change the policy's distribution; only 0")
    if body.get("logit_bias"):
        raise Refused("logit_bias", "would change the policy's distribution; only empty")


def _params(body: Mapping[str, JsonValue], *, max_tokens: JsonValue, logprobs: bool) -> Params:
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise Refused("n", f"must be an integer in 1..{MAX_N}, got {n!r}")
    temperature = _number(body, "temperature", low=0.0, high=2.0)
    top_p = _number(body, "top_p", low=0.0, high=1.0)
    if top_p == 0.0:
        raise Refused("top_p", "must be above 0")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise Refused("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
    stop = body.get("stop")
    stops = (
        () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else None
    )
    problem = "must be a string or a list of strings" if stops is None else stop_strings_problem(stops)
    if problem or stops is None:
        raise Refused("stop", problem or "must be a string or a list of strings")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise Refused("seed", f"must be an integer, got {seed!r}")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise Refused("stream", f"must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise Refused("stream_options", "only include_usage is supported")
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise Refused("model", "must be a string")
    return Params(
        model=model,
        n=n,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        stop=stops,
        logprobs=logprobs,
        seed=seed,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
    )


def _number(body: Mapping[str, JsonValue], key: str, *, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise Refused(key, f"must be a number, got {value!r}")
    if not low <= value <= high:
        raise Refused(key, f"must be in [{low:g}, {high:g}], got {value}")
    return float(value)


def _tools(tools: JsonValue) -> tuple[Mapping[str, JsonValue], ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise Refused("tools", "must be a list of function tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise Refused(f"tools[{i}]", "must be {'type': 'function', 'function': {...}}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise Refused(f"tools[{i}].function.name", "must be a non-empty string")
    return tuple(tools)


def _message(message: JsonValue, index: int) -> Mapping[str, JsonValue]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise Refused(where, "must be an object with a role")
    role = message.get("role")
    if role not in _ROLES:
        raise Refused(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
    content = message.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise Refused(f"{where}.content[{j}]", f"only text parts are supported, got {kind!r}")
    elif content is not None and not isinstance(content, str):
        raise Refused(f"{where}.content", "must be a string or a list of text parts")
    for j, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise Refused(f"{where}.tool_calls[{j}]", "must be {'type': 'function', 'function': {'name': ...}}")
    return message

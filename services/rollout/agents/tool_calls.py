"""Tool calls read from a model's text in its family's format, returned to the agent as OpenAI `tool_calls`.

- hermes: Qwen2.5 / Qwen3 / Hermes, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per
  call; the text outside the blocks is the message's content.
- llama3_json: Llama 3.1 / 3.2's JSON tool calls, `{"name": ..., "parameters": {...}}` (after `<|python_tag|>`,
  which decoding drops), several separated by `;`; a text that is not such JSON is content.
- none: no tool calls are read.
- `module:function` / `file.py:function`: a function (text, tools) -> ParsedTurn, for a model with its own format.

A call whose JSON does not parse stays in the content, as vLLM's and SGLang's parsers leave it: the agent sees what
the model wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.contracts.untyped import JsonObject, JsonValue
from services.rollout.rewards import load_attribute

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ToolParserError(ValueError):
    """rollout.openai_api.tool_parser names no parser."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> JsonObject:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedTurn:
    content: str
    tool_calls: tuple[ToolCall, ...] = ()


ToolParser = Callable[[str, Sequence[Mapping[str, JsonValue]]], ParsedTurn]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _call_from(obj: JsonValue, argument_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(args, str):
        return ToolCall(name=obj["name"], arguments=args)
    return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def hermes(text: str, tools: Sequence[Mapping[str, JsonValue]] = ()) -> ParsedTurn:
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for match in _HERMES.finditer(text):
        try:
            call = _call_from(json.loads(match.group(1)), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            continue  # not a call: its text stays in the content
        kept.append(text[at : match.start()])
        at = match.end()
        calls.append(call)
    kept.append(text[at:])
    return ParsedTurn(content="".join(kept).strip() if calls else text, tool_calls=tuple(calls))


def llama3_json(text: str, tools: Sequence[Mapping[str, JsonValue]] = ()) -> ParsedTurn:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedTurn(content=text)
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    at = 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return ParsedTurn(content=text)
        call = _call_from(obj, ("parameters", "arguments"))
        if call is None:
            return ParsedTurn(content=text)
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\n;":
            at += 1
    return ParsedTurn(content="", tool_calls=tuple(calls))


def no_tool_calls(text: str, tools: Sequence[Mapping[str, JsonValue]] = ()) -> ParsedTurn:
    return ParsedTurn(content=text)


BUILTIN_PARSERS: Mapping[str, ToolParser] = {"hermes": hermes, "llama3_json": llama3_json, "none": no_tool_calls}


def auto_parser_name(tokenizer: PreTrainedTokenizerBase) -> str:
    """The family's format, told by its vocabulary."""
    vocab = tokenizer.get_vocab()
    if "<tool_call>" in vocab:
        return "hermes"
    if "<|python_tag|>" in vocab:
        return "llama3_json"
    return "none"


def resolve_tool_parser(spec: str, tokenizer: PreTrainedTokenizerBase) -> tuple[str, ToolParser]:
    """The parser rollout.openai_api.tool_parser names, and its name (auto resolved)."""
    name = auto_parser_name(tokenizer) if spec == "auto" else spec
    if name in BUILTIN_PARSERS:
        return name, BUILTIN_PARSERS[name]
    if ":" not in name:
        raise ToolParserError(
            f"rollout.openai_api.tool_parser {spec!r} is not one of auto, {', '.join(BUILTIN_PARSERS)} "
            "and not of the form module:function or path/to/file.py:function"
        )
    fn = load_attribute(name, kind="rollout.openai_api.tool_parser", error=ToolParserError)
    if not callable(fn):
        raise ToolParserError(f"rollout.openai_api.tool_parser {spec!r} is a {type(fn).__name__}, not a function")
    return name, fn

"""The tiny model's tool-call format (`rollout.openai_api.tool_parser: agent_tools/tool_call.py:parse`): its answer
`(` is a call of the request's one tool, with no arguments. A real model's family has its own format, read by a
built-in parser (hermes for Qwen2.5/Qwen3, llama3_json for Llama 3.2; `auto` picks it): this file is only needed
because the tiny vocabulary cannot spell JSON."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from services.rollout.agents.tool_calls import ParsedTurn, ToolCall

CALL = "("


def parse(text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedTurn:
    words = text.split()
    if len(tools) != 1 or not words or words[0] != CALL:
        return ParsedTurn(content=text)
    return ParsedTurn(content="", tool_calls=(ToolCall(name=tools[0]["function"]["name"], arguments="{}"),))

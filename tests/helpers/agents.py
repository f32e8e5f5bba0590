"""Agents for tests of rollout.agent (services/rollout/agents/): each written with the plain `openai` client, as a
user's would be."""

from __future__ import annotations

import asyncio
from typing import Any

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


async def _ask(client: Any, messages: list[Any]) -> Any:
    response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=1)
    return response.choices[0].message


async def call_then_answer(client: Any, row: Any) -> float:
    """Always two turns: the first answer is followed by a tool result whatever it was, then one more answer."""
    messages = row.conversation
    first = await _ask(client, messages)
    messages += [first, {"role": "tool", "tool_call_id": "call_0", "content": row.label}]
    await _ask(client, messages)
    return 1.0 if row.sample_index % 2 else 0.0


async def rewrite_history(client: Any, row: Any) -> float:
    """Two turns; the second replaces the whole conversation with a summary (a rewritten history)."""
    await _ask(client, row.conversation)
    await _ask(client, [{"role": "user", "content": "1 + 2 ="}])
    return 0.5


async def crash_hang_or_answer(client: Any, row: Any) -> float | None:
    """Sample 0 raises after a call, sample 1 hangs; the others return None (rollout.reward scores the answer)."""
    await _ask(client, row.conversation)
    if row.sample_index == 0:
        raise RuntimeError("the agent's own bug")
    if row.sample_index == 1:
        await asyncio.sleep(3600)
    return None


async def always_crash(client: Any, row: Any) -> float:
    raise KeyError("missing_tool")


async def never_calls(client: Any, row: Any) -> float:
    return 1.0


def not_async(client: Any, row: Any) -> float:
    return 1.0

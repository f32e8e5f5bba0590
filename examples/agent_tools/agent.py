"""An agent written with the plain `openai` client: it asks the model, runs the tool the model calls, and loops
until the model answers (`rollout.agent: agent_tools/agent.py:solve`). Nothing in it knows about Tandem: pointed at
any OpenAI-compatible server it runs the same.

The task is examples/tool_lookup's: the question `k =` has the answer table[k], a table the model sees only through
the `lookup` tool; an answer counts only after a lookup (examples/tool_lookup/README.md says why).
"""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionToolParam

TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "The value the question's key has in the hidden table.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
MAX_TURNS = 3


def lookup(question: str, table: str) -> str:
    """The tool: the question's entry of its table (`4 =` -> table[4])."""
    return table[int(question.split()[0])]


async def solve(client: AsyncOpenAI, row: Any) -> float:
    messages: list[Any] = row.conversation  # [{"role": "user", "content": "4 ="}]
    question = messages[-1]["content"]
    looked_up = False
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=1)
        message = response.choices[0].message
        messages.append(message)  # sent back as it came: the endpoint reuses the tokens it generated
        if not message.tool_calls:
            answer = (message.content or "").split()
            return float(looked_up and answer[:1] == [row.label])
        for call in message.tool_calls:
            looked_up = True
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": lookup(question, row.metadata["table"])}
            )
    return 0.0

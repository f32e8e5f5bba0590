"""Chat messages, as prompts carry them from the data file to the rollout's chat template (torch-free: the
coordinator reads them, the rollout renders them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


def messages_json(messages: Sequence[ChatMessage]) -> str:
    """The conversation as a reward function reads it from metadata["messages"]: a JSON list of {role, content}."""
    return json.dumps([m.as_dict() for m in messages], ensure_ascii=False)

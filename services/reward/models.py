"""The plug-in point of the reward service: a `RewardModel` scores a batch of samples. The classifier and the judge
implement it; tests drive RewardService over fakes of it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.contracts.reward_calls import RewardSample, ScoreResult


class RewardModel(Protocol):
    @property
    def type(self) -> str:
        """`classifier` or `judge`."""

    @property
    def path(self) -> str:
        """The model's directory."""

    def score(self, samples: Sequence[RewardSample]) -> ScoreResult:
        """A score per sample, in order (time_s and queue_s are the service's to fill)."""


def chat_of(sample: RewardSample) -> list[dict[str, str]]:
    """The conversation a sample is: its prompt's messages (or its text as one user turn), then the response as the
    assistant's turn."""
    turns = [m.as_dict() for m in sample.messages] or [{"role": "user", "content": sample.prompt}]
    return [*turns, {"role": "assistant", "content": sample.response}]

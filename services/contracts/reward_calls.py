"""What the reward service is asked and answers, as frozen dataclasses: RewardService takes and returns these, the
rollout's remote reward builds and reads them, and only the gRPC edges (reward/server.py, rollout/reward_client.py) turn
them into tandem.v1 messages and back."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.contracts.chat_messages import ChatMessage


@dataclass(frozen=True)
class RewardSample:
    """One sample to score: the prompt (a chat's messages when it was one, and its text as the policy read it), the
    response, the reference answer and the data row's other fields."""

    prompt: str
    response: str
    label: str = ""
    messages: tuple[ChatMessage, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreRequest:
    model: str
    samples: tuple[RewardSample, ...]
    trace_context: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SubScores:
    """One named sub-score of every sample of a call, in order."""

    values: tuple[float, ...]


@dataclass(frozen=True)
class ScoreResult:
    """A score per sample, named sub-scores (name -> one value per sample), a judge's raw verdicts (empty for a
    classifier) and which of them could not be parsed (their count is `parse_failures`, not sent: one fact)."""

    scores: tuple[float, ...]
    sub_scores: dict[str, SubScores] = field(default_factory=dict)
    verdicts: tuple[str, ...] = ()
    parse_failed: tuple[bool, ...] = ()  # a judge's, per sample (empty: none failed)
    time_s: float = 0.0
    queue_s: float = 0.0
    tokens: int = 0

    @property
    def parse_failures(self) -> int:
        return sum(self.parse_failed)


@dataclass(frozen=True)
class RewardModelState:
    name: str
    type: str
    path: str
    samples_scored: int = 0
    parse_failures: int = 0


@dataclass(frozen=True)
class RewardState:
    models: tuple[RewardModelState, ...]
    device: str = ""

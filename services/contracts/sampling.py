"""What defines a sampling distribution, without torch (the wire format and configs use it; the math that
samples and scores under it is services.tensors.sampling)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class SamplingParamsLike(Protocol):
    """What defines a sampling distribution (the rollout's SamplingOptions has these and more)."""

    @property
    def temperature(self) -> float: ...

    @property
    def top_p(self) -> float: ...

    @property
    def top_k(self) -> int: ...


@dataclass(frozen=True)
class SamplingDistribution:
    """temperature 0 = greedy; top_p 1 and top_k 0 = off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

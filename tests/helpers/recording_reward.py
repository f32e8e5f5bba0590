"""A batched reward that records what it was given (the tests that drive a RolloutService in-process read it)."""

from __future__ import annotations

SEEN: list[tuple[str, str, dict[str, str]]] = []  # (prompt, label, metadata) per sample


def record(prompts, labels, metadatas):
    SEEN.extend(zip(prompts, labels, metadatas, strict=True))
    return [0.0] * len(prompts)

"""The error a Generate maps when every agent episode failed (importable without the `agents` extra)."""

from __future__ import annotations


class AgentsFailed(RuntimeError):
    """Every episode of a request failed: no batch can form."""

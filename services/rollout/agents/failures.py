"""The agents' errors the service maps (importable without the `agents` extra)."""


class AgentsFailed(RuntimeError):
    """Every episode of a request failed: no batch can form."""

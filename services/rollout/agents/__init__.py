"""Agents through an OpenAI-compatible endpoint on the rollout service (docs/agents.md): the ASGI app (app.py) and
its server thread (server.py), the request rules (requests.py), the episodes that record every call's token ids
(episodes.py), tool-call parsers (tool_calls.py), the engine batcher (batcher.py) and the agent runner (runner.py)."""

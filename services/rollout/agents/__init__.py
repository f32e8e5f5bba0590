"""Agents through an OpenAI-compatible endpoint on the rollout service (docs/agents.md): the ASGI app (app.py) and
its server thread (server.py), the request rules (requests.py), what a checked request does (endpoint.py), the
episodes that record every call's token ids (episodes.py), tool-call parsers (tool_calls.py), the engine batcher
(batcher.py), the agent runner (runner.py) and its sample source (source.py), the preflight (checks.py) and the
`tandem ctl episodes` / `reward` client (episodes_client.py)."""

"""`tandem run`'s preflight of rollout.openai_api and rollout.agent (launcher/preflight.py calls it)."""

from __future__ import annotations

from services.contracts.config import TandemConfig


def check_agents(config: TandemConfig) -> None:
    """`tandem run`'s preflight of rollout.openai_api / rollout.agent: the `agents` extra is installed, the agent
    function and a named tool parser load (ValueError naming the key)."""
    from services.contracts.agents_config import AGENT_EXTERNAL

    ro = config.rollout
    if not ro.openai_api.enabled:
        return
    import importlib.util

    missing = [name for name in ("starlette", "uvicorn", "openai") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"rollout.openai_api.enabled needs {', '.join(missing)}: pip install -e '.[agents]' (the agents extra)"
        )
    from services.rollout.agents.runner import resolve_agent
    from services.rollout.agents.tool_calls import BUILTIN_PARSERS, ToolParserError
    from services.rollout.rewards import load_attribute

    if ro.agent is not None and ro.agent != AGENT_EXTERNAL:
        resolve_agent(ro.agent)
    parser = ro.openai_api.tool_parser
    if parser != "auto" and parser not in BUILTIN_PARSERS:
        if ":" not in parser:
            raise ToolParserError(
                f"rollout.openai_api.tool_parser {parser!r} is not one of auto, {', '.join(BUILTIN_PARSERS)} "
                "and not of the form module:function"
            )
        load_attribute(parser, kind="rollout.openai_api.tool_parser", error=ToolParserError)

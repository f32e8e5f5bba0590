"""rollout.openai_api and rollout.agent: the OpenAI-compatible endpoint of a rollout service and the agents that
drive it (services/rollout/agents/, docs/agents.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from services.contracts.config_base import Section

AGENT_EXTERNAL = "external"


class OpenAIApiConfig(Section):
    """The endpoint: POST /v1/chat/completions and /v1/completions, each call in an episode."""

    enabled: bool = Field(default=False, description="serve the endpoint beside the gRPC server (127.0.0.1 only)")
    port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="its port; replica r listens on port + r (0: a free port, logged and handed out with episodes)",
    )
    tool_parser: str = Field(
        default="auto",
        min_length=1,
        description="how tool calls are read from the model's text: hermes (Qwen2.5/Qwen3 <tool_call> JSON), "
        "llama3_json (Llama 3.2), none, `module:function`, or auto (hermes when the vocabulary has <tool_call>, "
        "llama3_json when it has <|python_tag|>, else none)",
    )
    max_pending_requests: int = Field(
        default=4096, ge=1, description="calls waiting for the engine at once; more are answered 429"
    )


class AgentSettings(Section):
    """The keys of rollout that run agents (mixed into RolloutSettings)."""

    openai_api: OpenAIApiConfig = OpenAIApiConfig()
    agent: str | None = Field(
        default=None,
        description="each sample is an episode of an agent through openai_api: `module:function` or "
        "`file.py:function` (an async function given an openai.AsyncOpenAI client and the data row), or "
        "external (a separate process claims episodes and posts their rewards); unset = no agent",
    )
    agent_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="an episode must finish (return, or post its reward) within this after it was opened; a "
        "later one is dropped from the batch with an error naming it",
    )

    @model_validator(mode="after")
    def _agent_needs_the_endpoint(self) -> AgentSettings:
        if self.agent is not None and not self.openai_api.enabled:
            raise ValueError(
                f"rollout.agent: {self.agent} talks to the rollout service through its OpenAI-compatible endpoint; "
                "set rollout.openai_api.enabled: true"
            )
        return self

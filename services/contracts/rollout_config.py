"""The rollout section: sampling, the DAPO options, and the engine's own keys by rollout.engine (native, sglang)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from services.contracts.agents_config import AgentSettings
from services.contracts.config_base import Section
from services.contracts.reward_spec import parse_reward, reward_text
from services.contracts.untyped import JsonValue

NO_REWARD = "none"  # rollout.reward: every sample's reward is 0 (pure distillation needs no reward function)
MAX_STOP_STRINGS = 16  # the check runs per running sequence and step; more strings is likely a mistake


def stop_strings_problem(stop: tuple[str, ...]) -> str | None:
    """What is wrong with a list of stop strings (the config and the wire check the same), or None."""
    if len(stop) > MAX_STOP_STRINGS:
        return f"holds {len(stop)} strings; at most {MAX_STOP_STRINGS}"
    for i, text in enumerate(stop):
        if not isinstance(text, str) or not text:
            return f"[{i}] is empty: an empty stop string would end every sample at its first token"
    if len(set(stop)) != len(stop):
        return f"names a string twice: {list(stop)}"
    return None


class SamplingConfig(Section):
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 = off")
    max_new_tokens: int = Field(default=16, ge=1)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = Field(
        default=(),
        description="stop strings: a sample ends at the token whose text "
        "completes one; that token is kept (the response holds the string) and the finish "
        "reason is stop",
    )
    seed: int = 0
    ignore_eos: bool = Field(default=False, description="keep generating past EOS (benchmarks that force a length)")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        problem = stop_strings_problem(value)
        if problem:
            raise ValueError(problem)
        return value


class SGLangConfig(Section):
    urls: tuple[str, ...] = Field(default=(), description="servers the user runs; empty = launch one")
    launch_args: tuple[str, ...] = ()
    pause_mode: Literal["abort", "retract", "in_place"] = "retract"
    request_timeout_s: float = Field(default=600.0, gt=0)
    weight_load_format: Literal["tensor", "flattened_bucket"] = Field(
        default="tensor",
        description="how /update_weights_from_distributed receives a bucket: one broadcast per "
        "tensor, or one per bucket (load_format flattened_bucket)",
    )
    startup_timeout_s: float = Field(default=900.0, gt=0, description="wait for /health_generate (launch or urls)")
    api_key: str | None = Field(default=None, description="SGLang's --api-key (sent as a bearer token)")


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling (docs/algorithms.md): groups whose rewards are all equal are filtered out, and more
    prompts are generated until a step has rollout_batch_size informative groups."""

    enabled: bool = False
    max_rounds: int = Field(
        default=3,
        ge=1,
        description="generation rounds of one step at most, the first included "
        "(each draws the next rollout_batch_size prompts); at the cap the step trains on the "
        "informative groups there are (metric rollout/groups_short)",
    )
    min_std: float = Field(
        default=1e-6, ge=0, description="a group is informative when the population std of its rewards exceeds this"
    )


class OverlongPenaltyConfig(Section):
    """DAPO's soft overlong punishment: a length penalty over the last `buffer_tokens` before max_new_tokens, added
    to the reward by the rollout before the batch is written."""

    enabled: bool = False
    buffer_tokens: int = Field(
        default=1,
        ge=1,
        description="the penalty grows from 0 at max_new_tokens - buffer_tokens to -factor at max_new_tokens",
    )
    factor: float = Field(default=1.0, gt=0)


class RolloutSettings(AgentSettings):
    """The keys of rollout every engine has (RolloutConfig below adds each engine's own)."""

    engine: Literal["native", "sglang"] = "native"
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch's intra-op CPU threads in the rollout "
        "service (null: 4 on a GPU, torch's default on the CPU)",
    )
    rollout_batch_size: int = Field(default=32, ge=1, description="prompts per rollout step")
    n_samples_per_prompt: int = Field(default=8, ge=1)
    sampling: SamplingConfig = SamplingConfig()
    eval_sampling: SamplingConfig = SamplingConfig(temperature=0.0)
    eval_n_samples_per_prompt: int = Field(default=1, ge=1)
    reward: str = Field(
        default="exact_match",
        description="built-in name or `module:function` (sync or async, batched or per sample), a reward service "
        "model (`service:NAME`, `judge:NAME`), a weighted sum: `{math_answer: 0.7, judge:NAME: 0.3}`; none: reward "
        "0 for every sample (pure distillation, algorithm.distillation)",
    )
    eval_reward: str | None = Field(
        default=None,
        description="what evals score with (the same forms as reward); unset = rollout.reward. A rule-checked "
        "eval of a run trained on a model's reward",
    )
    reward_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="each reward call (one per sample, or the "
        "one call of a batched function) must return within this, else the run "
        "fails naming the function and the sample (not retried); defaults to "
        "half of loop.step_timeout_s",
    )
    inflight_update: Literal["off", "keep", "recompute"] = Field(
        default="off",
        description="a weight sync lands between two decode steps of running samples instead of "
        "waiting for them: keep = they go on with the KV cache of the old weights, recompute = their KV cache is "
        "recomputed under the new weights first; off = the sync waits for running generation (drain)",
    )
    max_batch_size: int = Field(default=512, ge=1, description="sequences decoded together by the engine")
    max_context_length: int | None = Field(default=None, ge=1, description="defaults to the model's")
    max_request_samples: int = Field(
        default=65536,
        ge=1,
        description="most samples (prompts × n) one Generate or "
        "Evaluate call may ask for; larger requests are refused (INVALID_ARGUMENT)",
    )
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    overlong_penalty: OverlongPenaltyConfig = OverlongPenaltyConfig()
    environment: str | None = Field(
        default=None,
        description="multi-turn environment: a built-in (math_feedback), `module:Class` or "
        "`file.py:Class` (docs/own-task.md); unset = one turn per sample",
    )
    max_turns: int = Field(default=4, ge=1, description="environment: most policy turns (generations) per episode")
    episode_reward: Literal["env", "env_plus_reward"] = Field(
        default="env",
        description="environment: an episode's reward is the sum of its step rewards (env), or that "
        "plus rollout.reward's score of the whole response, observations included (env_plus_reward)",
    )
    environment_timeout_s: float = Field(default=60.0, gt=0, description="one reset or step call of an environment")
    observation_role: str = Field(
        default="user",
        min_length=1,
        description="environment: the chat role a text "
        "observation takes when the episode's prompt is a chat (tool where the template "
        "has one); an observation {role, content} names its own",
    )

    @field_validator("reward", "eval_reward", mode="before")
    @classmethod
    def _reward_text(cls, value: JsonValue) -> JsonValue:
        if isinstance(value, dict):
            try:
                return reward_text({str(k): float(v) for k, v in value.items()})
            except (TypeError, ValueError) as exc:
                raise ValueError(f"a weighted sum maps each reward to a number: {exc}") from None
        return value

    @field_validator("reward", "eval_reward")
    @classmethod
    def _reward_parses(cls, value: str | None) -> str | None:
        if value is not None:
            parse_reward(value)
        return value

    @model_validator(mode="after")
    def _environment_keys(self) -> RolloutSettings:
        if self.environment is None and self.episode_reward != "env":
            raise ValueError(
                "rollout.episode_reward: env_plus_reward needs rollout.environment (without one, "
                "rollout.reward alone scores each sample)"
            )
        if self.environment is not None and self.overlong_penalty.enabled:
            raise ValueError(
                "rollout.overlong_penalty measures one generation against sampling.max_new_tokens; an "
                "episode of rollout.environment holds several turns and observations, so the two are "
                "refused together (algorithm.overlong_filter does apply: it masks episodes that were cut)"
            )
        if self.agent is not None and self.environment is not None:
            raise ValueError(
                f"rollout.agent ({self.agent}) and rollout.environment ({self.environment}) both say how an "
                "episode is played; set one"
            )
        return self


class NativeRolloutConfig(RolloutSettings):
    """rollout.engine native: Tandem's own engine in the rollout process (transformers, static KV cache)."""

    engine: Literal["native"] = "native"
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    decode: Literal["auto", "dynamic", "static", "graph", "compile"] = Field(
        default="auto",
        description="native engine's decode path: auto (graph on a GPU for Llama / Qwen2 / Qwen3, else dynamic); "
        "graph (a static KV cache, the decode step replayed as a CUDA graph); compile (the same step through "
        "torch.compile: fewer kernels, its first call per cache bucket compiles for tens of seconds); static (the "
        "static cache without graphs, any device); dynamic (Hugging Face's forward and DynamicCache)",
    )
    continuous_batching: bool = Field(
        default=False,
        description="native engine: the samples of concurrent calls decode as one batch, and a "
        "finished sample's row goes to a waiting one (on a GPU through the CUDA-graph decode step, per-row cache "
        "slots); pair with loop.mode: streaming",
    )


class SGLangRolloutConfig(RolloutSettings):
    """rollout.engine sglang: SGLang servers behind the rollout service (docs/sglang.md)."""

    engine: Literal["sglang"] = "sglang"
    sglang: SGLangConfig = SGLangConfig()


# rollout: by rollout.engine (native when not given); a key of the other engine is refused by name
RolloutConfig = Annotated[NativeRolloutConfig | SGLangRolloutConfig, Field(discriminator="engine")]

"""The `reward:` section: the reward service (`tandem reward CONFIG`) and the models it serves by name.

    reward:
      device: auto
      models:
        helpfulness: {type: judge, path: models/judge, template: rubric.j2, parser: 'verdict: (\\d)'}
        preference: {type: classifier, path: models/rm}

`rollout.reward` names a model as `service:NAME` (or `judge:NAME`, `classifier:NAME`), alone or in a weighted sum
with rule rewards (reward_spec.py). docs/rewards.md describes the keys.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from services.contracts.config_base import Section


class ClassifierModelConfig(Section):
    """A Hugging Face sequence classifier (AutoModelForSequenceClassification): the chat (prompt messages + the
    response as the assistant's turn) through its own tokenizer's chat template, one forward pass per batch."""

    type: Literal["classifier"] = "classifier"
    path: str = Field(description="local Hugging Face model directory")
    tokenizer_path: str | None = Field(default=None, description="defaults to path")
    dtype: Literal["float32", "bfloat16"] = "float32"
    chat_template: bool = Field(
        default=True,
        description="render prompt + response with the tokenizer's chat template (false: prompt text + response)",
    )
    max_length: int = Field(default=4096, ge=2, description="tokens per sample; longer ones are cut from the left")
    max_batch_tokens: int = Field(default=16384, ge=1, description="padded tokens per forward pass")
    score_index: int = Field(default=0, ge=0, description="the logit that is the score")
    sub_scores: tuple[str, ...] = Field(
        default=(),
        description="names of the logits returned as sub-scores, in the head's order (ArmoRM-style heads)",
    )


class JudgeModelConfig(Section):
    """A generative judge on Tandem's native engine: the rubric (a Jinja template with prompt, response, label,
    metadata and messages in scope) is the judge's prompt, its verdict text is parsed into a score."""

    type: Literal["judge"] = "judge"
    path: str = Field(description="local Hugging Face causal LM directory")
    tokenizer_path: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    template: str = Field(description="the rubric: a Jinja template, or a file holding one (.j2 / .jinja / .txt)")
    chat: bool = Field(default=False, description="send the rubric as a user turn through the judge's chat template")
    parser: str = Field(
        default=r"(-?\d+(?:\.\d+)?)",
        description="a regex whose first group (else whole match) is the score, or module:function taking the "
        "verdict text and returning a number or None",
    )
    score_range: tuple[float, float] = Field(default=(0.0, 1.0), description="a parsed score outside is clipped")
    default_score: float = Field(default=0.0, description="the score of a verdict that cannot be parsed")
    max_new_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=0.0, ge=0, description="0 = greedy (the default)")
    n: int = Field(default=1, ge=1, description="votes per sample; the score is the most common parsed one")
    stop: tuple[str, ...] = ()
    max_batch_size: int = Field(default=256, ge=1, description="sequences the judge's engine decodes together")
    seed: int = 0

    @model_validator(mode="after")
    def _range(self) -> JudgeModelConfig:
        lo, hi = self.score_range
        if not lo <= hi:
            raise ValueError(f"score_range: {lo} > {hi}")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"n: {self.n} votes need temperature > 0 (greedy votes are all the same verdict)")
        return self


RewardModelConfig = Annotated[ClassifierModelConfig | JudgeModelConfig, Field(discriminator="type")]


class RewardServiceConfig(Section):
    """The reward service and how the rollout calls it."""

    models: dict[str, RewardModelConfig] = Field(description="name -> a classifier or a judge")
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    memory_fraction: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="the share of the GPU's memory this service may take (colocated on the rollout's GPU)",
    )
    cpu_threads: int | None = Field(default=None, ge=1, description="torch's intra-op CPU threads")
    call_timeout_s: float = Field(default=60.0, gt=0, description="the deadline of one Score call")
    max_wait_s: float = Field(
        default=120.0,
        gt=0,
        description="a reward service that is down or slow is retried this long (calls of call_timeout_s), then "
        "the batch fails naming the service",
    )
    max_batch_tokens: int = Field(
        default=8192, ge=1, description="rollout side: samples of finished groups sent in one Score call"
    )
    max_calls_in_flight: int = Field(default=4, ge=1, description="rollout side: Score calls at once per replica")

    @model_validator(mode="after")
    def _some(self) -> RewardServiceConfig:
        if not self.models:
            raise ValueError("reward.models: empty; name at least one model")
        if self.max_wait_s < self.call_timeout_s:
            raise ValueError(f"reward.max_wait_s ({self.max_wait_s:g}) is below reward.call_timeout_s")
        return self

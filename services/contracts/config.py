"""Typed run configuration: one YAML file, validated before anything starts.

Every service reads the same `TandemConfig`; each takes the sections it needs. Unknown keys are
errors (a typo must not silently fall back to a default), and every error names its key. The larger sections live in
their own modules (trainer_config.py, algorithm_config.py), and so do those with variants (rollout_config.py by
engine, weights_config.py by transport, tracing_config.py with its trackers by type); a key of another variant than
the chosen one is refused by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from services.contracts.algorithm_config import AlgorithmConfig, DistillationConfig
from services.contracts.algorithms import ADVANTAGE_ESTIMATORS
from services.contracts.config_base import ConfigError, Section, with_default_variant
from services.contracts.reward_config import ClassifierModelConfig, JudgeModelConfig, RewardServiceConfig
from services.contracts.reward_spec import parse_reward
from services.contracts.rollout_config import (
    NO_REWARD,
    DynamicSamplingConfig,
    NativeRolloutConfig,
    OverlongPenaltyConfig,
    RolloutConfig,
    SamplingConfig,
    SGLangConfig,
    SGLangRolloutConfig,
    stop_strings_problem,
)
from services.contracts.tracing_config import (
    JsonlTrackerConfig,
    PrometheusTrackerConfig,
    TensorBoardTrackerConfig,
    TracingConfig,
    TrackerConfig,
    WandbTrackerConfig,
)
from services.contracts.trainer_config import LORA_ZERO3_OFFLOAD, LoraConfig, TrainerConfig
from services.contracts.untyped import JsonValue
from services.contracts.weights_config import (
    CudaIpcWeights,
    DiskWeights,
    ProcessGroupWeights,
    WeightsConfig,
    for_transport,
    weights_config,
)

__all__ = [  # the sections of other modules, named here too: a TandemConfig's parts are found in one place
    "LORA_ZERO3_OFFLOAD",
    "AlgorithmConfig",
    "ClassifierModelConfig",
    "ConfigError",
    "CudaIpcWeights",
    "DiskWeights",
    "DistillationConfig",
    "DynamicSamplingConfig",
    "JsonlTrackerConfig",
    "JudgeModelConfig",
    "LoraConfig",
    "NativeRolloutConfig",
    "OverlongPenaltyConfig",
    "ProcessGroupWeights",
    "PrometheusTrackerConfig",
    "RewardServiceConfig",
    "RolloutConfig",
    "SGLangConfig",
    "SGLangRolloutConfig",
    "SamplingConfig",
    "Section",
    "TandemConfig",
    "TensorBoardTrackerConfig",
    "TracingConfig",
    "TrackerConfig",
    "TrainerConfig",
    "WandbTrackerConfig",
    "WeightsConfig",
    "for_transport",
    "stop_strings_problem",
    "weights_config",
]


class ModelConfig(Section):
    path: str = Field(description="local Hugging Face model directory (see `tandem init-model`)")
    tokenizer_path: str | None = Field(default=None, description="defaults to model.path")
    dtype: Literal["float32", "bfloat16"] = "float32"
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = "sdpa"
    fused_kernels: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="fused Triton RMSNorm and SwiGLU in the trained model (forward and backward), the "
        "frozen ones and the native engine's; auto = on a CUDA device with Triton and bf16 weights",
    )
    init_preset: (
        Literal["tiny", "small", "q05", "q15", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-0.6b", "llama3.2-1b"] | None
    ) = Field(
        default=None,
        description="the random-init preset `tandem run --init-model` builds when model.path holds no "
        "model (default tiny; `tandem init-model --help` describes them); nothing is ever built without that flag",
    )
    init_body: Literal["tiny"] | None = Field(
        default=None,
        description="with a real model's init_preset: build it over a tiny body (its vocabulary, "
        "tokenizer, special ids, rope and tying; 2 layers of width 64)",
    )

    @model_validator(mode="after")
    def _body_needs_a_real_preset(self) -> ModelConfig:
        if self.init_body is not None and self.init_preset in (None, "tiny", "small", "q05", "q15"):
            raise ValueError(
                f"model.init_body applies to a real model's init_preset (qwen2.5-0.5b, qwen2.5-1.5b, "
                f"qwen3-0.6b, llama3.2-1b), not to {self.init_preset or 'the default tiny'}"
            )
        return self


CHAT_TEMPLATE_MODES = ("auto", "tokenizer", "none")
# apply_chat_template's own arguments: Tandem sets them (a chat is rendered to text, ending in the generation prompt)
_RESERVED_TEMPLATE_KWARGS = (
    "conversation",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
)


class DataConfig(Section):
    """Where prompts come from and how they become the model's input (docs/own-task.md)."""

    train_path: str = Field(
        description="JSONL file (.jsonl), parquet file (.parquet) or a directory written by "
        "`datasets.Dataset.save_to_disk`; one prompt per line / row"
    )
    eval_path: str | None = None
    prompt_key: str = Field(
        default="prompt",
        description="the prompt's key: a string, or a list of chat messages "
        "({role, content}); a dotted path (extra_info.question) reaches into nested objects",
    )
    label_key: str = Field(
        default="label",
        description="the reference answer's key, dotted paths allowed (reward_model.ground_truth, as verl writes it)",
    )
    chat_template: str = Field(
        default="auto",
        description="auto: message-list prompts get the tokenizer's chat "
        "template, text prompts are used as they are; tokenizer: the tokenizer's template "
        "for every prompt (a text prompt becomes one user message); none: no template "
        "(message lists are refused); or a Jinja template file, applied to every prompt",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra variables for the template, e.g. {enable_thinking: false}"
    )
    system_prompt: str | None = Field(
        default=None,
        description="a system message put before every chat that has "
        "none of its own (a string prompt then becomes one user message)",
    )
    shuffle: bool = True
    seed: int = 0
    num_epochs: int = Field(default=1, ge=1)
    eval_max_prompts: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _chat_keys(self) -> DataConfig:
        if self.chat_template == "none" and self.system_prompt is not None:
            raise ValueError(
                "data.system_prompt needs a chat template, and data.chat_template is none (use auto or "
                "a template file, or put the system text into the prompts)"
            )
        if not self.chat_template.strip():
            raise ValueError("data.chat_template: empty; use auto, tokenizer, none or a Jinja template file")
        reserved = [k for k in self.chat_template_kwargs if k in _RESERVED_TEMPLATE_KWARGS]
        if reserved:
            raise ValueError(
                f"data.chat_template_kwargs: {', '.join(reserved)} is set by Tandem (a chat is rendered "
                "to text ending in the assistant's generation prompt); give only the template's own "
                "variables"
            )
        return self

    @property
    def chat_template_file(self) -> str | None:
        """The template file data.chat_template names, or None for auto / tokenizer / none."""
        return None if self.chat_template in CHAT_TEMPLATE_MODES else self.chat_template

    @property
    def text_prompts_are_chats(self) -> bool:
        """A text prompt becomes one user message: the template is asked for every prompt, or a system prompt given."""
        return self.chat_template not in ("auto", "none") or self.system_prompt is not None


class LoopConfig(Section):
    mode: Literal["async", "sync", "fully_async", "streaming"] = Field(
        default="async",
        description="async: the next step generates while this one trains (one step off-policy); "
        "sync: generate, train, sync; fully_async: one generation per replica always in flight; streaming: every "
        "prompt is its own Generate, groups stream to the buffer as they finish and a step trains the first "
        "rollout_batch_size done (docs/architecture.md)",
    )
    num_rollout: int | None = Field(default=None, ge=1, description="defaults to dataset size × epochs / batch")
    save_interval: int | None = Field(default=None, ge=1)
    save_trigger_sentinel: str | None = Field(default=None, description="a file whose appearance triggers a save")
    eval_interval: int | None = Field(default=None, ge=1)
    skip_eval_before_train: bool = False
    update_weights_interval: int = Field(default=1, ge=1)
    debug_exit_after_rollout: int | None = Field(default=None, ge=1)
    offload_train: bool = False
    offload_rollout: bool = Field(
        default=False,
        description="sync mode, trainer and engines sharing GPUs: the "
        "engines release KV cache, CUDA graphs and weights while the trainer trains, and "
        "take them back around the weight sync (weights first, then the KV cache)",
    )
    max_staleness: int = Field(
        default=1,
        ge=0,
        description="fully_async, streaming: step − sample version bound (a sample's version is its oldest token's)",
    )
    groups_in_flight: int | None = Field(
        default=None,
        ge=1,
        description="streaming: groups generating or done and "
        "waiting for a step, over all replicas (default 2 × rollout_batch_size)",
    )
    stale_policy: Literal["drop"] = "drop"
    step_timeout_s: float = Field(default=600.0, gt=0)
    startup_timeout_s: float = Field(default=300.0, gt=0)
    max_retries: int = Field(default=2, ge=0, description="retries of a failed Generate on another replica")


class RedisConfig(Section):
    url: str | None = Field(default=None, description="redis:// or rediss://; empty = embedded redis-server")
    password: str | None = None
    stream_prefix: str = "tandem"
    max_buffered_batches: int = Field(default=4, ge=1)
    put_timeout_s: float = Field(default=300.0, gt=0)
    get_timeout_s: float = Field(default=300.0, gt=0)
    claim_idle_ms: int = Field(default=60_000, ge=1)
    chunk_mb: float = Field(default=64.0, gt=0, le=256.0, description="payload chunk size (Redis bulk limit 512 MB)")
    appendonly: bool = True
    appendfsync: Literal["always", "everysec", "no"] = Field(
        default="everysec", description="embedded redis-server: `always` loses no acknowledged write on a crash"
    )


class ServiceAddress(Section):
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="0 = pick a free port at start")

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"


class TimeoutsConfig(Section):
    """Deadlines of the calls that have no key of their own. The step, start-up, weight-transfer and Redis deadlines
    are loop.step_timeout_s, loop.startup_timeout_s, weights.timeout_s and redis.*_timeout_s."""

    control_s: float = Field(
        default=30.0,
        gt=0,
        description="short control calls: GetState, Resume, Pause, SGLang's pause/continue/flush/server_info",
    )
    probe_s: float = Field(
        default=5.0,
        gt=0,
        description="a replica that failed a call: does it still hold the "
        "synced weights? (GetState); SGLang's end_weight_update / destroy group",
    )
    memory_s: float = Field(
        default=120.0, gt=0, description="Offload/Onload of the trainer, ReleaseMemory/ResumeMemory of the engines"
    )
    shutdown_s: float = Field(
        default=15.0,
        gt=0,
        description="a graceful stop of a service, a trainer rank or redis-server before it is killed",
    )
    process_group_s: float = Field(
        default=1800.0, gt=0, description="collectives between trainer ranks (torch.distributed's timeout)"
    )
    redis_socket_s: float = Field(default=30.0, gt=0, description="one Redis command")
    redis_connect_s: float = Field(default=10.0, gt=0, description="connecting to Redis")
    health_check_s: float = Field(default=2.0, gt=0, description="one gRPC health check while waiting for a service")


class ServicesConfig(Section):
    bind_host: str = Field(default="127.0.0.1", description="interface the services listen on")
    coordinator: ServiceAddress = ServiceAddress()
    trainer: ServiceAddress = ServiceAddress()
    critic: ServiceAddress = ServiceAddress()
    rollout: tuple[ServiceAddress, ...] = (ServiceAddress(),)
    reward: ServiceAddress = ServiceAddress()
    auth_token: str | None = Field(default=None, description="bearer token required by control RPCs")
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    max_message_mb: int = Field(default=64, ge=1, le=2047)
    max_restarts: int = Field(
        default=0,
        ge=0,
        description="tandem run: restarts of a dead trainer, rollout, "
        "coordinator or embedded redis-server (0 = a dead child fails the run)",
    )
    timeouts: TimeoutsConfig = TimeoutsConfig()
    max_watch_streams: int = Field(
        default=32,
        ge=1,
        le=1024,
        description="coordinator: WatchEvents streams open "
        "at once (each on a thread beside the control API's); more get RESOURCE_EXHAUSTED",
    )

    @field_validator("rollout")
    @classmethod
    def _at_least_one_rollout(cls, value: tuple[ServiceAddress, ...]) -> tuple[ServiceAddress, ...]:
        if not value:
            raise ValueError(
                "must list at least one rollout address (one per rollout replica), e.g. rollout: [{port: 0}]"
            )
        return value

    @model_validator(mode="after")
    def _tls_pair(self) -> ServicesConfig:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("services.tls_cert and services.tls_key must be given together")
        return self


class TandemConfig(Section):
    run_name: str = "tandem"
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = NativeRolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    loop: LoopConfig = LoopConfig()
    weights: WeightsConfig = ProcessGroupWeights()
    redis: RedisConfig = RedisConfig()
    tracing: TracingConfig = TracingConfig()
    services: ServicesConfig = ServicesConfig()
    reward: RewardServiceConfig | None = Field(
        default=None, description="the reward service and its models (`tandem reward`); unset = rule rewards only"
    )

    @field_validator("rollout", mode="before")
    @classmethod
    def _default_engine(cls, value: JsonValue) -> JsonValue:
        return with_default_variant(value, key="engine", default="native")

    @field_validator("weights", mode="before")
    @classmethod
    def _default_transport(cls, value: JsonValue) -> JsonValue:
        return with_default_variant(value, key="transport", default="gloo")

    @model_validator(mode="after")
    def _cross_section_rules(self) -> TandemConfig:
        validate_async_off_policy_correction(self)
        validate_dapo_options(self)
        validate_distillation(self)
        if (
            self.algorithm.compares_within_groups
            and self.rollout.n_samples_per_prompt == 1
            and self.algorithm.distillation is None  # the teacher's per-token signal needs no group
        ):
            raise ValueError(
                f"rollout.n_samples_per_prompt: 1 gives every sample advantage 0 with "
                f"algorithm.advantage_estimator: {self.algorithm.advantage_estimator} (its baseline is "
                "the other samples of the prompt); sample 2 or more per prompt, or use reinforce_pp"
            )
        validate_streaming(self)
        validate_reward_models(self)
        if self.rollout.inflight_update != "off" and self.rollout.engine == "sglang" and self.algorithm.keep_old_actor:
            raise ValueError(
                "algorithm.keep_old_actor scores each token under the snapshot of the version that "
                "sampled it, and with rollout.inflight_update SGLang 0.5.x does not report which tokens "
                "an update reached; use decoupled PPO (use_tis with tis_mode: mask, or rollout_correction) or "
                "rollout log-probs"
            )
        if self.rollout.inflight_update != "off" and self.loop.mode == "sync":
            raise ValueError(
                f"rollout.inflight_update: {self.rollout.inflight_update} needs loop.mode async or "
                "fully_async (in sync mode no generation runs while the weights are synced)"
            )
        if self.loop.offload_rollout and self.loop.mode != "sync":
            raise ValueError(
                f"loop.offload_rollout needs loop.mode: sync (in {self.loop.mode} mode the engines "
                "generate the next batch while the trainer trains)"
            )
        if self.loop.offload_train and self.trainer.lora is not None and self.trainer.zero_stage == 3:
            raise ValueError(LORA_ZERO3_OFFLOAD)
        if self.weights.transport == "cuda_ipc" and self.trainer.num_ranks > 1:
            raise ValueError("weights.transport: cuda_ipc needs trainer.num_ranks == 1 (rank 0 owns the buckets)")
        if self.trainer.precision != "fp32" and self.model.dtype != "bfloat16" and self.weights.transport == "cuda_ipc":
            raise ValueError(
                f"model.dtype must be bfloat16 when trainer.precision is {self.trainer.precision} with cuda_ipc"
            )
        if self.rollout.reward_timeout_s is not None and self.rollout.reward_timeout_s >= self.loop.step_timeout_s:
            raise ValueError(
                f"rollout.reward_timeout_s ({self.rollout.reward_timeout_s:g}) must be below "
                f"loop.step_timeout_s ({self.loop.step_timeout_s:g}), the deadline of the Generate that "
                "scores: else the Generate times out first and the reward that hung is not named"
            )
        if self.rollout.agent is not None and self.rollout.agent_timeout_s >= self.loop.step_timeout_s:
            raise ValueError(
                f"rollout.agent_timeout_s ({self.rollout.agent_timeout_s:g}) must be below loop.step_timeout_s "
                f"({self.loop.step_timeout_s:g}), the deadline of the Generate that waits for the episodes: else "
                "it times out first and the episodes that never finished are not named"
            )
        if self.trainer.optimizer == "adamw_deepspeed" and self.trainer.zero_stage == 0:
            raise ValueError(
                "trainer.optimizer: adamw_deepspeed needs trainer.zero_stage 1-3 (stage 0 steps with "
                "Tandem's flat fused AdamW; use adamw_torch)"
            )
        return self

    @property
    def streaming_groups_in_flight(self) -> int:
        """loop.mode streaming: groups generating or done and waiting for a step (loop.groups_in_flight, by default
        two steps' worth); each is one Generate call."""
        return self.loop.groups_in_flight or 2 * self.rollout.rollout_batch_size

    def with_model_path(self, path: str) -> TandemConfig:
        return self.model_copy(update={"model": self.model.model_copy(update={"path": path})})


def validate_reward_models(config: TandemConfig) -> None:
    """Every reward-service model rollout.reward / eval_reward names is one reward.models serves, of the type its
    prefix says."""
    models = config.reward.models if config.reward is not None else {}
    for key, text in (("rollout.reward", config.rollout.reward), ("rollout.eval_reward", config.rollout.eval_reward)):
        for term in parse_reward(text) if text else ():
            if term.model is None:
                continue
            if term.model not in models:
                served = ", ".join(models) or "none: add a reward: section"
                raise ValueError(f"{key}: {term.spec} names no model of reward.models (served: {served})")
            if term.model_type is not None and models[term.model].type != term.model_type:
                raise ValueError(
                    f"{key}: {term.spec} is a {models[term.model].type} in reward.models; write "
                    f"{models[term.model].type}:{term.model} or service:{term.model}"
                )


def validate_async_off_policy_correction(config: TandemConfig) -> None:
    """Asynchronous generation trains on samples from an older policy: the ratio's denominator must be that
    policy (rollout log-probs, or the old actor) or an importance weight (rollout_correction.is) must reweight for
    it. A critic is no correction (its values do not change the ratio), so PPO needs one too, as miles requires;
    unlike miles this also holds for GRPO, whose ratio is just as off-policy."""
    if config.loop.mode == "sync":
        return
    algo = config.algorithm
    if algo.use_rollout_logprobs or algo.rollout_correction.reweights or algo.keep_old_actor:
        return
    raise ValueError(
        f"loop.mode: {config.loop.mode} trains on samples of an older policy, but no off-policy correction is on "
        "(a critic is none): set algorithm.use_rollout_logprobs: true, algorithm.rollout_correction.is (or "
        "algorithm.use_tis: true) or algorithm.keep_old_actor: true, or use loop.mode: sync"
    )


def validate_distillation(config: TandemConfig) -> None:
    """Without a task reward only a teacher trains the policy; dynamic sampling, which drops the groups whose task
    rewards are all equal, would then drop groups the teacher still has something to say about."""
    distill = config.algorithm.distillation
    no_reward = config.rollout.reward.strip() == NO_REWARD
    if no_reward and distill is None:
        raise ValueError(
            "rollout.reward: none gives every sample reward 0, so nothing would train the policy; it is for "
            "pure distillation (set algorithm.distillation) or name a reward function"
        )
    if config.rollout.dynamic_sampling.enabled and (no_reward or (distill is not None and not distill.task_reward)):
        why = "rollout.reward: none" if no_reward else "algorithm.distillation.task_reward: false"
        raise ValueError(
            f"rollout.dynamic_sampling drops groups whose task rewards are all equal; with {why} the task reward "
            "does not train, and the dropped groups would take the teacher's signal with them: turn one off"
        )


def validate_streaming(config: TandemConfig) -> None:
    """Streaming writes one buffer entry per group, so the buffer must hold every group in flight; continuous
    batching is the native engine's (SGLang batches continuously by itself)."""
    ro, loop = config.rollout, config.loop
    if loop.mode != "streaming":
        if loop.groups_in_flight is not None:
            raise ValueError(f"loop.groups_in_flight applies to loop.mode: streaming, not {loop.mode}")
        return
    in_flight = config.streaming_groups_in_flight
    if in_flight < ro.rollout_batch_size:
        raise ValueError(
            f"loop.groups_in_flight ({in_flight}) must be at least rollout.rollout_batch_size "
            f"({ro.rollout_batch_size}): a step trains that many groups"
        )
    if config.redis.max_buffered_batches < in_flight:
        raise ValueError(
            f"loop.mode: streaming writes one buffer entry per group: redis.max_buffered_batches "
            f"({config.redis.max_buffered_batches}) must be at least loop.groups_in_flight ({in_flight}"
            f"{'' if loop.groups_in_flight else ', 2 × rollout.rollout_batch_size'})"
        )


def validate_dapo_options(config: TandemConfig) -> None:
    """Dynamic sampling needs a group baseline, contiguous prompt ranges per step, and one step's entries within the
    buffer; the overlong buffer lies inside the response budget."""
    ro = config.rollout
    if ro.dynamic_sampling.enabled:
        where = "rollout.dynamic_sampling.enabled"
        estimator = config.algorithm.estimator
        if not estimator.needs_groups:
            grouped = ", ".join(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.needs_groups)
            raise ValueError(
                f"{where} filters groups whose rewards are all equal, which carry no signal for a group "
                f"baseline; algorithm.advantage_estimator: {estimator.name}'s baseline is {estimator.baseline}, "
                f"so such groups still train (the estimators with a group baseline: {grouped})"
            )
        if ro.n_samples_per_prompt < 2:
            raise ValueError(f"{where} needs rollout.n_samples_per_prompt >= 2 (a group of one is always uniform)")
        if config.loop.mode in ("fully_async", "streaming"):
            raise ValueError(
                f"{where} needs loop.mode async or sync (in {config.loop.mode} several generations "
                "draw prompts at once, so a step's prompts would not be one range of the data cursor)"
            )
        entries = ro.dynamic_sampling.max_rounds * min(len(config.services.rollout), ro.rollout_batch_size)
        if entries > config.redis.max_buffered_batches:
            raise ValueError(
                f"rollout.dynamic_sampling.max_rounds {ro.dynamic_sampling.max_rounds} x "
                f"{len(config.services.rollout)} rollout replica(s) = {entries} buffer entries for one "
                f"step, more than redis.max_buffered_batches ({config.redis.max_buffered_batches}): "
                "raise that or lower max_rounds"
            )
    if ro.overlong_penalty.enabled and ro.overlong_penalty.buffer_tokens > ro.sampling.max_new_tokens:
        raise ValueError(
            f"rollout.overlong_penalty.buffer_tokens ({ro.overlong_penalty.buffer_tokens}) must not "
            f"exceed rollout.sampling.max_new_tokens ({ro.sampling.max_new_tokens})"
        )

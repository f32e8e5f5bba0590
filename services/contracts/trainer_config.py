"""The trainer's section of the run config: DeepSpeed's ZeRO stage, precision, optimizer, LoRA, scoring."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from services.contracts.config_base import Section

# DeepSpeed 0.19's ZeRO-3 offload_states maps every module parameter, frozen ones included, onto the flat buffer of
# the trainable ones' partitions, which does not hold the frozen ones.
LORA_ZERO3_OFFLOAD = (
    "offloading the trainer (Offload, loop.offload_train) with trainer.lora needs trainer.zero_stage "
    "1 or 2: DeepSpeed's ZeRO-3 offload_states cannot move a model with frozen parameters"
)


class LoraConfig(Section):
    """LoRA adapters (peft) on the trainer's model: only they are trained and have optimizer state; weight sync and
    the HF export send the merged weights under the base model's names (docs/algorithms.md, LoRA)."""

    rank: int = Field(ge=1, description="r: the adapters' inner dimension")
    alpha: int | None = Field(
        default=None, ge=1, description="lora_alpha; the update is scaled by alpha / rank (default 2 × rank: scale 2)"
    )
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapters' input (train mode only)")
    target_modules: tuple[str, ...] = Field(
        default=("all-linear",),
        min_length=1,
        description="names of the linear layers to adapt (the last part "
        "of a module path, e.g. q_proj, v_proj); all-linear = every linear layer but the output head (add lm_head "
        "to adapt it too)",
    )

    @property
    def lora_alpha(self) -> int:
        return self.alpha if self.alpha is not None else 2 * self.rank

    @field_validator("target_modules")
    @classmethod
    def _names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [name for name in value if not name.strip() or name != name.strip()]
        if bad:
            raise ValueError(f"names a module by an empty or padded string: {bad}")
        if len(set(value)) != len(value):
            raise ValueError(f"names a module more than once: {list(value)}")
        return value


class TrainerConfig(Section):
    device: str = "auto"
    num_ranks: int = Field(default=1, ge=1, description="data-parallel ranks `tandem run` launches")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        default=0,
        description="0: nothing partitioned, every rank holds all weights, gradients and optimizer "
        "states, and steps with Tandem's flat AdamW (one buffer per dtype, a step of a few kernels: the fastest on "
        "one GPU); 1-3: DeepSpeed ZeRO partitions optimizer states, then gradients, then weights over ranks",
    )
    precision: Literal["fp32", "bf16", "bf16_pure"] = Field(
        default="fp32",
        description="bf16: bf16 weights with fp32 master weights, gradients and Adam states (use on "
        "a GPU); bf16_pure: all in bf16 as TRL trains (less memory, small updates can round away)",
    )
    skip_nonfinite_steps: bool = Field(
        default=True,
        description="skip an optimizer step whose gradients hold "
        "inf/NaN: at ZeRO 1-3 with bf16 DeepSpeed's check_grad_overflow (one pass "
        "over the gradients); at ZeRO 0 any precision, from the clip's norm (free)",
    )
    optimizer: Literal["adamw_torch", "adamw_deepspeed"] = Field(
        default="adamw_torch",
        description="adamw_torch: torch's fused AdamW; adamw_deepspeed: DeepSpeed's own (ZeRO 1-3)",
    )
    lr: float = Field(default=1e-3, gt=0)
    min_lr: float = Field(default=0.0, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(
        default=1e-8,
        gt=0,
        description="AdamW's epsilon; far above the gradients (examples/math_chat.yaml: 1.0) the step is "
        "lr x the momentum-averaged gradient, SGD with momentum, instead of about lr per parameter",
    )
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    total_steps: int | None = Field(default=None, ge=1, description="schedule length; defaults to num_rollout")
    grad_clip: float = Field(default=1.0, gt=0)
    micro_batch_tokens: int = Field(
        default=16384,
        ge=1,
        description="token budget of one micro-batch (rows x "
        "longest row); larger is faster until activations fill the GPU",
    )
    pack_sequences: bool = Field(
        default=False,
        description="pack several samples into one row of a micro-batch "
        "(position ids restart per sample, attention stays within it): no padding tokens "
        "when lengths differ; rows stay as wide as the longest sample (docs/algorithms.md)",
    )
    scoring_chunk_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        default="auto",
        description="response tokens scored at once. auto: whole rows, as many as make "
        "a float32 [chunk x vocabulary] table of at most 1 GiB on a GPU (2^26 logits on a CPU): a few ops a chunk "
        "whatever the vocabulary. A number: that many tokens over 8,192 vocabulary columns at a time (whole rows "
        "where top-k / top-p truncate, as many as make as many logits). Either way the scoring's memory is bounded "
        "whatever the micro-batch (docs/algorithms.md)",
    )
    checkpoint_dir: str | None = Field(default=None, description="defaults to RUN_DIR/checkpoints")
    keep_last_checkpoints: int = Field(default=3, ge=1)
    export_hf_on_save: bool = True
    critic_lr: float | None = Field(default=None, gt=0, description="defaults to lr")
    seed: int = 0
    activation_checkpointing: bool = Field(
        default=False,
        description="recompute each decoder layer's activations "
        "in the backward instead of keeping them (transformers' checkpointing, "
        "non-reentrant): less memory for long sequences, ~1/3 more compute",
    )
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch's intra-op CPU threads in the trainer (null: 4 on a GPU, torch's default on the CPU)",
    )
    lora: LoraConfig | None = Field(
        default=None, description="LoRA adapters instead of full fine-tuning (null = full fine-tuning)"
    )

    @field_validator("scoring_chunk_tokens", mode="before")
    @classmethod
    def _chunk_setting(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f"expected auto or a number of tokens >= 1, got {value!r}")

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "gradient_checkpointing" in data:
            raise ValueError("gradient_checkpointing was renamed activation_checkpointing (transformers' name)")
        return data

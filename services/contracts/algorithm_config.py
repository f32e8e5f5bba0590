"""The algorithm's section of the run config: advantage estimator, losses, off-policy corrections, critic."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from services.contracts.config_base import Section

TEACHER_KEY = "algorithm.distillation.teacher_path"


class DistillationConfig(Section):
    """On-policy distillation (docs/algorithms.md): a frozen teacher scores the student's own samples token by token,
    and the student minimises the per-token reverse KL to it."""

    teacher_path: str = Field(
        min_length=1,
        description="the teacher: a Hugging Face model directory whose tokenizer is the student's (checked before "
        "the run starts); any size, any vocabulary size",
    )
    coef: float = Field(default=1.0, gt=0, description="the distillation term's weight")
    mode: Literal["reverse_kl", "kl_loss"] = Field(
        default="reverse_kl",
        description="reverse_kl: advantage -= coef x (log pi_student - log pi_teacher) per token (Thinking "
        "Machines, verl PG OPD, slime, prime-rl); kl_loss: coef x a per-token KL estimator in the loss, gradient "
        "through the student (verl GKD OPD's sampled-token estimators)",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        default="k3",
        description="mode kl_loss: k3 (verl's default) or k2, whose gradient is the reverse KL's; k1 has no "
        "gradient through the teacher's log-prob and is refused, as verl refuses it",
    )
    task_reward: bool = Field(
        default=True,
        description="false: pure distillation, the trainer takes every sample's reward as 0 (rollout.reward still "
        "scores samples for the metrics and evals); rollout.reward: none needs no reward function at all",
    )

    def check_teacher_dir(self) -> None:
        """Where the teacher is read (the launcher's preflight, the trainer): a model must be there. Not a validator:
        the config also loads on hosts that never read the teacher (the rollout, the coordinator)."""
        if not (Path(self.teacher_path) / "config.json").is_file():
            raise ValueError(f"{TEACHER_KEY}: {self.teacher_path} holds no Hugging Face model (no config.json)")

    @model_validator(mode="after")
    def _estimator_of_the_loss(self) -> DistillationConfig:
        if self.kl_estimator == "k1":
            raise ValueError(
                "algorithm.distillation.kl_estimator: k1 (log pi_student - log pi_teacher) as a loss has no "
                "gradient toward the teacher (its expected gradient is 0, as verl notes in refusing it); use k2 or "
                "k3, or mode: reverse_kl, which puts k1 into the advantage"
            )
        if self.kl_estimator != "k3" and self.mode != "kl_loss":  # by value: a resolved config lists every key
            raise ValueError(
                f"algorithm.distillation.kl_estimator applies to mode: kl_loss; mode {self.mode} puts "
                "log pi_student - log pi_teacher itself into the advantage"
            )
        return self


class AlgorithmConfig(Section):
    advantage_estimator: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"] = Field(
        default="grpo",
        description="grpo (group-normalised), rloo (leave-one-out baseline), reinforce_pp (discounted "
        "returns whitened over the batch), reinforce_pp_baseline (group mean baseline, then whitened over the batch), "
        "gae (PPO with a critic); docs/algorithms.md",
    )
    normalize_advantage_std: bool = Field(default=True, description="grpo: divide by the group's std (False = Dr.GRPO)")
    policy_loss: Literal["ppo", "gspo"] = Field(
        default="ppo",
        description="ppo: per-token ratio, clipped per token; "
        "gspo: the sequence's geometric-mean ratio, clipped per sequence",
    )
    eps_clip: float = Field(default=0.2, gt=0)
    eps_clip_high: float | None = Field(default=None, gt=0, description="asymmetric upper clip (DAPO)")
    dual_clip_c: float | None = Field(default=None, gt=1.0)
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = Field(
        default="token_mean",
        description="default token_mean; with policy_loss: gspo left unset it is "
        "seq_mean_token_mean, the GSPO paper's objective",
    )
    kl_coef: float = Field(default=0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_mode: Literal["loss", "reward"] = "loss"
    entropy_coef: float = Field(default=0.0, ge=0)
    use_rollout_logprobs: bool = Field(
        default=True,
        description="ratio denominator: rollout log-probs (True) "
        "or log-probs the trainer computes (False: the current policy before the "
        "update, or the old actor with keep_old_actor)",
    )
    use_tis: bool = Field(
        default=False,
        description="truncated importance sampling: weights pi_old / pi_rollout "
        "(capped at tis_clip) on the loss; needs use_rollout_logprobs: false",
    )
    tis_clip: float = Field(default=2.0, gt=0)
    tis_mode: Literal["truncate", "mask"] = Field(
        default="truncate",
        description="use_tis: what a weight above tis_clip becomes: truncate = tis_clip (miles' "
        "TIS); mask = 0, the token drops out of the loss (AReaL's decoupled PPO with its behaviour-weight cap)",
    )
    keep_old_actor: bool = Field(
        default=False,
        description="keep snapshots of the weights sent to the rollout "
        "engines, and score each sample under the version that generated it (the ratio's "
        "denominator); needs use_rollout_logprobs: false",
    )
    gamma: float = Field(default=1.0, ge=0, le=1, description="discount per action: gae, reinforce_pp")
    lambd: float = Field(default=1.0, ge=0, le=1, description="GAE's lambda: gae")
    whiten_advantages: bool = Field(
        default=False,
        description="gae: normalise advantages to mean 0, std 1 over "
        "the batch's trainable tokens (verl's masked_whiten)",
    )
    value_clip: float = Field(default=0.2, gt=0)
    num_critic_only_steps: int = Field(default=0, ge=0)
    distillation: DistillationConfig | None = Field(
        default=None, description="on-policy distillation from a frozen teacher: {teacher_path, coef, mode}"
    )
    overlong_filter: bool = Field(
        default=False,
        description="DAPO's overlong filtering: samples that reached "
        "max_new_tokens without stopping get loss_mask 0 in the actor's loss (they still "
        "count in their group's baseline and in the books)",
    )

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator == "gae"

    @property
    def compares_within_groups(self) -> bool:
        """The estimator's baseline is the other samples of the same prompt."""
        return self.advantage_estimator in ("grpo", "rloo", "reinforce_pp_baseline")

    @model_validator(mode="before")
    @classmethod
    def _gspo_aggregates_per_sequence(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("policy_loss") == "gspo" and "loss_aggregation" not in data:
            return {**data, "loss_aggregation": "seq_mean_token_mean"}
        return data

    @model_validator(mode="after")
    def _consistent_corrections(self) -> AlgorithmConfig:
        if self.use_rollout_logprobs and self.use_tis:
            raise ValueError(
                "use_tis: true needs use_rollout_logprobs: false (with rollout log-probs "
                "as the ratio's denominator the ratio already is the importance weight; TIS on top "
                "would apply it twice)"
            )
        if self.use_rollout_logprobs and self.keep_old_actor:
            raise ValueError(
                "keep_old_actor: true needs use_rollout_logprobs: false (the old actor "
                "computes the ratio's denominator, which use_rollout_logprobs takes from the rollout)"
            )
        if self.tis_mode != "truncate" and not self.use_tis:
            raise ValueError(f"tis_mode: {self.tis_mode} applies to TIS's weights: it needs use_tis: true")
        return self

    @model_validator(mode="after")
    def _pure_distillation_has_no_critic(self) -> AlgorithmConfig:
        if self.distillation is not None and not self.distillation.task_reward and self.uses_critic:
            raise ValueError(
                "algorithm.distillation.task_reward: false with advantage_estimator: gae: the critic would fit values "
                "of task rewards the actor does not train on; use grpo, rloo or reinforce_pp (their advantages are "
                "then 0 and the teacher is the only signal), or rollout.reward: none"
            )
        return self

    @model_validator(mode="after")
    def _keys_the_estimator_uses(self) -> AlgorithmConfig:
        """A key the chosen estimator ignores, set away from its default, is a mistake: refuse it."""
        est = self.advantage_estimator
        if self.whiten_advantages and est != "gae":
            raise ValueError(
                f"whiten_advantages applies to advantage_estimator: gae (advantage_estimator {est} "
                "normalises by itself: grpo per group, reinforce_pp and reinforce_pp_baseline over the "
                "batch, rloo not at all)"
            )
        if not self.normalize_advantage_std and est != "grpo":
            raise ValueError(
                "normalize_advantage_std: false (Dr.GRPO) applies to advantage_estimator: grpo; "
                f"advantage_estimator {est} divides by no group std"
            )
        if self.gamma != 1.0 and est not in ("gae", "reinforce_pp"):
            raise ValueError(
                f"gamma applies to advantage_estimator: gae or reinforce_pp (per-token returns); "
                f"advantage_estimator {est} gives each sample one advantage"
            )
        if self.lambd != 1.0 and est != "gae":
            raise ValueError(f"lambd is GAE's lambda: it needs advantage_estimator: gae, not {est}")
        if self.num_critic_only_steps and not self.uses_critic:
            raise ValueError(
                f"num_critic_only_steps needs a critic: advantage_estimator: gae (advantage_estimator "
                f"{est} trains none)"
            )
        return self

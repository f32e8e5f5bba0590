"""The algorithm's section of the run config: advantage estimator, losses, off-policy corrections, critic."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, field_validator, model_validator

from services.contracts.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    Aggregation,
    Estimator,
    PolicyLoss,
    advantage_estimator,
    policy_loss,
)
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


CorrectionLevel = Literal["off", "token", "sequence", "geometric"]

# Named settings equal to the peers' (docs/algorithms.md, "Rollout correction"): OpenRLHF's is_correction_type with
# its documented interval [0.5, 5.0] (openrlhf/models/loss.py PolicyLoss; README `--vllm_is_truncated_threshold 0.5
# 5.0`); TRL's vllm_importance_sampling_mode with its default cap 3.0 (trl/trainer/grpo_config.py,
# grpo_trainer.py); verl's RolloutCorrectionConfig presets (docs/algo/rollout_corr.md, "Preset Configuration Guide").
# (verl's bypass presets choose its loss, not a correction; its decoupled_token_icepop is `icepop`.)
ROLLOUT_CORRECTION_PRESETS: dict[str, dict[str, Any]] = {
    "openrlhf-tis": {"is": "token", "is_min": 0.5, "is_cap": 5.0},
    "icepop": {"is": "token", "rejection": "token", "low": 0.5, "high": 5.0},
    "seq-mask-tis": {"is": "token", "rejection": "geometric", "low": 0.5, "high": 5.0},
    "token_truncate": {"is": "token", "is_cap": 3.0},
    "token_mask": {"is": "token", "rejection": "token", "low": 0.0, "high": 3.0},
    "sequence_truncate": {"is": "sequence", "is_cap": 3.0},
    "sequence_mask": {"is": "sequence", "rejection": "sequence", "low": 0.0, "high": 3.0},
    "token_is": {"is": "token", "is_cap": 2.0},
    "seq_is": {"is": "sequence", "is_cap": 2.0},
    "seq_is_rs": {"is": "sequence", "is_cap": 2.0, "rejection": "sequence", "low": 0.5, "high": 2.0},
    "geo_rs": {"rejection": "geometric", "low": 0.999, "high": 1.001, "veto": 1e-4},
    # newer verl (verl-project/verl): rollout_rs seq_mean_k1 "0.999_1.001" keeps log 0.999 <= mean(-log r) <= log 1.001
    "decoupled_geo_rs": {"rejection": "geometric", "low": 1 / 1.001, "high": 1 / 0.999},
}


class RolloutCorrection(Section):
    """What the trainer does with each token's ratio r = pi_trainer / pi_behaviour (the trainer's log-prob minus the
    behaviour log-prob the engine reported, in the engine's log-prob space; docs/algorithms.md)."""

    model_config = ConfigDict(**Section.model_config, populate_by_name=True, serialize_by_alias=True)

    preset: Literal[tuple(ROLLOUT_CORRECTION_PRESETS)] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="a peer's setting by name (icepop, seq-mask-tis, token_truncate, geo_rs, ...): it fills the "
        "keys left unset; docs/algorithms.md lists each",
    )
    is_level: CorrectionLevel = Field(
        default="off",
        alias="is",
        description="importance weight on the loss: token r_t, sequence prod r_t, geometric exp(mean log r_t) (one "
        "weight per sequence); needs algorithm.use_rollout_logprobs: false",
    )
    is_cap: float | None = Field(default=None, gt=0, description="is: a weight above it becomes is_cap (truncated)")
    is_min: float | None = Field(default=None, ge=0, description="is: a weight below it becomes is_min (truncated)")
    rejection: CorrectionLevel = Field(
        default="off",
        description="drop from the loss the tokens (token), or whole sequences (sequence: prod r_t; geometric: "
        "exp(mean log r_t)), whose ratio lies outside [low, high]",
    )
    low: float | None = Field(default=None, ge=0, description="rejection: lower bound; unset = 1 / high (verl's)")
    high: float | None = Field(default=None, gt=0, description="rejection: upper bound (required with rejection)")
    veto: float | None = Field(
        default=None, gt=0, description="drop every sequence holding a token whose ratio is below it (verl's veto)"
    )

    @model_validator(mode="before")
    @classmethod
    def _preset_fills_unset_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") in ROLLOUT_CORRECTION_PRESETS:
            given = {("is" if k == "is_level" else k): v for k, v in data.items()}
            return {**ROLLOUT_CORRECTION_PRESETS[data["preset"]], **given}
        return data

    @model_validator(mode="after")
    def _bounds(self) -> RolloutCorrection:
        if self.is_level == "off" and (self.is_cap is not None or self.is_min is not None):
            raise ValueError("rollout_correction.is_cap / is_min bound the importance weight: they need `is` on")
        if self.is_cap is not None and self.is_min is not None and self.is_min > self.is_cap:
            raise ValueError(f"rollout_correction.is_min ({self.is_min}) must not exceed is_cap ({self.is_cap})")
        if self.rejection == "off":
            if self.low is not None or self.high is not None:
                raise ValueError("rollout_correction.low / high are rejection's bounds: they need `rejection` on")
        elif self.high is None:
            raise ValueError(f"rollout_correction.rejection: {self.rejection} needs `high` (and optionally `low`)")
        elif self.low_bound > self.high:
            raise ValueError(f"rollout_correction.low ({self.low_bound}) must not exceed high ({self.high})")
        return self

    @property
    def low_bound(self) -> float:
        """rejection's lower bound: `low`, else 1 / high (verl's default)."""
        if self.low is not None:
            return self.low
        return 0.0 if self.high is None else 1.0 / self.high

    @property
    def reweights(self) -> bool:
        return self.is_level != "off"

    @property
    def active(self) -> bool:
        """Anything changes the loss (else only the mismatch metrics are computed)."""
        return self.reweights or self.rejection != "off" or self.veto is not None

    @property
    def drops(self) -> bool:
        return self.rejection != "off" or self.veto is not None


def _legacy_tis(data: dict[str, Any]) -> dict[str, Any]:
    """`use_tis` / `tis_clip` / `tis_mode`, the keys before rollout_correction, as the block they mean: truncate =
    is at tis_clip, mask = is with rejection above tis_clip; per token, or per sequence's geometric mean under GSPO
    (as before)."""
    legacy = {k: data[k] for k in ("use_tis", "tis_clip", "tis_mode") if k in data}
    if not legacy:
        return data
    rest = {k: v for k, v in data.items() if k not in legacy}
    mode, clip = legacy.get("tis_mode", "truncate"), legacy.get("tis_clip", 2.0)
    if mode not in ("truncate", "mask"):
        raise ValueError(f"algorithm.tis_mode: {mode!r} is not one of truncate, mask")
    if not TypeAdapter(bool).validate_python(legacy.get("use_tis", False)):
        if mode != "truncate":
            raise ValueError(f"tis_mode: {mode} applies to TIS's weights: it needs use_tis: true")
        return rest
    if "rollout_correction" in data:
        raise ValueError(
            "algorithm.use_tis is the older spelling of algorithm.rollout_correction: set one of them, not both"
        )
    level = "geometric" if data.get("policy_loss") == "gspo" else "token"
    block = {"is": level, "rejection": level, "low": 0.0, "high": clip} if mode == "mask" else {"is": level}
    if mode == "truncate":
        block["is_cap"] = clip
    return {**rest, "rollout_correction": block}


class AlgorithmConfig(Section):
    advantage_estimator: str = Field(
        default="grpo",
        description="; ".join(f"{e.name}: {e.summary}" for e in ADVANTAGE_ESTIMATORS.values())
        + " (services/contracts/algorithms.py; docs/algorithms.md)",
    )
    normalize_advantage_std: bool = Field(default=True, description="grpo: divide by the group's std (False = Dr.GRPO)")
    policy_loss: str = Field(
        default="ppo", description="; ".join(f"{p.name}: {p.summary}" for p in POLICY_LOSSES.values())
    )
    eps_clip: float = Field(default=0.2, gt=0)
    eps_clip_high: float | None = Field(default=None, gt=0, description="asymmetric upper clip (DAPO)")
    dual_clip_c: float | None = Field(default=None, gt=1.0)
    loss_aggregation: Aggregation = Field(
        default="token_mean",
        description="left unset it is the policy loss's own default: token_mean for ppo, seq_mean_token_mean (the "
        "GSPO paper's objective) for gspo",
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
    rollout_correction: RolloutCorrection = Field(
        default=RolloutCorrection(),
        description="importance weights and rejection on the trainer/behaviour ratio (docs/algorithms.md); the "
        "older use_tis / tis_clip / tis_mode map onto it",
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

    @field_validator("advantage_estimator")
    @classmethod
    def _known_estimator(cls, name: str) -> str:
        return advantage_estimator(name).name

    @field_validator("policy_loss")
    @classmethod
    def _known_policy_loss(cls, name: str) -> str:
        return policy_loss(name).name

    @property
    def estimator(self) -> Estimator:
        return ADVANTAGE_ESTIMATORS[self.advantage_estimator]

    @property
    def loss(self) -> PolicyLoss:
        return POLICY_LOSSES[self.policy_loss]

    @property
    def uses_critic(self) -> bool:
        return self.estimator.uses_critic

    @property
    def compares_within_groups(self) -> bool:
        """The estimator's baseline is the other samples of the same prompt."""
        return self.estimator.needs_groups

    @model_validator(mode="before")
    @classmethod
    def _gspo_aggregates_per_sequence(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = _legacy_tis(data)
        loss = POLICY_LOSSES.get(str(data.get("policy_loss", "ppo")))  # an unknown name is refused by its field
        if loss is not None and "loss_aggregation" not in data:
            return {**data, "loss_aggregation": loss.default_aggregation}
        return data

    @model_validator(mode="after")
    def _consistent_corrections(self) -> AlgorithmConfig:
        if self.use_rollout_logprobs and self.rollout_correction.reweights:
            raise ValueError(
                f"rollout_correction.is: {self.rollout_correction.is_level} (or use_tis: true) needs "
                "use_rollout_logprobs: false (with rollout log-probs as the ratio's denominator the ratio already "
                "is the importance weight; a weight on top would apply it twice)"
            )
        if self.use_rollout_logprobs and self.keep_old_actor:
            raise ValueError(
                "keep_old_actor: true needs use_rollout_logprobs: false (the old actor "
                "computes the ratio's denominator, which use_rollout_logprobs takes from the rollout)"
            )
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
        """A key the chosen estimator ignores, set away from its default, is a mistake: refuse it. Which estimator
        uses which key is a fact of its entry in the algorithm table."""
        est, facts = self.advantage_estimator, self.estimator
        if self.whiten_advantages and not facts.uses_critic:
            normalised = facts.whitens_by_itself or facts.divides_by_group_std
            raise ValueError(
                f"whiten_advantages applies to advantage_estimator: {_with('uses_critic')} (advantage_estimator "
                f"{est} {'normalises by itself' if normalised else 'is not normalised'}: {facts.summary})"
            )
        if not self.normalize_advantage_std and not facts.divides_by_group_std:
            raise ValueError(
                f"normalize_advantage_std: false (Dr.GRPO) applies to advantage_estimator: "
                f"{_with('divides_by_group_std')}; advantage_estimator {est} divides by no group std"
            )
        if self.gamma != 1.0 and not facts.per_token_returns:
            raise ValueError(
                f"gamma applies to advantage_estimator: {_with('per_token_returns')} (per-token returns); "
                f"advantage_estimator {est} gives each sample one advantage"
            )
        if self.lambd != 1.0 and not facts.uses_critic:
            raise ValueError(f"lambd is GAE's lambda: it needs advantage_estimator: {_with('uses_critic')}, not {est}")
        if self.num_critic_only_steps and not facts.uses_critic:
            raise ValueError(
                f"num_critic_only_steps needs a critic: advantage_estimator: {_with('uses_critic')} "
                f"(advantage_estimator {est} trains none)"
            )
        if self.loss_aggregation not in self.loss.aggregations:
            raise ValueError(
                f"loss_aggregation {self.loss_aggregation} is not one policy_loss {self.policy_loss} supports "
                f"({', '.join(self.loss.aggregations)})"
            )
        return self


def _with(fact: str) -> str:
    """The estimators whose entry has `fact`, as a message names them: "gae or reinforce_pp"."""
    return " or ".join(name for name, e in ADVANTAGE_ESTIMATORS.items() if getattr(e, fact))

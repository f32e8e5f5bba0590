"""The algorithm table: every advantage estimator and policy loss the config may name, with the facts the config's
validation and the trainer read from it (docs/algorithms.md). The trainer's table of functions
(services/trainer/algo/estimators.py) has exactly these names; a name in neither is refused with the known ones."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
AGGREGATIONS: tuple[Aggregation, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


@dataclass(frozen=True)
class Estimator:
    name: str
    summary: str
    baseline: str  # what the advantage is measured against, as a message says it
    uses_critic: bool = False  # a value model is trained beside the policy (its values are the baseline)
    needs_groups: bool = False  # the baseline is the other samples of the prompt: groups of >= 2, dynamic sampling
    per_token_returns: bool = False  # discounted returns per token: `gamma` applies, the KL reward is per token
    divides_by_group_std: bool = False  # `normalize_advantage_std` applies (False = Dr.GRPO)
    whitens_by_itself: bool = False  # normalises over the batch on its own (`whiten_advantages` is gae's option)


@dataclass(frozen=True)
class PolicyLoss:
    name: str
    summary: str
    ratio: Literal["token", "sequence"]  # what one clipped ratio covers
    default_aggregation: Aggregation  # loss_aggregation when the config leaves it unset
    aggregations: tuple[Aggregation, ...] = AGGREGATIONS  # the loss_aggregation values it supports


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    e.name: e
    for e in (
        Estimator(
            "grpo",
            "group-normalised: (r - group mean) / group std",
            "the other samples of the prompt",
            needs_groups=True,
            divides_by_group_std=True,
        ),
        Estimator("rloo", "leave-one-out baseline", "the other samples of the prompt", needs_groups=True),
        Estimator("gae", "PPO with a critic", "the critic's values", uses_critic=True, per_token_returns=True),
        Estimator(
            "reinforce_pp",
            "discounted returns whitened over the batch",
            "the whole batch",
            per_token_returns=True,
            whitens_by_itself=True,
        ),
        Estimator(
            "reinforce_pp_baseline",
            "group mean baseline, then whitened over the batch",
            "the other samples of the prompt",
            needs_groups=True,
            whitens_by_itself=True,
        ),
    )
}

POLICY_LOSSES: dict[str, PolicyLoss] = {
    p.name: p
    for p in (
        PolicyLoss("ppo", "per-token ratio, clipped per token", ratio="token", default_aggregation="token_mean"),
        PolicyLoss(
            "gspo",
            "the sequence's geometric-mean ratio, clipped per sequence (the GSPO paper's objective by default)",
            ratio="sequence",
            default_aggregation="seq_mean_token_mean",
        ),
    )
}


def _known(kind: str, table: Mapping[str, object], name: str) -> None:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r} (known: {', '.join(table)})")


def advantage_estimator(name: str) -> Estimator:
    _known("advantage_estimator", ADVANTAGE_ESTIMATORS, name)
    return ADVANTAGE_ESTIMATORS[name]


def policy_loss(name: str) -> PolicyLoss:
    _known("policy_loss", POLICY_LOSSES, name)
    return POLICY_LOSSES[name]

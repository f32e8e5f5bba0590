"""Which samples of a Train's entries the step trains on (rank 0, before the batch is relayed to the ranks).

In order: samples older than `max_staleness` are dropped (fully_async); with `rollout.dynamic_sampling` the actor
drops the groups whose rewards are all equal and keeps the first `rollout_batch_size` informative groups in the
order the entries were named (verl and slime trim to exactly that many too); with `algorithm.overlong_filter` the
actor's samples that hit max_new_tokens without stopping get loss_mask 0, but stay in the batch: their rewards
still count in their group's baseline. Every sample of the entries ends up trained, dropped as stale or filtered,
and the reply says how many of each (the coordinator's books add them up).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.contracts.config import TandemConfig
from services.contracts.dapo import selected_samples
from services.trainer.batching import TrainBatch, stale_samples, token_lag_fractions


@dataclass(frozen=True)
class Selection:
    batch: TrainBatch  # what the step trains on (may hold no samples: then no step)
    dropped_stale: int
    filtered: int  # samples of uniform or surplus groups; all, when nothing trainable was left
    metrics: dict[str, float] = field(default_factory=dict)


def select_samples(
    batch: TrainBatch,
    *,
    truncated: np.ndarray,
    config: TandemConfig,
    role: str,
    weight_version: int,
    max_staleness: int,
) -> Selection:
    """`truncated[i]`: sample i of `batch` stopped at max_new_tokens (finish reason length)."""
    if role == "critic":  # the critic values every sample, so its hand-off lines up with the actor's whole batch
        max_staleness = -1
    stale = set(stale_samples(batch, weight_version=weight_version, max_staleness=max_staleness))
    keep = [i for i in range(batch.num_samples) if i not in stale]
    metrics: dict[str, float] = {}
    filtered = 0
    dynamic = config.rollout.dynamic_sampling
    if role == "actor" and dynamic.enabled:
        chosen, uniform, surplus = selected_samples(
            batch.rewards[keep].numpy(),
            batch.group_ids[keep].numpy(),
            min_std=dynamic.min_std,
            max_groups=config.rollout.rollout_batch_size,
        )
        filtered = len(keep) - len(chosen)
        keep = [keep[i] for i in chosen]
        metrics.update(groups_uniform=float(uniform), groups_surplus=float(surplus))
    masked = [i for i in keep if truncated[i]] if role == "actor" and config.algorithm.overlong_filter else []
    if masked:
        batch = batch.mask_samples(masked)
        metrics["overlong_masked"] = float(len(masked))
    if len(keep) < batch.num_samples:
        batch = batch.select(keep)
    if masked and float(batch.loss_mask.sum()) <= 0:  # every sample left was cut off: nothing to learn from
        filtered += batch.num_samples
        batch = batch.select([])
    metrics["samples_filtered"] = float(filtered)
    metrics.update(token_lag_fractions(batch, weight_version=weight_version))
    return Selection(batch=batch, dropped_stale=len(stale), filtered=filtered, metrics=metrics)


def truncated_samples(finish_reasons: list[tuple[str, ...]]) -> np.ndarray:
    """Per sample of the merged entries (in order): did it stop at max_new_tokens?"""
    return np.asarray([r == "length" for reasons in finish_reasons for r in reasons], dtype=bool)

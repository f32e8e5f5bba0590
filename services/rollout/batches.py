"""A Generate's scored samples as the rollout batch the trainer reads, and the answer the caller gets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.contracts.config import OverlongPenaltyConfig
from services.contracts.dapo import informative_groups
from services.contracts.rollout_calls import GenerateResult
from services.contracts.wire import RolloutBatchData, build_batch
from services.rollout.metrics import batch_metrics, shaped_rewards
from services.rollout.samples import SampleRequest, Scored
from services.tensors.devices import cuda_peak_metrics


@dataclass(frozen=True)
class ShapedBatch:
    batch: RolloutBatchData
    rewards: list[float]  # the scored rewards after overlong shaping, as the batch holds them
    shaping: dict[str, float]  # what the shaping did, as metrics


def rollout_batch(
    scored: Scored,
    request: SampleRequest,
    *,
    metadata: Mapping[str, str],
    producer: str,
    logprob_space: str,
    overlong_penalty: OverlongPenaltyConfig,
) -> ShapedBatch:
    outputs, prompts, n = scored.outputs, request.prompts, request.n
    rewards, shaping = shaped_rewards(
        outputs, scored.rewards, overlong_penalty, max_new_tokens=request.sampling.max_new_tokens
    )
    batch = build_batch(
        rollout_id=request.rollout_id,
        policy_version=min(o.weight_version for o in outputs),
        prompts=scored.prompt_ids,
        responses=[list(o.token_ids) for o in outputs],
        log_probs=[list(o.log_probs) for o in outputs],
        rewards=rewards,
        group_ids=scored.group_ids or [p.group_id for p in prompts for _ in range(n)],
        finish_reasons=[o.finish_reason for o in outputs],
        sampling=request.sampling,
        sample_versions=[o.weight_version for o in outputs],
        loss_masks=scored.loss_masks,
        token_versions=[list(o.versions) for o in outputs],
        labels=scored.labels or [p.label for p in prompts for _ in range(n)],
        metadata=dict(metadata),
        producer=producer,
        logprob_space=logprob_space,
    )
    return ShapedBatch(batch=batch, rewards=rewards, shaping=shaping)


def generate_result(
    shaped: ShapedBatch,
    scored: Scored,
    *,
    entry_id: str,
    put_s: float,
    n: int,
    num_groups: int,
    min_std: float,
    producer: str,
) -> GenerateResult:
    batch = shaped.batch
    return GenerateResult(
        entry_id=entry_id,
        num_samples=batch.num_samples,
        num_prompt_tokens=int(batch.prompt_lengths.sum()),
        num_response_tokens=batch.num_response_tokens,
        weight_version=batch.policy_version,
        generate_time_s=scored.generate_s,
        reward_time_s=scored.reward_s,
        put_time_s=put_s,
        metrics={
            **batch_metrics(
                scored.outputs, shaped.rewards, n=n, generate_s=scored.generate_s, group_ids=scored.group_ids
            ),
            **shaped.shaping,
            **scored.metrics,
            **cuda_peak_metrics(),
        },
        producer=producer,
        num_groups=num_groups,
        informative_groups=len(informative_groups(batch.rewards, batch.group_ids, min_std=min_std)),
    )

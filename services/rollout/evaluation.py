"""A rollout replica's Evaluate: greedy (or n-sample) generation over an eval set, scored and summed up as metrics
under `<name>/`; nothing is written to the buffer."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.contracts.rollout_calls import EvaluateResult, PromptInput
from services.contracts.sampling_spec import SamplingSpec
from services.rollout.metrics import eval_metrics
from services.rollout.prompts import check_request_size, validated_inputs
from services.rollout.samples import SampleRequest
from services.telemetry import tracing

if TYPE_CHECKING:
    from services.rollout.builder import RolloutParts


def evaluate(
    parts: RolloutParts,
    *,
    name: str,
    prompts: Sequence[PromptInput],
    n_samples_per_prompt: int | None,
    sampling: SamplingSpec | None,
    reward: str | None,
    pass_threshold: float,
) -> EvaluateResult:
    """A sample passes when its reward reaches `pass_threshold`; pass@k uses the unbiased estimator over n
    samples."""
    ro = parts.config.rollout
    if not prompts:
        raise ValueError(f"Evaluate({name!r}): no prompts given")
    check_request_size(
        f"Evaluate({name!r})",
        len(prompts),
        n_samples_per_prompt,
        ro.eval_n_samples_per_prompt,
        limit=ro.max_request_samples,
    )
    start = time.monotonic()
    name = name or "eval"
    n = n_samples_per_prompt or ro.eval_n_samples_per_prompt
    if n < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n}")
    sampling = sampling or SamplingSpec.from_config(ro.eval_sampling)
    scorer = parts.source.reward_for(reward or ro.eval_reward)  # rollout.eval_reward: a rule-checked eval, say
    inputs = validated_inputs(parts.texts, parts.engine, prompts)
    with tracing.span(
        "rl.eval.generate",
        eval_name=name,
        weight_version=parts.engine.weight_version,
        prompts=len(prompts),
        replica=parts.replica,
    ) as sp:
        scored = parts.source.sample(
            SampleRequest(prompts=prompts, inputs=inputs, n=n, sampling=sampling, reward=scorer, rollout_id=-1, span=sp)
        )
    metrics = eval_metrics(scored.outputs, scored.rewards, n=n, prefix=name, pass_threshold=pass_threshold)
    metrics.update({f"{name}/{key}": value for key, value in scored.metrics.items()})
    return EvaluateResult(
        metrics=metrics, weight_version=scored.outputs[0].weight_version, time_s=time.monotonic() - start
    )

"""DAPO dynamic sampling, the coordinator's part: generation rounds until a step has enough informative groups.

The rollout counts the informative groups of each batch it writes (GenerateResponse.informative_groups, one rule in
services/contracts/dapo.py); this module only adds counts up and draws more prompts, so the coordinator still
never touches a tensor. Each further round draws the next rollout_batch_size prompts from the data cursor, until
the informative groups reach the target or `max_rounds` rounds ran (then the step trains on what there is, and
says so: a warning and rollout/groups_short). Every round's entries go to one Train, where the trainer drops the
uniform groups and the surplus beyond the target (services/trainer/algo/selection.py) and acknowledges all of them.

The rounds run inside the step's generation (on the generation thread), so they overlap training like any
generation, all with the same weights, and one step's prompts are one contiguous range of the data cursor: a
checkpoint records the range's two ends, and a resume reuses the entries or generates the range again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from services.coordinator.data import PromptBatch
from services.coordinator.seams import Clock, GenerationResult

log = logging.getLogger(__name__)


def informative(gen: GenerationResult) -> int:
    return sum(r.informative_groups for r in gen.responses)


def groups(gen: GenerationResult) -> int:
    return sum(r.num_groups for r in gen.responses)


def run_rounds(
    *,
    rollout_id: int,
    first: PromptBatch,
    generate: Callable[[PromptBatch], GenerationResult],
    next_batch: Callable[[], PromptBatch],
    target_groups: int,
    max_rounds: int,
    clock: Clock,
) -> GenerationResult:
    """`generate(first)`, then `generate(next_batch())` while fewer than `target_groups` informative groups came
    out and fewer than `max_rounds` rounds ran; one result naming every round's entries."""
    start = clock.monotonic()
    rounds = [generate(first)]
    first_s = clock.monotonic() - start
    while sum(informative(r) for r in rounds) < target_groups and len(rounds) < max_rounds:
        rounds.append(generate(next_batch()))
    found, total = sum(informative(r) for r in rounds), sum(groups(r) for r in rounds)
    short = max(0, target_groups - found)
    if short:
        log.warning(
            "rollout %d: %d of %d groups informative after %d rounds (rollout.dynamic_sampling.max_rounds); "
            "training on %d groups",
            rollout_id,
            found,
            total,
            len(rounds),
            found,
        )
    seconds = clock.monotonic() - start
    metrics = {
        "rollout/dynamic_rounds": float(len(rounds)),
        "rollout/informative_groups": float(found),
        "rollout/filtered_group_frac": (total - found) / total if total else 0.0,
        "rollout/surplus_groups": float(max(0, found - target_groups)),
        "rollout/groups_short": float(short),
        "rollout/extra_samples": float(sum(x.num_samples for r in rounds[1:] for x in r.responses)),
        "perf/extra_generate_time_s": seconds - first_s,
    }
    return replace(
        rounds[-1],
        entry_ids=tuple(e for r in rounds for e in r.entry_ids),
        responses=tuple(x for r in rounds for x in r.responses),
        seconds=seconds,
        epoch_end=any(r.epoch_end for r in rounds),
        sampling_metrics=metrics,
    )

"""DAPO's sample selection and length shaping (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv:2503.14476), one definition each, torch-free: the rollout counts informative groups and
shapes rewards before it writes a batch, the trainer drops the uniform groups with the same rule.

- A group (the samples of one prompt) is **informative** when the population std of its rewards exceeds
  `min_std`. A group baseline (GRPO) gives every sample of a uniform group advantage 0, so it carries no signal.
  Both sides compute it in float64 over the batch's float32 rewards, so they agree. A threshold, not `std > 0`:
  seven rewards of 0.7 have a std of 6e-8 in float32 and 1e-16 from Python floats (verl, which tests `std > 0`,
  keeps such a group; slime drops it below 1e-6, as here). A group of one is uniform (its std is 0).
- The **soft overlong penalty** (the paper's eq. 13) adds, to a response of length L under a budget of
  `max_new_tokens` with a buffer of `buffer` tokens, `-factor * (L - (max_new_tokens - buffer)) / buffer` once L
  passes `max_new_tokens - buffer`, so -factor at the budget. A response never exceeds the budget here (generation
  stops there), so the paper's "past L_max" case is the budget itself; the value is clamped at -factor, as the
  paper's -1 (verl's formula would keep falling linearly past it, which it too never reaches).
"""

from __future__ import annotations

import numpy as np


def group_order(group_ids: np.ndarray) -> list[int]:
    """The distinct group ids in the order they first appear."""
    return list(dict.fromkeys(int(g) for g in np.asarray(group_ids).tolist()))


def informative_groups(rewards: np.ndarray, group_ids: np.ndarray, *, min_std: float) -> list[int]:
    """The ids of the groups whose rewards' population std exceeds `min_std`, in order of first appearance."""
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(group_ids)
    if r.shape != g.shape:
        raise ValueError(f"{r.shape[0]} rewards for {g.shape[0]} group ids")
    return [gid for gid in group_order(g) if float(r[g == gid].std()) > min_std]


def selected_samples(
    rewards: np.ndarray, group_ids: np.ndarray, *, min_std: float, max_groups: int | None
) -> tuple[list[int], int, int]:
    """(indices of the samples to train, in their order; uniform groups dropped; informative groups dropped beyond
    the first `max_groups`). The two counts say why the others went."""
    informative = informative_groups(rewards, group_ids, min_std=min_std)
    kept = informative if max_groups is None else informative[:max_groups]
    keep = set(kept)
    g = np.asarray(group_ids).tolist()
    uniform = len(group_order(np.asarray(group_ids))) - len(informative)
    return [i for i, gid in enumerate(g) if int(gid) in keep], uniform, len(informative) - len(kept)


def overlong_penalty(response_lengths: np.ndarray, *, max_new_tokens: int, buffer: int, factor: float) -> np.ndarray:
    """The soft overlong penalty of each response (0 or negative, float64)."""
    if not 1 <= buffer <= max_new_tokens:
        raise ValueError(f"overlong buffer {buffer} must lie in [1, max_new_tokens {max_new_tokens}]")
    lengths = np.asarray(response_lengths, dtype=np.float64)
    exceed = lengths - (max_new_tokens - buffer)
    return np.clip(-exceed / buffer * factor, -factor, 0.0)

"""Independent reference formulas for the RL math, written straight from their published definitions with
plain Python loops over a few tokens, never by calling Tandem's own functions.

Sources: Hugging Face's TopK/TopP logits warpers (the sampling distribution), verl's
`compute_gae_advantage_return` (GAE skipping masked tokens), `masked_whiten`, `compute_policy_loss`
(clip, asymmetric clip, dual clip) and `kl_penalty` (k1 / "mse" k2 / low_var_kl k3 without its clamp),
miles' truncated importance sampling (exp(old - rollout) capped), AReaL's decoupled PPO (the behaviour weight
exp(prox - behav), masked above its cap), and GRPO's group normalisation.
Added for the estimators of issue 25: RLOO as Ahmadian et al. 2024 and TRL's RLOOTrainer define it, REINFORCE++'s
discounted returns (Hu et al. 2025; slime/miles' get_reinforce_plus_plus_returns, OpenRLHF's cumulative returns,
verl's compute_reinforce_plus_plus_outcome_advantage, each peer's treatment of masked tokens selectable),
OpenRLHF's biased whitening, and GSPO's sequence-level objective (Zheng et al. 2025, eq. 5-7; TRL's
importance_sampling_level="sequence"), written in its sequence form: one ratio per sequence, its gradient through
s = (pi / pi_old)^(1 / |y|) by the chain rule.
"""

from __future__ import annotations

import math

NEG_INF = float("-inf")


def log_softmax(xs: list[float]) -> list[float]:
    finite = [x for x in xs if x != NEG_INF]
    top = max(finite)
    log_z = top + math.log(sum(math.exp(x - top) for x in finite))
    return [x - log_z if x != NEG_INF else NEG_INF for x in xs]


def sampling_log_probs(logits: list[float], *, temperature: float, top_p: float, top_k: int) -> list[float]:
    """One row: logits / T, keep the top k, then the smallest most-likely set reaching top_p (and every logit tied
    with its last), renormalise.
    Greedy (T = 0) reports the untruncated temperature-1 log-probs."""
    if temperature == 0:
        return log_softmax(logits)
    x = [v / temperature for v in logits]
    if 0 < top_k < len(x):
        kth = sorted(x, reverse=True)[top_k - 1]
        x = [v if v >= kth else NEG_INF for v in x]
    if top_p < 1.0:
        probs = [math.exp(v) if v != NEG_INF else 0.0 for v in log_softmax(x)]
        order = sorted(range(len(x)), key=lambda i: -probs[i])
        mass, keep = 0.0, set[int]()
        for i in order:
            if keep and mass >= top_p:
                break
            keep.add(i)
            mass += probs[i]
        edge = min(x[i] for i in keep)  # ties with the last kept logit are kept too, as top-k keeps the k-th's
        x = [v if v >= edge else NEG_INF for v in x]
    return log_softmax(x)


def entropy(log_probs: list[float]) -> float:
    return -sum(math.exp(lp) * lp for lp in log_probs if lp != NEG_INF)


def kl(log_prob: float, ref_log_prob: float, estimator: str) -> float:
    log_ratio = log_prob - ref_log_prob
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return math.exp(-log_ratio) - 1 + log_ratio  # k3: ref/pi - 1 - log(ref/pi)


def ppo_loss(
    *,
    log_prob: float,
    old_log_prob: float,
    advantage: float,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None,
) -> tuple[float, float, float]:
    """(loss, ratio, clipped 0/1) of one token, verl's compute_policy_loss."""
    ratio = math.exp(log_prob - old_log_prob)
    loss1 = -advantage * ratio
    loss2 = -advantage * min(max(ratio, 1 - eps_low), 1 + eps_high)
    loss = max(loss1, loss2)
    clipped = float(loss2 > loss1)
    if dual_clip_c is not None and advantage < 0 and -advantage * dual_clip_c < loss:
        loss, clipped = -advantage * dual_clip_c, 1.0
    return loss, ratio, clipped


def tis_weight(*, old_log_prob: float, rollout_log_prob: float, clip: float) -> float:
    return min(math.exp(old_log_prob - rollout_log_prob), clip)


def decoupled_ppo_loss(
    *,
    log_prob: float,
    prox_log_prob: float,
    behav_log_prob: float,
    advantage: float,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None,
    cap: float,
) -> float:
    """AReaL's decoupled PPO (Fu et al. 2025, "AReaL", arXiv 2505.24298; areal's ppo_actor_loss_fn): the
    clipped surrogate against the proximal policy, times the behaviour weight exp(prox - behav), which is 0 where it
    exceeds the cap (the token is masked out)."""
    loss, _, _ = ppo_loss(
        log_prob=log_prob,
        old_log_prob=prox_log_prob,
        advantage=advantage,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip_c=dual_clip_c,
    )
    weight = math.exp(prox_log_prob - behav_log_prob)
    return loss * weight if weight <= cap else 0.0


def grpo_advantages(rewards: list[float], groups: list[int], *, normalize_std: bool, eps: float = 1e-6) -> list[float]:
    out = []
    for r, g in zip(rewards, groups, strict=True):
        members = [x for x, h in zip(rewards, groups, strict=True) if h == g]
        mean = sum(members) / len(members)
        a = r - mean
        if normalize_std:
            var = sum((x - mean) ** 2 for x in members) / max(len(members) - 1, 1)
            a = a / (math.sqrt(var) + eps)
        out.append(a)
    return out


def gae_sequence(
    *, reward: float, values: list[float], mask: list[int], kl_penalty: list[float] | None, gamma: float, lambd: float
) -> tuple[list[float], list[float]]:
    """One sample: the reward on its last trainable token, -kl_penalty on trainable tokens; verl's loop where
    a masked token carries nextvalues / lastgaelam through unchanged. Returns (advantages (0 where masked),
    returns = advantages + values)."""
    n = len(values)
    token_rewards = [0.0] * n
    trainable = [t for t in range(n) if mask[t]]
    if trainable:
        token_rewards[trainable[-1]] += reward
    if kl_penalty is not None:
        for t in trainable:
            token_rewards[t] -= kl_penalty[t]
    next_value, last_gae, adv = 0.0, 0.0, [0.0] * n
    for t in reversed(range(n)):
        delta = token_rewards[t] + gamma * next_value - values[t]
        candidate = delta + gamma * lambd * last_gae
        if mask[t]:
            next_value, last_gae = values[t], candidate
            adv[t] = candidate
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


def whiten(values: list[float], mask: list[int], eps: float = 1e-8) -> list[float]:
    picked = [v for v, m in zip(values, mask, strict=True) if m]
    mean = sum(picked) / len(picked)
    var = sum((v - mean) ** 2 for v in picked) / (len(picked) - 1)
    return [(v - mean) / math.sqrt(var + eps) if m else 0.0 for v, m in zip(values, mask, strict=True)]


def rloo_advantages(rewards: list[float], groups: list[int], *, lone: str = "zero") -> list[float]:
    """r_i minus the mean of the other rewards of its group. A group of one: `lone` "zero" (TRL, slime, verl's
    vectorised RLOO) or "raw" (verl's compute_rloo_outcome_advantage keeps the reward)."""
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups, strict=True)):
        others = [x for j, (x, h) in enumerate(zip(rewards, groups, strict=True)) if h == g and j != i]
        out.append(r - sum(others) / len(others) if others else (0.0 if lone == "zero" else r))
    return out


def reinforce_pp_returns(
    *, reward: float, mask: list[int], kl_penalty: list[float] | None, gamma: float, masked: str = "skip"
) -> list[float]:
    """One sample's REINFORCE++ returns G_t = r_t + gamma G_{t+1}; the reward on the last trainable token, minus
    kl_penalty on trainable tokens. How a masked (observation) token is treated:
    - "skip" (Tandem): it is no step: G passes through it undiscounted and its own entry is 0;
    - "through" (slime, miles, OpenRLHF): every position is a step and discounts, masked ones included;
    - "reset" (verl): the running return is zeroed after each masked token, so earlier tokens see nothing after it.
    """
    n = len(mask)
    token_rewards = [0.0] * n
    trainable = [t for t in range(n) if mask[t]]
    if trainable:
        token_rewards[trainable[-1]] += reward
    if kl_penalty is not None:
        for t in trainable:
            token_rewards[t] -= kl_penalty[t]
    running, out = 0.0, [0.0] * n
    for t in reversed(range(n)):
        if masked == "skip" and not mask[t]:
            continue
        running = token_rewards[t] + gamma * running
        out[t] = running
        if masked == "reset" and not mask[t]:
            running = 0.0
    return out


def whiten_biased(values: list[float], mask: list[int], eps: float = 1e-8) -> list[float]:
    """OpenRLHF's advantage normalisation: the variance divides by n, not n - 1."""
    picked = [v for v, m in zip(values, mask, strict=True) if m]
    mean = sum(picked) / len(picked)
    var = sum((v - mean) ** 2 for v in picked) / len(picked)
    return [(v - mean) / math.sqrt(max(var, eps)) if m else 0.0 for v, m in zip(values, mask, strict=True)]


def gspo_sequence(
    *,
    log_probs: list[float],
    old_log_probs: list[float],
    advantage: float,
    mask: list[int],
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None,
    max_log_ratio: float = 20.0,
) -> tuple[float, float, float, list[float]]:
    """One sequence's GSPO objective L = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)) with
    s = exp(mean over trainable tokens of log pi - log pi_old) (log s capped at +-max_log_ratio, past which nothing
    moves it), bounded by -A c for A < 0 with dual clip (slime's compute_policy_loss applies it to GSPO too).
    Returns (L, s, clipped 0/1, dL / d log pi_t per token: dL/ds * s / |y| on trainable tokens, else 0)."""
    trainable = [t for t in range(len(mask)) if mask[t]]
    log_s = sum(log_probs[t] - old_log_probs[t] for t in trainable) / max(len(trainable), 1)
    capped = abs(log_s) > max_log_ratio
    s = math.exp(max(-max_log_ratio, min(max_log_ratio, log_s)))
    unclipped, clipped_loss = -advantage * s, -advantage * min(max(s, 1 - eps_low), 1 + eps_high)
    loss, clipped = max(unclipped, clipped_loss), float(clipped_loss > unclipped)
    d_loss_d_s = 0.0 if clipped or capped else -advantage
    if dual_clip_c is not None and advantage < 0 and -advantage * dual_clip_c < loss:
        loss, clipped, d_loss_d_s = -advantage * dual_clip_c, 1.0, 0.0
    grads = [d_loss_d_s * s / len(trainable) if mask[t] else 0.0 for t in range(len(mask))]
    return loss, s, clipped, grads


def tis_sequence_weight(
    *, old_log_probs: list[float], rollout_log_probs: list[float], mask: list[int], clip: float
) -> float:
    """GSPO's TIS: the geometric mean of pi_old / pi_rollout over the sequence's trainable tokens, capped."""
    trainable = [t for t in range(len(mask)) if mask[t]]
    return min(math.exp(sum(old_log_probs[t] - rollout_log_probs[t] for t in trainable) / len(trainable)), clip)

"""algorithm.rollout_correction against each peer's own formula, on the same random inputs, to 1e-6.

The references below are written from the peers' code, in their padded [B, T] layout with a response mask, so that
nothing of ours is reused: our side runs on the flat per-token layout the trainer uses. Sources:
- verl: volcengine/verl `verl/trainer/ppo/rollout_corr_helper.py` (compute_rollout_correction_weights,
  compute_rollout_rejection_mask, the veto of compute_rollout_correction_and_rejection_mask,
  compute_offpolicy_metrics) and `docs/algo/rollout_corr.md` (the presets token_is, seq_is, seq_is_rs, geo_rs);
  newer verl: verl-project/verl, the same helper's seq_mean_k1 rejection and `verl/trainer/config/algorithm.py`'s
  decoupled_geo_rs.
- OpenRLHF: OpenRLHF/OpenRLHF `openrlhf/models/loss.py` (PolicyLoss.forward, vllm_is_correction_type tis / icepop /
  seq-mask-tis) with the README's interval `--vllm_is_truncated_threshold 0.5 5.0`.
- TRL: huggingface/trl `trl/trainer/grpo_trainer.py` (_generate_and_score_completions, vllm_importance_sampling_mode)
  with `trl/trainer/grpo_config.py`'s default vllm_importance_sampling_cap 3.0.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.contracts.algorithm_config import ROLLOUT_CORRECTION_PRESETS, AlgorithmConfig, RolloutCorrection
from services.trainer.algo.rollout_correction import TokenSequences, correct, mismatch_metrics

SAFETY_BOUND = 20.0  # verl's


def masked_sum(x: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if axis is None else (x * mask).sum(dim=axis)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    return masked_sum(x, mask, axis) / (mask.sum() if axis is None else mask.sum(dim=axis))


# --- verl (volcengine/verl, verl/trainer/ppo/rollout_corr_helper.py) ---------------------------------------------


def verl_weights_and_mask(
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_is: str | None,
    rollout_is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | None = None,
    rollout_rs_threshold_lower: float | None = None,
    rollout_token_veto_threshold: float | None = None,
) -> torch.Tensor:
    """rollout_is_weights (1 without IS) times modified_response_mask, as verl's loss uses them."""
    log_ratio = old - rollout
    weights = torch.ones_like(log_ratio)
    if rollout_is == "token":
        weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    elif rollout_is == "sequence":
        s = masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(s, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    if rollout_is is not None:
        weights = (weights * mask).clamp(max=rollout_is_threshold)
    modified = mask.clone()
    if rollout_rs is not None:
        assert rollout_rs_threshold is not None
        upper = rollout_rs_threshold
        lower = rollout_rs_threshold_lower if rollout_rs_threshold_lower is not None else 1.0 / upper
        if rollout_rs == "token":
            w = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
        elif rollout_rs == "sequence":
            s = masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1)
            w = torch.exp(torch.clamp(s, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
        else:  # geometric
            m = masked_mean(log_ratio, mask, axis=-1).unsqueeze(-1)
            w = torch.exp(torch.clamp(m, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
        modified = mask * ((w >= lower) & (w <= upper)).float()
    if rollout_token_veto_threshold is not None:
        catastrophic = (log_ratio < math.log(rollout_token_veto_threshold)) & mask.bool()
        modified = modified * (~catastrophic.any(dim=-1, keepdim=True)).float()
    return weights * modified


def verl_seq_mean_k1_mask(old, rollout, mask, *, threshold: str) -> torch.Tensor:
    """Newer verl (verl-project/verl, verl/trainer/ppo/rollout_corr_helper.py, compute_rollout_rejection_mask):
    rollout_rs "seq_mean_k1" with a "lower_upper" threshold."""
    lower_str, upper_str = threshold.split("_", 1)
    lower_log, upper_log = math.log(float(lower_str)), math.log(float(upper_str))
    token_k1 = -torch.clamp(old - rollout, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    seq_stat = masked_mean(token_k1, mask, axis=-1)
    keep = (seq_stat >= lower_log) & (seq_stat <= upper_log)
    return mask * keep.unsqueeze(-1).double()


def verl_offpolicy_metrics(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """compute_offpolicy_metrics: kl, k3_kl, ppl_ratio, chi2_token."""
    log_ratio = old - rollout
    mean_training = masked_mean(old, mask, axis=-1)
    mean_rollout = masked_mean(rollout, mask, axis=-1)
    rho = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    return {
        "kl": float(masked_mean(rollout - old, mask)),
        "k3_kl": float(masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)),
        "ppl_ratio": float(torch.exp(mean_rollout - mean_training).mean()),
        "chi2_token": float(masked_mean(rho.square(), mask) - 1.0),
    }


# --- OpenRLHF (OpenRLHF/OpenRLHF, openrlhf/models/loss.py, PolicyLoss.forward) --------------------------------------


def openrlhf_weights(old, rollout, mask, *, correction_type: str, low: float = 0.5, high: float = 5.0):
    """The coefficient OpenRLHF multiplies each token's PPO loss by."""
    log_ratio = old - rollout
    if correction_type == "icepop":
        vllm_is = torch.exp(log_ratio)
        return vllm_is * ((vllm_is >= low) & (vllm_is <= high))
    if correction_type == "seq-mask-tis":
        seq_is = torch.exp(masked_mean(log_ratio, mask, axis=-1))
        seq_mask = (seq_is >= low) & (seq_is <= high)
        return seq_mask.unsqueeze(-1) * torch.exp(log_ratio)
    return torch.exp(log_ratio).clamp(min=low, max=high)  # tis


# --- TRL (huggingface/trl, trl/trainer/grpo_trainer.py, vllm_importance_sampling_mode) ------------------------------


def trl_weights(old, sampling, mask, *, mode: str, cap: float = 3.0) -> torch.Tensor:
    per_token_logps_diff = (old - sampling) * mask
    if mode in ("sequence_mask", "sequence_truncate"):
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ("sequence_truncate", "token_truncate"):
        ratio = torch.clamp(ratio, max=cap)
    else:
        ratio = ratio.masked_fill(ratio > cap, value=0.0)
    return ratio.expand_as(old)


# --- inputs and our side -----------------------------------------------------------------------------------------


def padded_inputs(seed: int, *, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(trainer log-probs, behaviour log-probs, mask) [B, T] in float64: 12 sequences of 3-16 tokens, some with a
    masked interior (tool) token; log ratios ~ N(0, scale), a few far off (stale tokens)."""
    gen = torch.Generator().manual_seed(seed)
    b, t = 12, 16
    lengths = torch.randint(3, t + 1, (b,), generator=gen)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).double()
    mask[::4, 1] = 0.0
    rollout = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    delta = torch.randn(b, t, generator=gen, dtype=torch.float64) * scale
    delta[1, 2] -= 12.0  # a catastrophic token (ratio ~6e-6) for the veto
    delta[5, 0] += 3.0
    return rollout + delta, rollout, mask


def ours(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, cfg: RolloutCorrection) -> torch.Tensor:
    """Our weights on the flat layout (padding as loss_mask-0 tokens), put back into [B, T] (0 on padding)."""
    weight = correct((old - rollout).flatten(), flat_sequences(mask), cfg).weight.view_as(mask)
    return weight * mask


def flat_sequences(mask: torch.Tensor) -> TokenSequences:
    return TokenSequences.of(torch.full((mask.shape[0],), mask.shape[1]), mask.flatten())


def preset(name: str, **overrides: float) -> RolloutCorrection:
    return RolloutCorrection.model_validate({"preset": name, **overrides})


@pytest.mark.parametrize(
    ("name", "verl_args", "scale"),
    [
        ("token_is", {"rollout_is": "token", "rollout_is_threshold": 2.0}, 0.5),
        ("seq_is", {"rollout_is": "sequence", "rollout_is_threshold": 2.0}, 0.3),
        (
            "seq_is_rs",
            {
                "rollout_is": "sequence",
                "rollout_is_threshold": 2.0,
                "rollout_rs": "sequence",
                "rollout_rs_threshold": 2.0,
                "rollout_rs_threshold_lower": 0.5,
            },
            0.3,
        ),
        (
            "geo_rs",
            {
                "rollout_is": None,
                "rollout_rs": "geometric",
                "rollout_rs_threshold": 1.001,
                "rollout_rs_threshold_lower": 0.999,
                "rollout_token_veto_threshold": 1e-4,
            },
            0.002,
        ),
    ],
)
def test_verl_presets_match_verl(name, verl_args, scale):
    old, rollout, mask = padded_inputs(1, scale=scale)
    expected = verl_weights_and_mask(old, rollout, mask, **verl_args)
    got = ours(old, rollout, mask, preset(name))
    assert torch.allclose(got, expected, rtol=0, atol=1e-6), (got - expected).abs().max()
    assert int((expected == 0).logical_and(mask > 0).sum()) > 0 or "rs" not in name  # the bounds were reached


def test_newer_verls_seq_mean_k1_preset_matches_newer_verl():
    old, rollout, mask = padded_inputs(8, scale=0.002)
    expected = verl_seq_mean_k1_mask(old, rollout, mask, threshold="0.999_1.001")
    got = ours(old, rollout, mask, preset("decoupled_geo_rs"))
    assert torch.equal(got, expected) and got.any() and ((expected == 0) & (mask > 0)).any()


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_rejection_with_verls_default_lower_bound_and_the_veto_match_verl(level):
    """`low` unset is 1 / high, verl's rollout_rs_threshold_lower default; the veto drops sequence 1."""
    old, rollout, mask = padded_inputs(2, scale=0.4 if level == "token" else 0.05)
    high = {"token": 1.5, "sequence": 3.0, "geometric": 1.04}[level]
    cfg = RolloutCorrection(rejection=level, high=high, veto=1e-4)
    expected = verl_weights_and_mask(
        old,
        rollout,
        mask,
        rollout_is=None,
        rollout_rs=level,
        rollout_rs_threshold=high,
        rollout_token_veto_threshold=1e-4,
    )
    got = ours(old, rollout, mask, cfg)
    assert torch.equal(got, expected)
    assert not got[1].any() and got.any()


@pytest.mark.parametrize(
    ("name", "correction_type"), [("icepop", "icepop"), ("seq-mask-tis", "seq-mask-tis"), ("openrlhf-tis", "tis")]
)
def test_openrlhf_presets_match_openrlhf(name, correction_type):
    old, rollout, mask = padded_inputs(3, scale=0.6 if correction_type != "seq-mask-tis" else 0.25)
    expected = openrlhf_weights(old, rollout, mask, correction_type=correction_type) * mask
    got = ours(old, rollout, mask, preset(name))
    assert torch.allclose(got, expected, rtol=0, atol=1e-6), (got - expected).abs().max()
    dropped = (expected == 0) & (mask > 0)
    assert dropped.any() == (correction_type != "tis")


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_trl_modes_match_trl(mode):
    old, rollout, mask = padded_inputs(4, scale=0.7 if mode.startswith("token") else 0.35)
    expected = trl_weights(old, rollout, mask, mode=mode) * mask
    got = ours(old, rollout, mask, preset(mode))
    assert torch.allclose(got, expected, rtol=0, atol=1e-6), (got - expected).abs().max()
    capped = (expected == 3.0) if mode.endswith("truncate") else (expected == 0) & (mask > 0)
    assert capped.any()  # the cap was reached


def test_a_presets_cap_can_be_changed():
    """A preset fills the keys left unset: TRL's sequence_mask with vllm_importance_sampling_cap 2.0."""
    old, rollout, mask = padded_inputs(5, scale=0.35)
    got = ours(old, rollout, mask, preset("sequence_mask", high=2.0))
    assert torch.allclose(got, trl_weights(old, rollout, mask, mode="sequence_mask", cap=2.0) * mask, atol=1e-6)


def test_mismatch_metrics_match_verls_offpolicy_metrics():
    old, rollout, mask = padded_inputs(6, scale=0.3)
    seqs = flat_sequences(mask)
    got = mismatch_metrics((old - rollout).flatten(), rollout.flatten(), seqs, RolloutCorrection())
    expected = verl_offpolicy_metrics(old, rollout, mask)
    for ours_key, verl_key in (
        ("mismatch/kl", "kl"),
        ("mismatch/kl_k3", "k3_kl"),
        ("mismatch/ppl_ratio", "ppl_ratio"),
        ("mismatch/chi2", "chi2_token"),
    ):
        assert got[ours_key] == pytest.approx(expected[verl_key], abs=1e-6), ours_key
    ratio = torch.exp(old - rollout)[mask > 0]
    assert got["mismatch/ratio_min"] == pytest.approx(float(ratio.min()), abs=1e-9)
    assert got["mismatch/ratio_max"] == pytest.approx(float(ratio.max()), rel=1e-9)
    for q in (1, 5, 50, 95, 99):
        assert got[f"mismatch/ratio_p{q:02d}"] == pytest.approx(float(torch.quantile(ratio, q / 100)), rel=1e-9)
    assert got["mismatch/token_masked_frac"] == got["mismatch/seq_masked_frac"] == 0.0


def test_masked_and_truncated_fractions_match_verls_rejection_rates():
    """rollout_rs_masked_fraction (tokens) and rollout_rs_seq_masked_fraction (sequences) of verl's geometric RS."""
    old, rollout, mask = padded_inputs(7, scale=0.05)
    lr = old - rollout
    geo = torch.exp(masked_mean(lr, mask, axis=-1))
    keep = ((geo >= 1 / 1.02) & (geo <= 1.02)).double().unsqueeze(-1) * torch.ones_like(mask)
    seqs = flat_sequences(mask)
    cfg = RolloutCorrection(is_level="token", is_cap=1.05, rejection="geometric", high=1.02)
    got = mismatch_metrics(lr.flatten(), rollout.flatten(), seqs, cfg)
    assert got["mismatch/token_masked_frac"] == pytest.approx(float(masked_mean(1 - keep, mask)), abs=1e-9)
    assert got["mismatch/seq_masked_frac"] == pytest.approx(float((1 - keep[:, 0]).mean()), abs=1e-9)
    assert 0 < got["mismatch/seq_masked_frac"] < 1
    above = (torch.exp(lr) > 1.05) & (mask > 0)
    assert got["mismatch/token_truncated_frac"] == pytest.approx(float(above.sum() / mask.sum()), abs=1e-9)
    assert got["mismatch/seq_truncated_frac"] == pytest.approx(float(above.any(dim=1).double().mean()), abs=1e-9)


def test_the_older_keys_map_onto_the_block():
    """use_tis / tis_clip / tis_mode load as before: truncate = miles' TIS, mask = AReaL's cap; per sequence's
    geometric mean under GSPO."""
    legacy = {"use_rollout_logprobs": False, "use_tis": True, "tis_clip": 3.0}
    assert AlgorithmConfig.model_validate(legacy).rollout_correction == RolloutCorrection(is_level="token", is_cap=3.0)
    masked = AlgorithmConfig.model_validate({**legacy, "tis_mode": "mask"}).rollout_correction
    assert masked == RolloutCorrection(is_level="token", rejection="token", low=0.0, high=3.0)
    gspo = AlgorithmConfig.model_validate({**legacy, "policy_loss": "gspo"}).rollout_correction
    assert gspo == RolloutCorrection(is_level="geometric", is_cap=3.0)
    assert not AlgorithmConfig.model_validate({"use_tis": False}).rollout_correction.active


def test_every_preset_is_valid_and_round_trips_through_the_dumped_config():
    for name in ROLLOUT_CORRECTION_PRESETS:
        algo = AlgorithmConfig(use_rollout_logprobs=False, rollout_correction=preset(name))
        assert AlgorithmConfig.model_validate(algo.model_dump(mode="json")) == algo, name
        assert algo.model_dump(mode="json")["rollout_correction"]["is"] == algo.rollout_correction.is_level

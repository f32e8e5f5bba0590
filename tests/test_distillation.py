"""On-policy distillation (algorithm.distillation): each mode against its peers' formula, written here from their
source and documentation; the config's and the preflight's refusals; real DeepSpeed steps on CPU whose distill
metrics, advantages and loss are recomputed by hand from the teacher's and the student's logits."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rl_reference as ref
import torch
from conftest_trainer import VOCAB, harness, make_batch, model_logits, peaked_model_dir, tiny_model_dir  # noqa: F401

from services.contracts.config import ConfigError, DistillationConfig
from services.contracts.config_loading import config_from_dict
from services.contracts.sampling_spec import SamplingSpec
from services.contracts.trainer_calls import TrainRequest
from services.contracts.wire import RolloutBatchData
from services.trainer.algo.distillation import distillation_loss, distilled_advantages, reverse_kl

pytestmark = pytest.mark.timeout(240)

RNG = np.random.default_rng(0)
N = 64
ADV = RNG.normal(0, 1, N)
STUDENT = -RNG.exponential(1.5, N)  # log-probs
TEACHER = -RNG.exponential(1.5, N)
MASK = (RNG.random(N) > 0.2).astype(float)


# ---- the peers' formulas ------------------------------------------------------------------------------------------


def tinker_cookbook_advantages(advantages, sampled_logprobs, teacher_logprobs, mask, kl_penalty_coef):
    """Thinking Machines' tinker-cookbook, tinker_cookbook/distillation/train_on_policy.py `incorporate_kl_penalty`
    (the code of the "On-Policy Distillation" post, kl_discount_factor 0):
        reverse_kl = (sampled_logprobs - teacher_logprobs) * mask
        kl_advantages = -kl_penalty_coef * mask * reverse_kl
        advantages = advantages + kl_advantages"""
    out = []
    for a, s, t, m in zip(advantages, sampled_logprobs, teacher_logprobs, mask, strict=True):
        rkl = (s - t) * m
        out.append(a + (-kl_penalty_coef * m * rkl))
    return out


def slime_advantages(advantages, student_log_probs, teacher_log_probs, opd_kl_coef):
    """slime, slime/backends/megatron_utils/loss.py `apply_opd_kl_to_advantages` (docs/en/advanced/
    on-policy-distillation.md): reverse_kl = student_log_probs - teacher_log_probs;
    advantages = adv - opd_kl_coef * reverse_kl."""
    return [a - opd_kl_coef * (s - t) for a, s, t in zip(advantages, student_log_probs, teacher_log_probs, strict=True)]


def prime_rl_advantages(advantages, trainer_logprobs, teacher_logprobs, teacher_tau, adv_tau=1.0):
    """prime-rl, src/prime_rl/trainer/rl/loss.py (docs/on_policy_distillation.md: teacher_tau, adv_tau):
    teacher_kl = teacher_logprobs - trainer_logprobs;
    advantages = adv_tau * advantages + teacher_tau * teacher_kl.detach()."""
    return [
        adv_tau * a + teacher_tau * (t - s)
        for a, s, t in zip(advantages, trainer_logprobs, teacher_logprobs, strict=True)
    ]


def verl_pg_opd_reward(student_log_prob, teacher_log_prob):
    """verl docs/algo/opd.md, PG OPD: r_t = sg(log nu(y_t|s_t) - log pi_theta(y_t|s_t)), the negative k1 estimate of
    the reverse KL, used as a per-token reward of a policy-gradient update."""
    return teacher_log_prob - student_log_prob


def verl_kl_penalty(logprob, ref_logprob, mode):
    """verl, verl/trainer/ppo/core_algos.py `kl_penalty_forward` (the distillation loss_mode's single-sample
    estimators, docs/algo/opd.md): "mse" (k2) 0.5 * (logprob - ref_logprob)^2; "low_var_kl" (k3) with
    kl = ref_logprob - logprob, ratio = exp(kl), kld = ratio - kl - 1, clamped to [-10, 10]."""
    if mode == "mse":
        return 0.5 * (logprob - ref_logprob) ** 2
    kl = max(-20.0, min(20.0, ref_logprob - logprob))
    return max(-10.0, min(10.0, math.exp(kl) - kl - 1))


# ---- each mode against them ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("coef", [0.3, 1.0, 2.5])
def test_reverse_kl_mode_is_the_peers_advantage(coef):
    # masked tokens: Tandem's loss weighs them 0 whatever their advantage; compare on the trainable ones
    got = distilled_advantages(torch.tensor(ADV), torch.tensor(STUDENT), torch.tensor(TEACHER), coef).numpy()
    keep = MASK > 0
    peers = {
        "tinker-cookbook": tinker_cookbook_advantages(ADV, STUDENT, TEACHER, MASK, coef),
        "slime": slime_advantages(ADV, STUDENT, TEACHER, coef),
        "prime-rl": prime_rl_advantages(ADV, STUDENT, TEACHER, teacher_tau=coef),
        "verl PG OPD": [a + coef * verl_pg_opd_reward(s, t) for a, s, t in zip(ADV, STUDENT, TEACHER, strict=True)],
    }
    for name, want in peers.items():
        np.testing.assert_allclose(got[keep], np.asarray(want)[keep], atol=1e-6, err_msg=name)
    np.testing.assert_allclose(reverse_kl(torch.tensor(STUDENT), torch.tensor(TEACHER)).numpy(), STUDENT - TEACHER)


@pytest.mark.parametrize(("estimator", "verl_mode"), [("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_loss_mode_is_verls_estimator_with_the_gradient_through_the_student(estimator, verl_mode):
    lp_s, lp_t = RNG.uniform(-2.0, -0.05, N), RNG.uniform(-2.0, -0.05, N)  # inside verl's k3 clamp (Tandem has none)
    student = torch.tensor(lp_s, requires_grad=True)
    teacher = torch.tensor(lp_t, requires_grad=True)
    cfg = DistillationConfig(teacher_path="unused", coef=0.7, mode="kl_loss", kl_estimator=estimator)
    loss = distillation_loss(student, teacher, cfg)
    want = [0.7 * verl_kl_penalty(s, t, verl_mode) for s, t in zip(lp_s, lp_t, strict=True)]
    assert max(abs(verl_kl_penalty(s, t, "low_var_kl")) for s, t in zip(lp_s, lp_t, strict=True)) < 10
    np.testing.assert_allclose(loss.detach().numpy(), want, atol=1e-6)
    loss.sum().backward()
    assert teacher.grad is None  # the teacher is a constant
    # d/d log pi: k2 gives (log pi - log nu), the reverse KL's policy-gradient coefficient (verl's PG OPD reward,
    # negated); k3 gives 1 - nu/pi, whose expectation under pi is the gradient of the forward KL (docs/algorithms.md)
    grad = 0.7 * ((lp_s - lp_t) if estimator == "k2" else (1 - np.exp(lp_t - lp_s)))
    assert student.grad is not None
    np.testing.assert_allclose(student.grad.numpy(), grad, atol=1e-6)


# ---- config and preflight -----------------------------------------------------------------------------------------


def run_config(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"path": str(tmp_path / "student")},
        "data": {"train_path": str(tmp_path / "train.jsonl")},
        "algorithm": {"distillation": {"teacher_path": str(tmp_path / "teacher")}},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return base


@pytest.mark.parametrize(
    ("distillation", "message"),
    [
        ({"coef": 0}, "coef"),
        ({"mode": "forward_kl"}, "mode"),
        ({"mode": "kl_loss", "kl_estimator": "k1"}, "kl_estimator: k1"),
        ({"kl_estimator": "k2"}, "kl_estimator applies to mode: kl_loss"),
        ({"teacher_path": ""}, "teacher_path"),
    ],
)
def test_config_refuses_a_bad_distillation_key_by_name(tmp_path, distillation, message):
    data = run_config(tmp_path)
    data["algorithm"]["distillation"].update(distillation)
    with pytest.raises(ConfigError, match=message) as err:
        config_from_dict(data, source="test")
    assert "algorithm.distillation" in str(err.value)


def test_config_pure_distillation_rules(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.reward: none gives every sample reward 0"):
        config_from_dict({**run_config(tmp_path, rollout={"reward": "none"}), "algorithm": {}}, source="test")
    with pytest.raises(ConfigError, match="dynamic_sampling drops groups"):
        config_from_dict(
            run_config(tmp_path, rollout={"reward": "none", "dynamic_sampling": {"enabled": True}}), source="test"
        )
    # the teacher's per-token signal needs no group: one sample per prompt is fine (refused without a teacher)
    cfg = config_from_dict(run_config(tmp_path, rollout={"reward": "none", "n_samples_per_prompt": 1}), source="test")
    assert cfg.algorithm.distillation is not None and cfg.algorithm.distillation.task_reward
    gae = {"advantage_estimator": "gae", "distillation": {"teacher_path": "t", "task_reward": False}}
    with pytest.raises(ConfigError, match="critic would fit values of task rewards"):
        config_from_dict(run_config(tmp_path, algorithm=gae), source="test")
    with pytest.raises(ConfigError, match="n_samples_per_prompt: 1"):
        config_from_dict({**run_config(tmp_path, rollout={"n_samples_per_prompt": 1}), "algorithm": {}}, source="test")


def test_the_teacher_path_is_relative_to_the_yaml_file_or_to_the_shell_for_a_set(tmp_path, monkeypatch):
    from services.contracts.config_loading import load_config

    example = Path(__file__).resolve().parents[1] / "examples" / "distill.yaml"
    distill = load_config(str(example), []).algorithm.distillation
    assert distill is not None and distill.teacher_path == str(example.parent / "models" / "distill_teacher")
    monkeypatch.chdir(tmp_path)
    distill = load_config(str(example), ["algorithm.distillation.teacher_path=t"]).algorithm.distillation
    assert distill is not None and distill.teacher_path == str(tmp_path / "t")


def test_preflight_refuses_a_missing_teacher_and_another_tokenizer_by_name(tmp_path):
    from services.launcher.preflight import check_teacher
    from services.modelinit.init_model import init_model
    from services.rollout.tokenizer import load_tokenizer

    student = tmp_path / "student"
    init_model(student, preset="tiny")
    config = config_from_dict(run_config(tmp_path), source="test")
    tok = load_tokenizer(student)
    with pytest.raises(ConfigError, match=r"algorithm.distillation.teacher_path: .*teacher holds no Hugging Face"):
        check_teacher(config, tok)
    shutil.copytree(student, tmp_path / "teacher")
    check_teacher(config, tok)  # the same tokenizer: accepted
    path = tmp_path / "teacher" / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    vocab["7"], vocab["8"] = vocab["8"], vocab["7"]  # two digits swapped: every 7 the student writes reads as 8
    path.write_text(json.dumps(spec))
    with pytest.raises(ConfigError) as err:
        check_teacher(config, tok)
    msg = str(err.value)
    assert msg.startswith("algorithm.distillation.teacher_path:") and "does not share the student's tokenizer" in msg
    assert "2 mapped differently" in msg and "'7'" in msg, msg


# ---- real trainer steps -------------------------------------------------------------------------------------------


def build_padded_teacher(out_dir: Path, *, vocab: int = VOCAB + 8) -> Path:
    """A teacher over the student's 32 token ids with 8 more (padding) rows in its head, peaked weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.3,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        LlamaForCausalLM(cfg).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="module")
def padded_teacher(tmp_path_factory) -> Path:
    return build_padded_teacher(tmp_path_factory.mktemp("teacher") / "model")


def tempered(model_dir: Path, batch: RolloutBatchData) -> list[float]:
    """Per response token (flat): its log-prob under log_softmax(logits / T) of the model, T its sample's."""
    slices = batch.sample_slices()
    prompts = [batch.tokens[p].tolist() for p, _, _ in slices]
    responses = [batch.tokens[r].tolist() for _, r, _ in slices]
    out = []
    for i, (rows, resp) in enumerate(zip(model_logits(model_dir, prompts, responses), responses, strict=True)):
        t = float(batch.sampling_temperature[i])
        out += [
            ref.sampling_log_probs(row, temperature=t, top_p=1.0, top_k=0)[tok]
            for row, tok in zip(rows, resp, strict=True)
        ]
    return out


def test_reverse_kl_step_matches_the_reference_with_a_teacher_of_another_vocabulary_size(
    harness,  # noqa: F811
    tiny_model_dir,  # noqa: F811
    padded_teacher,
):
    """Top-p sampling at T 0.7, a teacher whose head has 40 rows to the student's 32: the distill metrics are the
    tempered log-probs' means; the advantages are GRPO's minus coef x (student - teacher) per token, and with
    on-policy rollout log-probs (ratio 1) the PPO loss is minus their mean."""
    coef = 0.5
    dist = SamplingSpec(temperature=0.7, top_p=0.9)
    batch = make_batch(seed=3, groups=3, group_size=4, model_dir=tiny_model_dir, sampling=dist)
    h = harness(algorithm={"distillation": {"teacher_path": str(padded_teacher), "coef": coef}})
    assert h.trainer.step.teacher is not None and h.trainer.step.teacher.vocab_size == VOCAB + 8
    m = h.service.train(TrainRequest(rollout_id=0, entry_ids=(h.put(batch),))).metrics
    student, teacher = np.asarray(tempered(tiny_model_dir, batch)), np.asarray(tempered(padded_teacher, batch))
    assert m["distill/reverse_kl"] == pytest.approx(float(np.mean(student - teacher)), abs=2e-5)
    assert m["distill/teacher_logprob_mean"] == pytest.approx(float(np.mean(teacher)), abs=2e-5)
    grpo = ref.grpo_advantages(batch.rewards.tolist(), batch.group_ids.tolist(), normalize_std=True)
    adv = slime_advantages(np.repeat(grpo, batch.response_lengths), student, teacher, coef)
    assert abs(np.mean(student - teacher)) > 0.1  # the teacher says something
    assert m["ppo_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["advantage_mean"] == pytest.approx(float(np.mean(adv)), abs=2e-5)
    assert m["pg_loss"] == pytest.approx(-float(np.mean(adv)), abs=2e-5)


def test_kl_loss_step_and_pure_distillation(harness, tiny_model_dir, peaked_model_dir):  # noqa: F811
    """kl_loss with task_reward: false: the task's advantages are 0 (the policy loss is 0 at ratio 1), the loss is
    coef x k3 of the student against the teacher, and the step moves the student toward the teacher."""
    batch = make_batch(seed=5, groups=2, group_size=4, model_dir=tiny_model_dir)
    distill = {"teacher_path": str(peaked_model_dir), "coef": 2.0, "mode": "kl_loss", "task_reward": False}
    h = harness(algorithm={"distillation": distill}, trainer={"lr": 0.05})
    m = h.service.train(TrainRequest(rollout_id=0, entry_ids=(h.put(batch),))).metrics
    student, teacher = np.asarray(tempered(tiny_model_dir, batch)), np.asarray(tempered(peaked_model_dir, batch))
    k3 = np.mean([ref.kl(s, t, "k3") for s, t in zip(student, teacher, strict=True)])
    assert m["pg_loss"] == pytest.approx(0.0, abs=1e-7) and m["advantage_mean"] == 0.0
    assert m["loss"] == pytest.approx(2.0 * k3, rel=1e-4)
    assert m["reward_mean"] == pytest.approx(float(np.mean(batch.rewards)))  # the task reward is still reported
    # the same samples again (the rollout log-probs no longer matter: every task advantage is 0): closer
    again = h.service.train(
        TrainRequest(rollout_id=1, entry_ids=(h.put(make_batch(rollout_id=1, seed=5, groups=2)),))
    ).metrics
    assert again["loss"] < m["loss"] - 0.2, (again["loss"], m["loss"])  # 7.45 -> 6.94

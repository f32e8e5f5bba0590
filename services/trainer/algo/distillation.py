"""On-policy distillation (`algorithm.distillation`): a frozen teacher scores the student's own samples token by token,
and the student minimises the per-token reverse KL KL(pi_student || pi_teacher) on them.

The teacher is loaded like the KL term's reference model (`backend.load_frozen_causal_lm`: the trainer's dtype, the
chunked scoring head installed, no grad), stays on the device through an Offload like it, and is never checkpointed
(it is not part of the DeepSpeed engine). It is scored by the same `frozen_pass` over its own vocabulary size (a
teacher may pad its embedding differently); the tokenizers must match, which the launcher checks before the run
(services.rollout.tokenizer.tokenizer_mismatch). Both sides are scored in the tempered space, log_softmax(logits / T)
untruncated, the KL term's space (docs/algorithms.md): a truncated teacher would give -inf wherever the student
samples outside the teacher's nucleus.

Two modes, each the peers' formula (tests/test_distillation.py checks them against it):
- `reverse_kl`: per token, advantage -= coef x (log pi_student - log pi_teacher), the student's log-prob being the
  policy's before the update (no gradient). Thinking Machines' tinker-cookbook `incorporate_kl_penalty`, slime's
  `apply_opd_kl_to_advantages`, prime-rl's `teacher_tau`, verl's PG OPD with loss_mode k1.
- `kl_loss`: coef x a per-token KL estimator (k3, k2) of the student's log-prob (with gradient) against the
  teacher's, added to the loss: verl's GKD OPD with a sampled-token estimator (`use_policy_gradient: false`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.contracts.config import DistillationConfig, TandemConfig
from services.trainer.algo.head_scoring import output_head
from services.trainer.algo.losses import kl_estimate


@dataclass(frozen=True)
class Teacher:
    model: torch.nn.Module
    vocab_size: int  # its output head's rows (the scoring request's vocabulary), which may differ from the student's
    config: DistillationConfig


def load_teacher(config: TandemConfig, device: torch.device) -> Teacher:
    from services.trainer.model.backend import load_frozen_causal_lm

    distill = config.algorithm.distillation
    if distill is None:
        raise ValueError("load_teacher: algorithm.distillation is not set")
    distill.check_teacher_dir()
    model = load_frozen_causal_lm(config, device, path=distill.teacher_path)
    weight = output_head(model).weight
    assert isinstance(weight, torch.Tensor)
    return Teacher(model=model, vocab_size=int(weight.shape[0]), config=distill)


def reverse_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
    """The single-sample (k1) estimate of KL(pi_student || pi_teacher) at each sampled token."""
    return student_log_probs - teacher_log_probs


def distilled_advantages(
    advantages: torch.Tensor, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, coef: float
) -> torch.Tensor:
    """mode reverse_kl: A_t - coef x (log pi_student(y_t) - log pi_teacher(y_t)), the negative reverse KL added to the
    task's advantage as a per-token reward (no gradient through either log-prob)."""
    return advantages - coef * reverse_kl(student_log_probs, teacher_log_probs).detach()


def distillation_loss(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, distill: DistillationConfig
) -> torch.Tensor:
    """mode kl_loss: coef x the per-token estimator, gradient through the student's log-prob only."""
    return distill.coef * kl_estimate(student_log_probs, teacher_log_probs.detach(), distill.kl_estimator)

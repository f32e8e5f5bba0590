"""ZeRO-0's FlatAdamW against torch's own AdamW and clip, step by step: the same update in fp32, fp32 masters
under bf16 weights, the non-finite skip, a step whose host work does not grow with the parameter count, and a
state dict that refuses other parameters. On the device of TANDEM_TEST_TRAINER_DEVICE (bench/gpu_suite.py's
trainer_tests stage runs them on CUDA, where the fused kernel is CUDA's)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from conftest_trainer import DEVICE
from torch.profiler import ProfilerActivity, profile

from services.trainer.model.flat_adamw import FlatAdamW

HP: dict[str, Any] = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_model(layers: int = 3, width: int = 16, dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods).to(DEVICE, dtype)


def micro_batches(n: int, width: int = 16, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, width, generator=gen).to(DEVICE, dtype) for _ in range(n)]


def flat_step(model: torch.nn.Module, opt: FlatAdamW, mbs: list[torch.Tensor], scale: float = 1.0) -> None:
    for x in mbs:
        (model(x).float().pow(2).mean() * scale).backward()
        opt.fold_grads()
    opt.step()


def reference_step(
    model: torch.nn.Module,
    masters: list[torch.Tensor],
    opt: torch.optim.Optimizer,
    mbs: list[torch.Tensor],
    *,
    max_norm: float,
    scale: float = 1.0,
) -> float:
    """Gradients summed in fp32 over micro-batches, clipped by torch, AdamW (single-tensor path) on fp32 masters,
    copied into the model."""
    params = list(model.parameters())
    sums = [torch.zeros_like(m) for m in masters]
    for x in mbs:
        (model(x).float().pow(2).mean() * scale).backward()
        for s, p in zip(sums, params, strict=True):
            assert p.grad is not None
            s += p.grad.float()
            p.grad = None
    for m, s in zip(masters, sums, strict=True):
        m.grad = s
    norm = torch.nn.utils.clip_grad_norm_(masters, max_norm)
    opt.step()
    with torch.no_grad():
        for p, m in zip(params, masters, strict=True):
            p.copy_(m)
    return float(norm)


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_matches_torch_adamw_with_clip_over_accumulated_micro_batches(precision, dtype):
    flat_model, ref_model = make_model(dtype=dtype), make_model(dtype=dtype)
    opt = FlatAdamW(flat_model.named_parameters(), precision=precision, max_grad_norm=0.5, skip_nonfinite=True, **HP)
    masters = [p.detach().float().clone().requires_grad_(False) for p in ref_model.parameters()]
    ref_opt = torch.optim.AdamW(masters, foreach=False, **HP)
    for step in range(3):
        mbs = micro_batches(3, dtype=dtype)
        flat_step(flat_model, opt, mbs)
        norm = reference_step(ref_model, masters, ref_opt, mbs, max_norm=0.5)
        assert opt._global_grad_norm == pytest.approx(norm, rel=1e-5) and not opt.overflow, step
        flat_masters = torch.cat([g.master for g in opt.groups])
        torch.testing.assert_close(flat_masters, torch.cat([m.reshape(-1) for m in masters]), rtol=1e-5, atol=1e-6)
        for p, q in zip(flat_model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)
    if precision == "bf16":  # the model's bf16 weights are exactly the rounded fp32 masters
        assert torch.equal(
            torch.cat([p.reshape(-1) for p in flat_model.parameters()]), opt.groups[0].master.to(torch.bfloat16)
        )
        assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


def test_bf16_pure_keeps_no_master_copy():
    model = make_model(dtype=torch.bfloat16)
    opt = FlatAdamW(model.named_parameters(), precision="bf16_pure", max_grad_norm=1.0, skip_nonfinite=True, **HP)
    [group] = opt.groups
    assert group.master is group.flat and group.flat.dtype == torch.bfloat16
    before = group.flat.clone()
    flat_step(model, opt, micro_batches(2, dtype=torch.bfloat16))
    assert not torch.equal(before, group.flat)
    assert all(s["exp_avg_sq"].dtype == torch.bfloat16 for s in opt.state.values())


def test_non_finite_gradients_skip_the_step_on_the_device_and_the_next_one_applies():
    model = make_model()
    opt = FlatAdamW(model.named_parameters(), precision="fp32", max_grad_norm=1.0, skip_nonfinite=True, **HP)
    flat_step(model, opt, micro_batches(1))
    weights = opt.groups[0].flat.clone()
    states = copy.deepcopy(opt.state[opt.groups[0].master])
    flat_step(model, opt, micro_batches(1), scale=float("nan"))
    assert opt.overflow and opt._global_grad_norm != opt._global_grad_norm  # nan
    assert torch.equal(weights, opt.groups[0].flat)
    after = opt.state[opt.groups[0].master]
    assert int(after["step"]) == int(states["step"]) == 1
    assert torch.equal(after["exp_avg"], states["exp_avg"]) and torch.equal(after["exp_avg_sq"], states["exp_avg_sq"])
    flat_step(model, opt, micro_batches(1))
    assert not opt.overflow and int(after["step"]) == 2 and not torch.equal(weights, opt.groups[0].flat)


def _step_ops(layers: int) -> list[str]:
    """The non-view ops one fold + step issues, for a model of `layers` x 4 parameter tensors."""
    model = make_model(layers=layers)
    opt = FlatAdamW(model.named_parameters(), precision="fp32", max_grad_norm=1.0, skip_nonfinite=True, **HP)
    flat_step(model, opt, micro_batches(1))  # Adam states exist from here on
    model(micro_batches(1)[0]).pow(2).mean().backward()
    views = {
        "aten::view",
        "aten::reshape",
        "aten::_reshape_alias",
        "aten::as_strided",
        "aten::detach",
        "aten::alias",
        "detach",
    }
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.fold_grads()
        opt.step()
    return sorted(e.name for e in prof.events() if e.name.startswith("aten::") and e.name not in views)


def test_the_step_issues_the_same_ops_for_8_and_80_parameter_tensors():
    """DeepSpeed's ZeRO-1 step did work per tensor (2.8k launches for a 291-tensor model on the H200); this one
    concatenates once and then works on whole buffers."""
    small, large = _step_ops(layers=2), _step_ops(layers=20)
    assert small == large
    assert len(small) < 80, small


def test_state_dict_round_trips_and_refuses_other_parameters():
    model = make_model(dtype=torch.bfloat16)
    opt = FlatAdamW(model.named_parameters(), precision="bf16", max_grad_norm=1.0, skip_nonfinite=True, **HP)
    flat_step(model, opt, micro_batches(2, dtype=torch.bfloat16))
    saved = copy.deepcopy(opt.state_dict())
    twin = make_model(dtype=torch.bfloat16)
    twin_opt = FlatAdamW(twin.named_parameters(), precision="bf16", max_grad_norm=1.0, skip_nonfinite=True, **HP)
    twin_opt.load_state_dict(saved)
    assert torch.equal(twin_opt.groups[0].master, opt.groups[0].master)  # the fp32 masters, not rounded weights
    assert torch.equal(twin_opt.groups[0].flat, opt.groups[0].flat)
    mbs = micro_batches(1, dtype=torch.bfloat16)
    flat_step(model, opt, mbs)
    flat_step(twin, twin_opt, mbs)
    assert torch.equal(twin_opt.groups[0].master, opt.groups[0].master)

    other = make_model(layers=2, dtype=torch.bfloat16)
    other_opt = FlatAdamW(other.named_parameters(), precision="bf16", max_grad_norm=1.0, skip_nonfinite=True, **HP)
    with pytest.raises(ValueError, match="covers other parameters"):
        other_opt.load_state_dict(saved)
    plain = {k: v for k, v in saved.items() if k != "flat"}
    with pytest.raises(ValueError, match="zero_stage must match"):
        twin_opt.load_state_dict(plain)


def test_a_module_moved_after_flattening_is_caught():
    model = make_model()
    opt = FlatAdamW(model.named_parameters(), precision="fp32", max_grad_norm=1.0, skip_nonfinite=True, **HP)
    opt.check_bound()
    first = model[0]
    assert isinstance(first, torch.nn.Linear)
    first.weight.data = first.weight.data.clone()
    with pytest.raises(RuntimeError, match=r"0\.weight is no longer a view"):
        opt.check_bound()

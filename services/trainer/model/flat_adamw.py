"""The optimizer of ZeRO stage 0: AdamW over flat buffers, a step of a few kernels whatever the parameter count.

DeepSpeed's ZeRO-1 and bf16 optimizers do work per parameter tensor: gradient hooks that copy into buckets,
a norm and an overflow check each, partition views. A 0.36B Qwen2 has 291 tensors, and on an H200 its step was
host-bound: 2.8k kernel launches for 56 ms of GPU work (bench/RESULTS.md). Here every trainable tensor of one
dtype is a view of one buffer, so the step is whole-buffer operations:

- after each micro-batch's backward, `fold_grads` concatenates the gradients into one accumulator (fp32 unless
  bf16_pure) and drops the per-tensor ones: a few launches, and gradients are summed in the master precision;
- `step`: on several ranks one all-reduce per buffer; the global norm, the clip and the mean over ranks as one
  multiply; torch's fused AdamW on the master buffer (one kernel), skipped on the device when the norm is not
  finite (its found_inf input, so no host sync decides it); the master copied into the model's bf16 buffer;
  then one host sync for the norm and whether the step was skipped.

Precisions: fp32 and bf16_pure update the model's buffer in place; bf16 keeps an fp32 master buffer (and fp32
gradients and Adam states) beside the model's bf16 one. Every rank holds everything (no partitioning), as in
DDP. The state dict is torch's AdamW state of the master buffers plus, for bf16, the masters themselves and the
layout, so a checkpoint of other parameters is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim.optimizer import StateDict

CLIP_EPS = 1e-6  # as DeepSpeed and torch clip: coef = max_norm / (norm + 1e-6)


SlotEntry = list[str | list[int]]  # [name, shape] of one tensor of a flat buffer, as the optimizer's state holds it


@dataclass(frozen=True)
class Slot:
    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


class FlatGroup:
    """The trainable parameters of one dtype as views of one buffer (`flat`), their master copy (`master`: `flat`
    itself unless the precision keeps fp32 masters of bf16 weights) and the gradient accumulator (`grad`)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], *, master_dtype: torch.dtype):
        self.params = [p for _, p in named]
        offsets = [0]
        for _, p in named:
            offsets.append(offsets[-1] + p.numel())
        self.slots = tuple(
            Slot(name, offset, tuple(p.shape)) for (name, p), offset in zip(named, offsets[:-1], strict=True)
        )
        first = self.params[0]
        self.flat = torch.empty(offsets[-1], dtype=first.dtype, device=first.device)
        torch.cat([p.detach().reshape(-1) for p in self.params], out=self.flat)
        self.rebind()
        self.master = self.flat if first.dtype == master_dtype else self.flat.to(master_dtype)
        self.grad: torch.Tensor | None = None
        self.folded = 0  # micro-batches folded into `grad` since the last step

    @property
    def separate_master(self) -> bool:
        return self.master is not self.flat

    def rebind(self) -> None:
        """Points every parameter at its view of `flat` (again after `flat` moved)."""
        for p, slot in zip(self.params, self.slots, strict=True):
            p.data = self.flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def check_bound(self) -> None:
        """Every parameter must still be its view of `flat` (a module move elsewhere would silently detach it: the
        step would then update a buffer nothing reads)."""
        base, item = self.flat.data_ptr(), self.flat.element_size()
        for p, slot in zip(self.params, self.slots, strict=True):
            if p.data_ptr() != base + slot.offset * item:
                raise RuntimeError(
                    f"parameter {slot.name} is no longer a view of its flat buffer (was the module "
                    "moved after FlatAdamW was built?)"
                )

    def fold_grads(self) -> None:
        """Adds the parameters' gradients into `grad` (allocated on first use) and drops them; a parameter the
        backward did not reach counts as zeros."""
        grads = [p.grad.reshape(-1) if p.grad is not None else self.flat.new_zeros(p.numel()) for p in self.params]
        for p in self.params:
            p.grad = None
        if self.grad is None:
            self.grad = torch.empty_like(self.master)
        if not self.folded and self.grad.dtype == self.flat.dtype:
            torch.cat(grads, out=self.grad)
        else:  # cat in the gradients' own dtype: CUDA's batched cat kernel wants one dtype in and out
            joined = torch.cat(grads)
            if self.folded:
                self.grad.add_(joined)
            else:
                self.grad.copy_(joined)
        self.folded += 1

    def move(self, device: torch.device, *, pin: bool) -> None:
        """Moves the weights (and masters) to `device`, drops the gradient accumulator; parameters follow."""
        separate = self.separate_master
        self.flat.data = _moved(self.flat.data, device, pin=pin)
        if separate:
            self.master.data = _moved(self.master.data, device, pin=pin)
        self.grad, self.folded = None, 0
        self.rebind()

    def layout(self) -> list[SlotEntry]:
        return [[s.name, list(s.shape)] for s in self.slots]


def master_dtype(param_dtype: torch.dtype, precision: str) -> torch.dtype:
    """bf16_pure keeps no masters (bf16 weights, gradients and Adam states); fp32 and bf16 update fp32 masters."""
    return param_dtype if precision == "bf16_pure" else torch.float32


class FlatAdamW(torch.optim.AdamW):
    """torch's fused AdamW over one master buffer per dtype, with gradient folding, the global-norm clip, the
    mean over data-parallel ranks and the non-finite skip done on whole buffers. DeepSpeed runs it as a client
    optimizer at ZeRO stage 0 with its own bf16 wrapper, clipping and all-reduce turned off (backend.py)."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        *,
        precision: str,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        max_grad_norm: float,
        skip_nonfinite: bool,
    ):
        by_dtype: dict[torch.dtype, list[tuple[str, torch.nn.Parameter]]] = {}
        for name, p in named_params:
            if p.requires_grad:
                by_dtype.setdefault(p.dtype, []).append((name, p))
        if not by_dtype:
            raise ValueError("FlatAdamW: the model has no trainable parameters")
        devices = {p.device for group in by_dtype.values() for _, p in group}
        if len(devices) != 1:
            raise ValueError(f"FlatAdamW: trainable parameters on several devices {sorted(map(str, devices))}")
        self.groups = [
            FlatGroup(named, master_dtype=master_dtype(dtype, precision))
            for dtype, named in sorted(by_dtype.items(), key=lambda kv: str(kv[0]))
        ]
        self.max_grad_norm, self.skip_nonfinite = max_grad_norm, skip_nonfinite
        super().__init__(
            [g.master for g in self.groups], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True
        )
        self.overflow = False  # read by DeepSpeed: a skipped step does not advance the lr schedule
        self._global_grad_norm = float("nan")  # read by DeepSpeed's get_global_grad_norm()

    def check_bound(self) -> None:
        for g in self.groups:
            g.check_bound()

    def fold_grads(self) -> None:
        """After each micro-batch's backward."""
        for g in self.groups:
            g.fold_grads()

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # refuses torch's closure form
        if closure is not None:
            raise ValueError("FlatAdamW.step takes no closure")
        if not all(g.folded for g in self.groups):
            raise RuntimeError(
                "FlatAdamW.step: no gradients were folded since the last step (call fold_grads after each backward)"
            )
        world = dist.get_world_size() if dist.is_initialized() else 1
        grads = [g.grad for g in self.groups if g.grad is not None]
        if world > 1:
            for grad in grads:
                dist.all_reduce(grad)
        norm = (
            torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(grad, dtype=torch.float32) for grad in grads])
            )
            / world
        )
        coef = torch.clamp(self.max_grad_norm / (norm + CLIP_EPS), max=1.0) / world  # clip and mean over ranks
        for grad in grads:
            grad.mul_(coef)
        nonfinite = (~torch.isfinite(norm)).float()
        for g in self.groups:
            g.master.grad = g.grad
        self.found_inf = nonfinite if self.skip_nonfinite else None  # the fused kernel skips on the device
        super().step()
        for g in self.groups:
            if g.separate_master:
                g.flat.copy_(g.master)
            g.master.grad, g.folded = None, 0
        norm_value, skipped = torch.stack([norm, nonfinite]).tolist()  # the step's one host sync
        self._global_grad_norm = norm_value
        self.overflow = bool(skipped) and self.skip_nonfinite

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.groups:
            g.folded = 0
            for p in g.params:
                p.grad = None

    # ---- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> StateDict:
        out = super().state_dict()
        out["flat"] = {
            "layout": [g.layout() for g in self.groups],
            "masters": [g.master if g.separate_master else None for g in self.groups],
        }
        return out

    def load_state_dict(self, state_dict: StateDict | None) -> None:
        state_dict = dict(state_dict or {})  # a ZeRO 1-3 checkpoint keeps None here (its state is in shards)
        flat = state_dict.pop("flat", None)
        if flat is None:
            raise ValueError(
                "this optimizer state was not written by ZeRO stage 0's flat AdamW (trainer.zero_stage "
                "must match the checkpoint's)"
            )
        mine = [g.layout() for g in self.groups]
        if flat["layout"] != mine:
            raise ValueError(
                f"the checkpoint's optimizer state covers other parameters: its first "
                f"{_first_names(flat['layout'])}, this model's {_first_names(mine)}"
            )
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for g, master in zip(self.groups, flat["masters"], strict=True):
                if g.separate_master:
                    if master is None:
                        raise ValueError(
                            "the checkpoint's optimizer state has no fp32 master weights "
                            "(written under another trainer.precision)"
                        )
                    g.master.copy_(master)
                    g.flat.copy_(g.master)

    # ---- offload ----------------------------------------------------------------------------------

    def move(self, device: torch.device, *, pin: bool = False) -> None:
        """Weights, masters and Adam states to `device` (pinned when on the host and `pin`); parameters follow."""
        for g in self.groups:
            g.move(device, pin=pin)
        for state in self.state.values():
            for key, value in state.items():  # "step" too: the fused kernel wants it beside the parameter
                if torch.is_tensor(value):
                    state[key] = _moved(value, device, pin=pin)


def _moved(tensor: torch.Tensor, device: torch.device, *, pin: bool) -> torch.Tensor:
    """`tensor` on `device`; to the host into pinned memory when `pin` (one copy, and a fast one back)."""
    if pin and device.type == "cpu" and tensor.device.type != "cpu":
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        return out.copy_(tensor)
    return tensor.to(device)


def _first_names(layout: list[list[SlotEntry]]) -> list[str]:
    return [str(slot[0]) for group in layout for slot in group][:3]

"""Fused Triton kernels for the elementwise parts of a Llama/Qwen2 decoder layer: RMSNorm and SwiGLU, forward and
backward (`model.fused_kernels`).

In eager mode each RMSNorm is eight kernels over the hidden states (casts to fp32, square, mean, rsqrt, two
multiplies, the cast back) and SwiGLU's backward half a dozen over the MLP's widest tensor; on the H200 these were
~300 ms of a 550 ms q05 step (bench/RESULTS.md). Here each is one pass that reads its inputs once and writes its
outputs once. They compute what the Hugging Face modules compute (fp32 normalisation, the result cast to the input
dtype before the weight multiplies it; SiLU in fp32, rounded, times `up`), so a patched model matches an unpatched
one to bf16 rounding (tests/test_fused_gpu.py).

`patch_model` swaps the forward of every RMSNorm and SwiGLU MLP in a model for these; modules of other shapes
stay as they are. Needs CUDA and Triton; `available()` says whether they are here.
"""

from __future__ import annotations

import importlib.util
import logging
import types
from typing import Any, cast

import torch

log = logging.getLogger(__name__)


def available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def enabled(choice: str, *, device: torch.device, dtype: torch.dtype) -> bool:
    """model.fused_kernels: auto = on a CUDA device with Triton and bf16 weights; on = required (an error where they
    cannot run); off = the models' own eager modules."""
    if choice == "off":
        return False
    usable = device.type == "cuda" and available()
    if choice == "on" and not usable:
        raise ValueError("model.fused_kernels: on needs a CUDA device and the triton package; use auto or off")
    return usable and (choice == "on" or dtype == torch.bfloat16)


if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        normed = (x * rstd).to(y_ptr.dtype.element_ty)  # as HF: cast back before the weight multiplies
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(
            y_ptr + row * n_cols + cols,
            (normed.to(tl.float32) * w.to(tl.float32)).to(y_ptr.dtype.element_ty),
            mask=mask,
        )
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _rms_bwd(
        dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        start = pid * ROWS
        for i in range(0, ROWS):
            row = (start + i).to(tl.int64)
            live = mask & (row < n_rows)  # the last program's rows past the end load zeros and store nothing
            x = tl.load(x_ptr + row * n_cols + cols, mask=live, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * n_cols + cols, mask=live, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row, mask=row < n_rows, other=0.0)
            normed = x * rstd
            dw += dy * normed.to(dy_ptr.dtype.element_ty).to(tl.float32)
            dn = dy * w
            dx = rstd * (dn - normed * (tl.sum(dn * normed, axis=0) / n_cols))
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=live)
        tl.store(dw_part_ptr + pid * n_cols + cols, dw, mask=mask)

    @triton.jit
    def _swiglu_fwd(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0)
        act = (g * tl.sigmoid(g)).to(y_ptr.dtype.element_ty)  # as HF: SiLU rounded to the dtype, then times up
        tl.store(y_ptr + offs, (act.to(tl.float32) * u.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        act = (g * sig).to(dg_ptr.dtype.element_ty).to(tl.float32)
        tl.store(du_ptr + offs, (dy * act).to(du_ptr.dtype.element_ty), mask=mask)
        tl.store(dg_ptr + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty), mask=mask)


_ELEMENTWISE_BLOCK = 1024
_BWD_ROWS_PER_PROGRAM = 64


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        rows, cols = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(cols)
        _rms_fwd[(rows,)](x2, weight, y, rstd, cols, eps, BLOCK=block, num_warps=_warps(block))
        ctx.save_for_backward(x2, weight, rstd)
        return y.reshape(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x2, weight, rstd = ctx.saved_tensors
        rows, cols = x2.shape
        dy2 = dy.reshape(rows, cols).contiguous()
        dx = torch.empty_like(x2)
        programs = triton.cdiv(rows, _BWD_ROWS_PER_PROGRAM)
        dw_part = torch.empty(programs, cols, dtype=torch.float32, device=x2.device)
        block = triton.next_power_of_2(cols)
        _rms_bwd[(programs,)](
            dy2,
            x2,
            weight,
            rstd,
            dx,
            dw_part,
            rows,
            cols,
            ROWS=_BWD_ROWS_PER_PROGRAM,
            BLOCK=block,
            num_warps=_warps(block),
        )
        return dx.reshape(dy.shape), dw_part.sum(0).to(weight.dtype), None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        _swiglu_fwd[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](gate, up, y, n, BLOCK=_ELEMENTWISE_BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _swiglu_bwd[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](dy, gate, up, dg, du, n, BLOCK=_ELEMENTWISE_BLOCK)
        return dg, du


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate, up)


def _fused_norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != self.weight.dtype:  # under autocast HF promotes; keep its semantics there
        return self._unfused_forward(hidden_states)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _fused_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.dtype != up.dtype:
        return self._unfused_forward(x)
    return self.down_proj(swiglu(gate, up))


def _is_rms_norm(module: torch.nn.Module) -> bool:
    return (
        type(module).__name__.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
    )


_SILU_CLASSES = ("SiLU", "SiLUActivation")  # torch's, and transformers' own in 5.x


def _is_swiglu_mlp(module: torch.nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return (
        all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")) and type(act).__name__ in _SILU_CLASSES
    )


def warm_up(model: torch.nn.Module, device: torch.device) -> None:
    """Compiles the kernels for this model's widths and dtype now (Triton compiles on first launch, a second or
    two each), so the first training step does not pay for it: one tiny forward and backward per shape."""
    seen: set[tuple[str, int, torch.dtype]] = set()
    for module in model.modules():
        if getattr(module, "_unfused_forward", None) is None:
            continue
        key: tuple[str, int, torch.dtype]
        if _is_rms_norm(module):
            weight = cast("torch.Tensor", module.weight)
            key = ("rms", int(weight.shape[-1]), weight.dtype)
        elif _is_swiglu_mlp(module):
            gate = cast("torch.nn.Linear", module.gate_proj)
            key = ("swiglu", gate.out_features, gate.weight.dtype)
        else:
            continue
        if key in seen:
            continue
        seen.add(key)
        kind, width, dtype = key
        x = torch.randn(2, width, device=device, dtype=dtype, requires_grad=True)
        if kind == "rms":
            w = torch.ones(width, device=device, dtype=dtype, requires_grad=True)
            rms_norm(x, w, 1e-6).sum().backward()
        else:
            swiglu(x, torch.randn_like(x).requires_grad_()).sum().backward()


def patch_model(model: torch.nn.Module) -> dict[str, int]:
    """Routes every RMSNorm and SiLU-gated MLP of `model` through the fused kernels; returns how many of each."""
    counts = {"rms_norm": 0, "swiglu_mlp": 0}
    for module in model.modules():
        for kind, matches, fused in (
            ("rms_norm", _is_rms_norm, _fused_norm_forward),
            ("swiglu_mlp", _is_swiglu_mlp, _fused_mlp_forward),
        ):
            if matches(module) and not hasattr(module, "_unfused_forward"):
                # plain attributes, not nn.Module ones: the instance's forward is looked up before the class's
                object.__setattr__(module, "_unfused_forward", module.forward)
                object.__setattr__(module, "forward", types.MethodType(fused, module))
                counts[kind] += 1
    log.info("fused kernels: %d RMSNorm and %d SwiGLU MLP modules patched", counts["rms_norm"], counts["swiglu_mlp"])
    return counts

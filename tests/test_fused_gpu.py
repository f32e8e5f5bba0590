"""The fused RMSNorm and SwiGLU kernels (services/trainer/fused.py) compute what the Hugging Face modules compute,
forward and backward, and a patched Qwen2 model matches an unpatched one.

Runs on a CUDA device with Triton; without one it is skipped (CI), except under Triton's interpreter
(TRITON_INTERPRET=1 with triton installed), where the same kernels run on the CPU.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from services.contracts.untyped import HFCausalLM

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_TRITON or not (torch.cuda.is_available() or INTERPRET),
    reason="needs triton and a CUDA device (or TRITON_INTERPRET=1)",
)
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("cols", [64, 896, 1000])
def test_rms_norm_forward_and_backward_match_the_eager_module(cols):
    from services.tensors.fused import rms_norm

    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(3, 37, cols, generator=gen).to(DEVICE, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(cols, generator=gen)).to(DEVICE, torch.bfloat16)
    dy = torch.randn(3, 37, cols, generator=gen).to(DEVICE, torch.bfloat16)
    outs = {}
    for name, fn in (("fused", rms_norm), ("eager", eager_rms_norm)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, 1e-6)
        y.backward(dy)
        outs[name] = (y, xi.grad, wi.grad)
    for got, want in zip(outs["fused"], outs["eager"], strict=True):
        assert got is not None and want is not None
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel(got, want) < 1e-2, rel(got, want)  # bf16 operands: 1e-3..1e-2 (METHOD.md)


def test_swiglu_forward_and_backward_match_silu_times_up():
    from services.tensors.fused import swiglu

    gen = torch.Generator().manual_seed(7)
    g = (3 * torch.randn(5, 33, 700, generator=gen)).to(DEVICE, torch.bfloat16)
    u = torch.randn(5, 33, 700, generator=gen).to(DEVICE, torch.bfloat16)
    dy = torch.randn(5, 33, 700, generator=gen).to(DEVICE, torch.bfloat16)
    outs = {}
    for name, fn in (("fused", swiglu), ("eager", lambda a, b: torch.nn.functional.silu(a) * b)):
        gi, ui = g.clone().requires_grad_(), u.clone().requires_grad_()
        y = fn(gi, ui)
        y.backward(dy)
        outs[name] = (y, gi.grad, ui.grad)
    for got, want in zip(outs["fused"], outs["eager"], strict=True):
        assert got is not None and want is not None
        assert rel(got, want) < 1e-2, rel(got, want)


def test_a_patched_qwen2_model_matches_the_unpatched_one():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.tensors.fused import patch_model, warm_up

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=50,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    ref: HFCausalLM = Qwen2ForCausalLM(cfg)  # its .to is typed through a decorator that loses `self`
    fused: HFCausalLM = Qwen2ForCausalLM(cfg)
    ref, fused = ref.to(DEVICE, torch.bfloat16), fused.to(DEVICE, torch.bfloat16)
    fused.load_state_dict(ref.state_dict())
    assert patch_model(fused) == {"rms_norm": 2 * 2 + 1, "swiglu_mlp": 2}
    assert patch_model(fused) == {"rms_norm": 0, "swiglu_mlp": 0}  # patching twice changes nothing
    warm_up(fused, torch.device(DEVICE))
    ids = torch.randint(0, 50, (4, 24), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = {}
    for name, model in (("ref", ref), ("fused", fused)):
        out = model(input_ids=ids, use_cache=False).logits
        out.float().logsumexp(-1).mean().backward()
        grads[name] = (out, torch.cat([p.grad.flatten().float() for p in model.parameters()]))
    assert rel(grads["fused"][0], grads["ref"][0]) < 1e-2
    assert rel(grads["fused"][1], grads["ref"][1]) < 2e-2

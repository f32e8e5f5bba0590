"""Bucket checksums on a CUDA device (bench/gpu_suite.py's tests stage): the one-pass Triton kernel gives what the
CPU's torch path gives, over a native engine's FlatParams and over separate tensors, for the shapes of a real
model's buckets. Skipped without CUDA (CI); tests/test_weights_checksums.py runs the kernel in Triton's interpreter
where triton is installed."""

from __future__ import annotations

import pytest
import torch

from services.weights import bucket_kernel
from services.weights.checksums import bucket_checksums
from services.weights.layout import TensorSpec, plan_layout
from services.weights.transports.cuda_ipc import flat_views

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SPECS = (
    [TensorSpec("embed", "bfloat16", (1000, 96))]
    + [
        s
        for i in range(4)
        for s in (
            TensorSpec(f"l{i}.norm", "float32", (96,)),
            TensorSpec(f"l{i}.qkv", "bfloat16", (288, 96)),
            TensorSpec(f"l{i}.odd", "bfloat16", (13,)),
        )
    ]
    + [TensorSpec("head", "bfloat16", (96, 1000)), TensorSpec("none", "bfloat16", (0,))]
)


def test_the_kernel_on_the_gpu_gives_the_cpu_torch_paths_checksums():
    assert bucket_kernel.AVAILABLE, "CUDA without triton: the GPU would take the two-pass torch path"
    layout = plan_layout(SPECS, bucket_bytes=64 << 10)  # several buckets, one of a tensor larger than a bucket
    gen = torch.Generator().manual_seed(11)
    cpu = {s.name: torch.randn(s.shape, generator=gen).to(getattr(torch, s.dtype)) for s in SPECS}
    expected = bucket_checksums(layout, cpu)  # torch path, on the CPU
    _flat, flat = flat_views(layout, "cuda")
    for name, view in flat.items():
        view.copy_(cpu[name])
    assert bucket_checksums(layout, flat) == expected  # kernel over FlatParams
    assert bucket_checksums(layout, {n: t.cuda() for n, t in cpu.items()}) == expected  # over separate tensors
    flat["l2.qkv"].view(torch.int16)[5, 7] ^= 1
    changed = bucket_checksums(layout, flat)
    assert [i for i, (a, b) in enumerate(zip(changed, expected, strict=True)) if a != b] == [
        layout.order[[s.name for s in layout.order].index("l2.qkv")].bucket
    ]

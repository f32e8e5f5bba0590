"""The policy's weights as full HF-named tensors, for weight sync and the HF export.

The bucketing into dtype-homogeneous flat buffers of weights.bucket_mb, and per-tensor checksums, are the
shared `services.weights` publisher's job; this module feeds it tensors in spec order.

Names are the model's own `named_parameters()` names (no DeepSpeed `module.` prefix), so they match what a
rollout engine holding the same HF model sees. Under ZeRO-3 each parameter is partitioned: iterating
gathers groups of parameters with `GatheredParameters`, a collective, so EVERY rank must walk the
iterator to the end in lockstep (only rank 0 uses the tensors).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from services.weights import TensorSpec
from services.weights.layout import dtype_name


def _full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(param.ds_shape if hasattr(param, "ds_shape") else param.shape)


def weight_specs(module: torch.nn.Module, *, dtype: torch.dtype) -> list[TensorSpec]:
    """Name, dtype and full shape of every parameter, in iteration order; needs no collective."""
    return [TensorSpec(name=name, dtype=dtype_name(dtype), shape=_full_shape(p))
            for name, p in module.named_parameters()]


def _groups(params: list[tuple[str, torch.nn.Parameter]],
            group_bytes: int) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    group: list[tuple[str, torch.nn.Parameter]] = []
    size = 0
    for name, p in params:
        nbytes = int(torch.Size(_full_shape(p)).numel()) * p.element_size()
        if group and size + nbytes > group_bytes:
            yield group
            group, size = [], 0
        group.append((name, p))
        size += nbytes
    if group:
        yield group


def iter_named_weights(module: torch.nn.Module, *, dtype: torch.dtype, zero3: bool,
                       group_bytes: int = 64 << 20) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor in `dtype`) per parameter. Under ZeRO-3 a collective: all ranks must exhaust it.
    Read-only views when no gather is needed; under ZeRO-3 fresh copies (the gathered storage is released
    after each group)."""
    params = list(module.named_parameters())
    if not zero3:
        for name, p in params:
            yield name, p.detach().to(dtype)
        return
    import deepspeed

    for group in _groups(params, group_bytes):
        with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
            out = [(name, p.detach().to(dtype, copy=True)) for name, p in group]
        yield from out

"""The policy's weights as full HF-named tensors, for weight sync and the HF export.

The bucketing into dtype-homogeneous flat buffers of weights.bucket_mb, and per-tensor checksums, are the
shared `services.weights` publisher's job; this module feeds it tensors in spec order.

What is exported is a list of `ExportedTensor`: a name the rollout engine's HF model has, and the parameters its
value is computed from. With full fine-tuning that is each of the model's own `named_parameters()` (no DeepSpeed
`module.` prefix). With LoRA (`services.trainer.model.lora.merged_tensors`) an adapted linear layer's weight is
W + scaling · B·A, computed from the frozen base weight and the adapter's factors without touching them, under the
base layer's name, so the engines receive the model they already hold. Under ZeRO-3 each parameter is partitioned:
iterating gathers groups of parameters with `GatheredParameters`, a collective, so EVERY rank must walk the
iterator to the end in lockstep (only rank 0 uses the tensors).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from services.weights import TensorSpec
from services.weights.layout import dtype_name


def _full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(param.ds_shape if hasattr(param, "ds_shape") else param.shape)


def _numel(param: torch.nn.Parameter) -> int:
    return int(torch.Size(_full_shape(param)).numel())


@dataclass(frozen=True)
class LowRankUpdate:
    """A LoRA adapter of one linear layer: the layer computes x·(W + scaling · B·A)ᵀ."""

    a: torch.nn.Parameter  # [rank, in]
    b: torch.nn.Parameter  # [out, rank]
    scaling: float  # alpha / rank


@dataclass(frozen=True)
class ExportedTensor:
    """One tensor the engines hold: its HF name and the parameters its value is computed from."""

    name: str
    base: torch.nn.Parameter
    update: LowRankUpdate | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return _full_shape(self.base)

    @property
    def params(self) -> tuple[torch.nn.Parameter, ...]:
        return (self.base,) if self.update is None else (self.base, self.update.a, self.update.b)

    def value(self, dtype: torch.dtype, *, copy: bool) -> torch.Tensor:
        """The full tensor in `dtype` (the parameters must be whole: gathered under ZeRO-3). The merge is computed
        in float32 and rounded once; the parameters are read, never written."""
        if self.update is None:
            return self.base.detach().to(dtype, copy=copy)
        u = self.update
        delta = (u.b.detach().float() @ u.a.detach().float()) * u.scaling
        return (self.base.detach().float() + delta).to(dtype)


def plain_tensors(module: torch.nn.Module) -> list[ExportedTensor]:
    """Full fine-tuning: every parameter under its own name."""
    return [ExportedTensor(name=name, base=p) for name, p in module.named_parameters()]


def weight_specs(tensors: Sequence[ExportedTensor], *, dtype: torch.dtype) -> list[TensorSpec]:
    """Name, dtype and full shape of every exported tensor, in iteration order; needs no collective."""
    return [TensorSpec(name=t.name, dtype=dtype_name(dtype), shape=t.shape) for t in tensors]


def _groups(tensors: Sequence[ExportedTensor], group_bytes: int) -> Iterator[list[ExportedTensor]]:
    group: list[ExportedTensor] = []
    size = 0
    for t in tensors:
        nbytes = sum(_numel(p) * p.element_size() for p in t.params)
        if group and size + nbytes > group_bytes:
            yield group
            group, size = [], 0
        group.append(t)
        size += nbytes
    if group:
        yield group


def iter_named_weights(
    tensors: Sequence[ExportedTensor], *, dtype: torch.dtype, zero3: bool, group_bytes: int = 64 << 20
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor in `dtype`) per exported tensor. Under ZeRO-3 a collective: all ranks must exhaust it.
    Read-only views when no gather or merge is needed; under ZeRO-3 fresh copies (the gathered storage is released
    after each group)."""
    if not zero3:
        for t in tensors:
            yield t.name, t.value(dtype, copy=False)
        return
    import deepspeed

    for group in _groups(tensors, group_bytes):
        with deepspeed.zero.GatheredParameters([p for t in group for p in t.params], modifier_rank=None):
            out = [(t.name, t.value(dtype, copy=True)) for t in group]
        yield from out

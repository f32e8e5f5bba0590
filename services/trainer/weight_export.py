"""The policy's weights as full HF-named tensors, for weight sync and the HF export.

Names are the model's own `named_parameters()` names (no DeepSpeed `module.` prefix), so they match what a
rollout engine holding the same HF model sees. Under ZeRO-3 each parameter is partitioned: iterating
gathers groups of parameters with `GatheredParameters`, a collective, so EVERY rank must walk the
iterator to the end in lockstep (only rank 0 uses the tensors).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator

import torch

try:  # the shared transport module (another engineer's); its checksum is what receivers compare with
    from services.common.weights import TensorSpec, tensor_checksum
except ImportError:  # pragma: no cover - only until services/common/weights.py lands
    @dataclass(frozen=True)
    class TensorSpec:  # type: ignore[no-redef]
        name: str
        dtype: str
        shape: tuple[int, ...]

    def tensor_checksum(t: torch.Tensor) -> str:  # type: ignore[no-redef]
        data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        return "sha256:" + hashlib.sha256(data).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(param.ds_shape if hasattr(param, "ds_shape") else param.shape)


def weight_specs(module: torch.nn.Module, *, dtype: torch.dtype) -> list[TensorSpec]:
    """Name, dtype and full shape of every parameter, in iteration order; needs no collective."""
    return [TensorSpec(name=name, dtype=dtype_name(dtype), shape=_full_shape(p))
            for name, p in module.named_parameters()]


def _groups(params: list[tuple[str, torch.nn.Parameter]], group_bytes: int) -> Iterator[list]:
    group, size = [], 0
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
    Tensors are fresh copies (under ZeRO-3 the gathered storage is released after each group)."""
    params = list(module.named_parameters())
    if not zero3:
        for name, p in params:
            yield name, p.detach().to(dtype, copy=True)
        return
    import deepspeed

    for group in _groups(params, group_bytes):
        with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
            out = [(name, p.detach().to(dtype, copy=True)) for name, p in group]
        yield from out


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int
    checksum: str


@dataclass(frozen=True)
class WeightBucketData:
    """A dtype-homogeneous flat buffer of whole tensors, in order, with where each one lies."""
    index: int
    dtype: str
    flat: torch.Tensor
    tensors: tuple[TensorEntry, ...]

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def iter_weight_buckets(named: Iterator[tuple[str, torch.Tensor]], *, bucket_bytes: int,
                        checksums: bool = True) -> Iterator[WeightBucketData]:
    """Packs consecutive same-dtype tensors into flat buckets of at most `bucket_bytes` (a larger tensor
    gets a bucket of its own); a dtype change closes the bucket."""
    pending: list[tuple[str, torch.Tensor]] = []
    index = 0

    def flush() -> WeightBucketData:
        nonlocal index
        entries, offset = [], 0
        for name, t in pending:
            nbytes = t.numel() * t.element_size()
            entries.append(TensorEntry(name=name, dtype=dtype_name(t.dtype), shape=tuple(t.shape),
                                       offset_bytes=offset, nbytes=nbytes,
                                       checksum=tensor_checksum(t) if checksums else ""))
            offset += nbytes
        flat = torch.cat([t.reshape(-1) for _, t in pending])
        bucket = WeightBucketData(index=index, dtype=dtype_name(flat.dtype), flat=flat, tensors=tuple(entries))
        index += 1
        pending.clear()
        return bucket

    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if pending and (pending[0][1].dtype != t.dtype or size + nbytes > bucket_bytes):
            yield flush()
            size = 0
        pending.append((name, t))
        size += nbytes
    if pending:
        yield flush()

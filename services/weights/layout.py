"""Bucket layout of a weight sync: which tensor lives where, shared by every transport.

Buckets are dtype-homogeneous flat byte ranges of at most `bucket_bytes` (a larger tensor gets a bucket of
its own). Tensors of one dtype fill one open bucket at a time, so with interleaved dtypes (bf16 weights,
fp32 norms) one bucket per dtype is open. Bucket indices follow the position of each bucket's *last*
tensor in spec order: the publisher, consuming tensors in spec order, completes buckets exactly in index
order and can send each the moment it is full. The plan (protobuf) is the wire form of a layout;
`layout_from_plan` re-validates it on the receiving side because a plan comes from another process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from services.contracts.weight_plan import TensorMeta, WeightBucket, WeightSyncPlan

# torch dtype name (without "torch.") -> safetensors dtype code; also the set of dtypes a plan may carry.
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a plan/spec dtype name ("bfloat16", "float32", ...)."""
    name = name.removeprefix("torch.")
    if name not in SAFETENSORS_DTYPES:
        raise ValueError(f"unsupported weight dtype {name!r} (supported: {', '.join(SAFETENSORS_DTYPES)})")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor the trainer will publish (dtype as a name, e.g. "bfloat16")."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TensorSpec needs a non-empty name")
        object.__setattr__(self, "dtype", dtype_name(torch_dtype(self.dtype)))
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"TensorSpec {self.name!r}: negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)

    @classmethod
    def from_tensor(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch_dtype(self.dtype).itemsize


def specs_from_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec.from_tensor(name, t) for name, t in named_tensors]


@dataclass(frozen=True)
class Slot:
    """One tensor inside its bucket: `offset`/`nbytes` are byte positions in the bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    bucket: int


@dataclass(frozen=True)
class Bucket:
    index: int
    dtype: torch.dtype
    nbytes: int
    tensors: tuple[Slot, ...]

    @property
    def direct(self) -> bool:
        """A one-tensor bucket travels straight from/to the tensor: no staging buffer, no copy."""
        return len(self.tensors) == 1


@dataclass(frozen=True)
class Layout:
    buckets: tuple[Bucket, ...]
    order: tuple[Slot, ...]  # the order tensors arrive in (spec order on the publisher, bucket order else)
    total_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_bytes", sum(b.nbytes for b in self.buckets))

    @property
    def key(self) -> tuple[Bucket, ...]:
        """Identity for buffer reuse: two syncs with equal keys can share bucket buffers."""
        return self.buckets


def plan_layout(specs: Sequence[TensorSpec], *, bucket_bytes: int) -> Layout:
    """Assign specs to dtype-homogeneous buckets of at most `bucket_bytes` (see the module docstring)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    seen: set[str] = set()
    open_: dict[str, list[int]] = {}  # dtype -> spec indices of its open bucket
    open_bytes: dict[str, int] = {}
    closed: list[list[int]] = []
    for i, spec in enumerate(specs):
        if spec.name in seen:
            raise ValueError(f"tensor name {spec.name!r} appears twice in the weight specs")
        seen.add(spec.name)
        size = spec.nbytes
        if size > bucket_bytes:  # larger than a bucket: a bucket of its own
            closed.append([i])
            continue
        if spec.dtype in open_ and open_bytes[spec.dtype] + size > bucket_bytes:
            closed.append(open_.pop(spec.dtype))
            del open_bytes[spec.dtype]
        open_.setdefault(spec.dtype, []).append(i)
        open_bytes[spec.dtype] = open_bytes.get(spec.dtype, 0) + size
    closed.extend(open_.values())
    closed.sort(key=lambda members: members[-1])  # completion order = send order
    slots: dict[int, Slot] = {}
    buckets = []
    for index, members in enumerate(closed):
        offset, bucket_slots = 0, []
        for i in members:
            spec = specs[i]
            slot = Slot(
                name=spec.name,
                dtype=torch_dtype(spec.dtype),
                shape=spec.shape,
                offset=offset,
                nbytes=spec.nbytes,
                bucket=index,
            )
            slots[i] = slot
            bucket_slots.append(slot)
            offset += spec.nbytes
        buckets.append(
            Bucket(index=index, dtype=torch_dtype(specs[members[0]].dtype), nbytes=offset, tensors=tuple(bucket_slots))
        )
    return Layout(buckets=tuple(buckets), order=tuple(slots[i] for i in range(len(specs))))


def layout_to_buckets(layout: Layout) -> tuple[WeightBucket, ...]:
    return tuple(
        WeightBucket(
            index=b.index,
            dtype=dtype_name(b.dtype),
            nbytes=b.nbytes,
            tensors=tuple(
                TensorMeta(
                    name=s.name, dtype=dtype_name(s.dtype), shape=tuple(s.shape), offset_bytes=s.offset, nbytes=s.nbytes
                )
                for s in b.tensors
            ),
        )
        for b in layout.buckets
    )


def layout_from_plan(plan: WeightSyncPlan) -> Layout:
    """Rebuild and check a plan's layout: contiguous offsets, sizes that match shapes, one dtype a bucket."""
    where = f"weight sync plan v{plan.version}"
    names: set[str] = set()
    buckets = []
    for position, wb in enumerate(plan.buckets):
        if wb.index != position:
            raise ValueError(f"{where}: bucket #{position} has index {wb.index}")
        dtype = torch_dtype(wb.dtype)
        offset, slots = 0, []
        for meta in wb.tensors:
            shape = tuple(meta.shape)
            if meta.name in names or not meta.name:
                raise ValueError(f"{where}: tensor name {meta.name!r} is empty or repeated")
            names.add(meta.name)
            if torch_dtype(meta.dtype) != dtype:
                raise ValueError(f"{where}: tensor {meta.name!r} is {meta.dtype} in a {wb.dtype} bucket")
            if any(d < 0 for d in shape) or meta.nbytes != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{where}: tensor {meta.name!r} shape {shape} does not match {meta.nbytes} bytes")
            if meta.offset_bytes != offset:
                raise ValueError(f"{where}: tensor {meta.name!r} at offset {meta.offset_bytes}, expected {offset}")
            slots.append(
                Slot(name=meta.name, dtype=dtype, shape=shape, offset=offset, nbytes=meta.nbytes, bucket=position)
            )
            offset += meta.nbytes
        if offset != wb.nbytes or not slots:
            raise ValueError(
                f"{where}: bucket {position} holds {offset} bytes in {len(slots)} tensors, announces {wb.nbytes}"
            )
        buckets.append(Bucket(index=position, dtype=dtype, nbytes=offset, tensors=tuple(slots)))
    layout = Layout(buckets=tuple(buckets), order=tuple(s for b in buckets for s in b.tensors))
    if plan.total_bytes and plan.total_bytes != layout.total_bytes:
        raise ValueError(f"{where}: announces {plan.total_bytes} bytes, its buckets hold {layout.total_bytes}")
    return layout


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor as a flat CPU uint8 tensor (C order, the machine's little-endian layout)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8)


def check_params(layout: Layout, params: Mapping[str, torch.Tensor]) -> list[str]:
    """Every planned tensor must exist in `params` with the same shape and dtype; returns the mismatches."""
    problems = []
    for slot in layout.order:
        target = params.get(slot.name)
        if target is None:
            problems.append(f"{slot.name}: missing (plan: {dtype_name(slot.dtype)} {list(slot.shape)})")
        elif target.dtype != slot.dtype or tuple(target.shape) != slot.shape:
            problems.append(
                f"{slot.name}: have {dtype_name(target.dtype)} {list(target.shape)}, "
                f"plan sends {dtype_name(slot.dtype)} {list(slot.shape)}"
            )
    return problems


def iter_validated(
    layout: Layout, named_tensors: Iterable[tuple[str, torch.Tensor]], *, where: str
) -> Iterator[tuple[Slot, torch.Tensor]]:
    """Pair incoming tensors with the plan in spec order; a clear ValueError on any deviation."""
    iterator = iter(named_tensors)
    for i, slot in enumerate(layout.order):
        item = next(iterator, None)
        if item is None:
            raise ValueError(f"{where}: got {i} tensors, the plan has {len(layout.order)} (next: {slot.name!r})")
        name, tensor = item
        if name != slot.name or tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
            raise ValueError(
                f"{where}: tensor #{i} is {name!r} {dtype_name(tensor.dtype)} {list(tensor.shape)}, "
                f"the plan expects {slot.name!r} {dtype_name(slot.dtype)} {list(slot.shape)}"
            )
        yield slot, tensor
    extra = next(iterator, None)
    if extra is not None:
        raise ValueError(f"{where}: more tensors than the {len(layout.order)} planned (first extra: {extra[0]!r})")

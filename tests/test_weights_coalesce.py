"""Coalesced copies of the cuda_ipc transport (CPU tensors, no CUDA needed): flat_views lays params out like
the buckets, and _Runs merges copies exactly when source and destination bytes both continue."""

from __future__ import annotations

import functools

import torch
from helpers.weight_peer import bits_equal, make_tensors

from services.contracts.weight_plan import CudaIpcHandle, WeightBucket, WeightSyncPlan
from services.weights.layout import TensorSpec, plan_layout
from services.weights.transports.cuda_ipc import (
    ALIGN,
    CudaIpcReceiver,
    FlatParams,
    _recipe,
    _Runs,
    _typed,
    bucket_starts,
    flat_spans,
    flat_views,
)

SPECS = (
    [TensorSpec("embed", "bfloat16", (64, 33))]
    + [
        s
        for i in range(3)
        for s in (TensorSpec(f"l{i}.norm", "float32", (7,)), TensorSpec(f"l{i}.w", "bfloat16", (33, 16)))
    ]
    + [TensorSpec("step", "int64", ())]
)


def _fill_buckets(layout, tensors):
    starts, total = bucket_starts(layout)
    buffer = torch.zeros(total, dtype=torch.uint8)
    for slot in layout.order:
        _typed(buffer[starts[slot.bucket] :], slot).copy_(tensors[slot.name])
    return buffer, starts


def test_flat_receiver_gets_one_copy_per_bucket_and_identical_bits():
    layout = plan_layout(SPECS, bucket_bytes=4096)
    tensors = make_tensors(SPECS, seed=5)
    buffer, starts = _fill_buckets(layout, tensors)
    assert all(s % ALIGN == 0 for s in starts)
    flat, params = flat_views(layout, "cpu")
    runs = _Runs()
    for bucket, start in zip(layout.buckets, starts, strict=True):
        for slot in bucket.tensors:
            runs.add(params[slot.name], _typed(buffer[start:], slot))
        runs.flush()
    assert runs.copies == len(layout.buckets)
    assert all(bits_equal(params[n], t) for n, t in tensors.items())
    assert {p.untyped_storage().data_ptr() for p in params.values()} == {flat.untyped_storage().data_ptr()}


def test_separate_or_strided_targets_fall_back_to_one_copy_each():
    layout = plan_layout(SPECS, bucket_bytes=4096)
    tensors = make_tensors(SPECS, seed=6)
    buffer, starts = _fill_buckets(layout, tensors)
    params = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in SPECS}
    params["embed"] = torch.zeros(33, 64, dtype=torch.bfloat16).t()  # not contiguous
    runs = _Runs()
    for bucket, start in zip(layout.buckets, starts, strict=True):
        for slot in bucket.tensors:
            runs.add(params[slot.name], _typed(buffer[start:], slot))
        runs.flush()
    assert runs.copies == len(SPECS)
    assert all(torch.equal(params[n], t) for n, t in tensors.items())


def test_flat_source_in_spec_order_fills_each_bucket_with_one_copy():
    specs = [TensorSpec(f"w{i}", "bfloat16", (15, 8)) for i in range(10)]
    layout = plan_layout(specs, bucket_bytes=4 * 240)  # 4 tensors a bucket: 3 buckets, with gaps
    source = torch.randn(10 * 120).to(torch.bfloat16)
    named = [(s.name, source[i * 120 : (i + 1) * 120].view(15, 8)) for i, s in enumerate(specs)]
    starts, total = bucket_starts(layout)
    buffer = torch.zeros(total, dtype=torch.uint8)
    runs = _Runs()
    for slot, (_, tensor) in zip(layout.order, named, strict=True):
        runs.add(_typed(buffer[starts[slot.bucket] :], slot), tensor)
    runs.flush()
    assert runs.copies == len(layout.buckets) == 3
    for slot, (_, tensor) in zip(layout.order, named, strict=True):
        assert bits_equal(_typed(buffer[starts[slot.bucket] :], slot), tensor)


def test_receiver_recipe_merges_flat_params_only():
    layout = plan_layout(SPECS, bucket_bytes=4096)
    _, flat = flat_views(layout, "cpu")
    recipe = _recipe(layout, flat)
    assert len(recipe) == len(layout.buckets) and all(
        merged or len(layout.buckets[i].tensors) == 1 for i, _, _, merged in recipe
    )
    assert [n for _, _, n, _ in recipe] == [b.nbytes for b in layout.buckets]
    separate = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in SPECS}
    assert [(slot.name, merged) for _, slot, _, merged in _recipe(layout, separate)] == [
        (slot.name, False) for b in layout.buckets for slot in b.tensors
    ]


def test_flat_spans_merge_buckets_at_the_same_distance_in_one_allocation():
    starts = [0, 256, 768]
    one = flat_spans(sizes=[200, 500, 10], dst_starts=starts, sources=[("a", 1000), ("a", 1256), ("a", 1768)])
    assert one == [("a", 1000, 0, 778)]  # the padding between buckets rides along
    moved = flat_spans(sizes=[200, 500, 10], dst_starts=starts, sources=[("a", 1000), ("a", 1300), ("b", 0)])
    assert moved == [("a", 1000, 0, 200), ("a", 1300, 256, 500), ("b", 0, 768, 10)]
    assert flat_spans(sizes=[0, 8], dst_starts=[0, 0], sources=[("a", 0), ("a", 0)]) == [("a", 0, 0, 8)]


def test_flat_views_is_flat_params_only_with_every_slot():
    layout = plan_layout(SPECS, bucket_bytes=4096)
    flat, params = flat_views(layout, "cpu")
    assert isinstance(params, FlatParams) and params.flat is flat and params.layout_key == layout.key
    _, some = flat_views(layout, "cpu", names={"embed"})
    assert not isinstance(some, FlatParams) and list(some) == ["embed"]


def _ipc_plan(layout, offsets, handles):
    handle_of = functools.partial(
        CudaIpcHandle,
        device=0,
        ref_counter_handle=b"",
        ref_counter_offset=0,
        event_handle=b"",
        event_sync_required=False,
        device_uuid="",
    )
    buckets = tuple(
        WeightBucket(
            index=bucket.index,
            dtype="uint8",
            nbytes=bucket.nbytes,
            ipc=handle_of(handle=handle, storage_offset_bytes=offset, storage_size_bytes=bucket.nbytes),
        )
        for bucket, offset, handle in zip(layout.buckets, offsets, handles, strict=True)
    )
    return WeightSyncPlan(version=0, transport="cuda_ipc", buckets=buckets)


def _run(copies: list) -> int:
    for dst, src in copies:
        dst.copy_(src)
    return len(copies)


def test_flat_params_receive_whole_spans_with_identical_bits():
    """The receiver's FlatParams path over CPU stand-ins for the mapped allocations: one copy when the sender's
    buckets share one allocation at the same starts, one per allocation otherwise."""
    layout = plan_layout(SPECS, bucket_bytes=4096)
    tensors = make_tensors(SPECS, seed=7)
    buffer, starts = _fill_buckets(layout, tensors)
    lo = 512  # the allocation view starts at byte lo of it
    allocation = torch.cat([torch.zeros(lo + 100, dtype=torch.uint8), buffer])
    plan = _ipc_plan(layout, [lo + 100 + s for s in starts], [b"A"] * len(starts))
    flat, params = flat_views(layout, "cpu")
    copies = _run(CudaIpcReceiver._flat_copies(plan, layout, flat, {(0, b"A"): (lo, allocation[lo:])}))
    assert copies == 1 and all(bits_equal(params[n], t) for n, t in tensors.items())

    second = torch.zeros(buffer.numel(), dtype=torch.uint8)  # the last bucket lives in another allocation
    last = starts[-1]
    second[: buffer.numel() - last] = buffer[last:]
    plan = _ipc_plan(layout, [100 + s for s in starts[:-1]] + [0], [b"A"] * (len(starts) - 1) + [b"B"])
    flat, params = flat_views(layout, "cpu")
    copies = _run(
        CudaIpcReceiver._flat_copies(plan, layout, flat, {(0, b"A"): (0, allocation[lo:]), (0, b"B"): (0, second)})
    )
    assert copies == 2 and all(bits_equal(params[n], t) for n, t in tensors.items())

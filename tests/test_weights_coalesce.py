"""Coalesced copies of the cuda_ipc transport (CPU tensors, no CUDA needed): flat_views lays params out like
the buckets, and _Runs merges copies exactly when source and destination bytes both continue."""

from __future__ import annotations

import torch

from services.common.weights.cuda_ipc import ALIGN, _recipe, _Runs, _typed, bucket_starts, flat_views
from services.common.weights.layout import TensorSpec, plan_layout
from services.common.weights.peer import bits_equal, make_tensors

SPECS = ([TensorSpec("embed", "bfloat16", (64, 33))]
         + [s for i in range(3) for s in (TensorSpec(f"l{i}.norm", "float32", (7,)),
                                          TensorSpec(f"l{i}.w", "bfloat16", (33, 16)))]
         + [TensorSpec("step", "int64", ())])


def _fill_buckets(layout, tensors):  # noqa: ANN001, ANN202 - the sender's side: a staged buffer per layout
    starts, total = bucket_starts(layout)
    buffer = torch.zeros(total, dtype=torch.uint8)
    for slot in layout.order:
        _typed(buffer[starts[slot.bucket]:], slot).copy_(tensors[slot.name])
    return buffer, starts


def test_flat_receiver_gets_one_copy_per_bucket_and_identical_bits():
    layout = plan_layout(SPECS, bucket_bytes=4096)
    tensors = make_tensors(SPECS, seed=5)
    buffer, starts = _fill_buckets(layout, tensors)
    assert all(s % ALIGN == 0 for s in starts)
    flat, params = flat_views(layout, "cpu")
    runs = _Runs()
    for bucket, start in zip(layout.buckets, starts):
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
    params["embed"] = torch.zeros(33, 64, dtype=torch.bfloat16).t()              # not contiguous
    runs = _Runs()
    for bucket, start in zip(layout.buckets, starts):
        for slot in bucket.tensors:
            runs.add(params[slot.name], _typed(buffer[start:], slot))
        runs.flush()
    assert runs.copies == len(SPECS)
    assert all(torch.equal(params[n], t) for n, t in tensors.items())


def test_flat_source_in_spec_order_fills_each_bucket_with_one_copy():
    specs = [TensorSpec(f"w{i}", "bfloat16", (15, 8)) for i in range(10)]
    layout = plan_layout(specs, bucket_bytes=4 * 240)                 # 4 tensors a bucket: 3 buckets, with gaps
    source = torch.randn(10 * 120).to(torch.bfloat16)
    named = [(s.name, source[i * 120:(i + 1) * 120].view(15, 8)) for i, s in enumerate(specs)]
    starts, total = bucket_starts(layout)
    buffer = torch.zeros(total, dtype=torch.uint8)
    runs = _Runs()
    for slot, (_, tensor) in zip(layout.order, named):
        runs.add(_typed(buffer[starts[slot.bucket]:], slot), tensor)
    runs.flush()
    assert runs.copies == len(layout.buckets) == 3
    for slot, (_, tensor) in zip(layout.order, named):
        assert bits_equal(_typed(buffer[starts[slot.bucket]:], slot), tensor)


def test_receiver_recipe_merges_flat_params_only():
    layout = plan_layout(SPECS, bucket_bytes=4096)
    _, flat = flat_views(layout, "cpu")
    recipe = _recipe(layout, flat)
    assert len(recipe) == len(layout.buckets) and all(merged or len(layout.buckets[i].tensors) == 1
                                                      for i, _, _, merged in recipe)
    assert [n for _, _, n, _ in recipe] == [b.nbytes for b in layout.buckets]
    separate = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in SPECS}
    assert [(slot.name, merged) for _, slot, _, merged in _recipe(layout, separate)] == \
        [(slot.name, False) for b in layout.buckets for slot in b.tensors]

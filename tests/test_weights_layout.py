"""Bucketing layout, plan validation, checksums and the front ends' checks (no processes)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.contracts.config import DiskWeights
from services.contracts.convert import from_message, to_message
from services.contracts.gen.tandem.v1 import common_pb2
from services.contracts.weight_plan import WeightSyncPlan
from services.weights import (
    TensorSpec,
    WeightPublisher,
    WeightReceiver,
    WeightSyncRefused,
    check_params,
    layout_from_plan,
    plan_layout,
    tensor_checksum,
)
from services.weights.layout import layout_to_buckets

KB = 1024


def _specs() -> list[TensorSpec]:
    return [
        TensorSpec("embed", "bfloat16", (64, 64)),  # 8 KB
        TensorSpec("norm0", "float32", (64,)),  # 256 B
        TensorSpec("w0", "bfloat16", (32, 64)),  # 4 KB
        TensorSpec("w1", "bfloat16", (32, 64)),  # 4 KB
        TensorSpec("huge", "bfloat16", (128, 128)),  # 32 KB > bucket
        TensorSpec("norm1", "float32", (64,)),
        TensorSpec("w2", "bfloat16", (32, 64)),
        TensorSpec("step", "int64", ()),
        TensorSpec("empty", "float32", (0, 4)),
    ]


def test_buckets_are_dtype_homogeneous_bounded_and_contiguous():
    layout = plan_layout(_specs(), bucket_bytes=10 * KB)
    for bucket in layout.buckets:
        assert {s.dtype for s in bucket.tensors} == {bucket.dtype}
        assert bucket.nbytes <= 10 * KB or bucket.direct
        offset = 0
        for slot in bucket.tensors:
            assert slot.offset == offset and slot.bucket == bucket.index
            offset += slot.nbytes
        assert offset == bucket.nbytes
    assert [s.name for s in layout.order] == [s.name for s in _specs()]
    assert layout.total_bytes == sum(s.nbytes for s in _specs())


def test_tensor_larger_than_a_bucket_gets_its_own():
    layout = plan_layout(_specs(), bucket_bytes=10 * KB)
    huge = next(b for b in layout.buckets if any(s.name == "huge" for s in b.tensors))
    assert [s.name for s in huge.tensors] == ["huge"] and huge.nbytes == 32 * KB and huge.direct


def test_bucket_indices_follow_completion_order():
    """Streaming tensors in spec order completes buckets exactly in index order (what the sender relies on)."""
    layout = plan_layout(_specs(), bucket_bytes=10 * KB)
    left = {b.index: len(b.tensors) for b in layout.buckets}
    completed = []
    for slot in layout.order:
        left[slot.bucket] -= 1
        if left[slot.bucket] == 0:
            completed.append(slot.bucket)
    assert completed == list(range(len(layout.buckets)))
    # embed (8K) + w0 (4K) overflow 10K: w0 opens a second bf16 bucket while norm0's fp32 bucket stays open
    names = [[s.name for s in b.tensors] for b in layout.buckets]
    assert ["embed"] in names and ["w0", "w1"] in names and ["norm0", "norm1", "empty"] in names


def test_plan_round_trip_and_validation():
    layout = plan_layout(_specs(), bucket_bytes=10 * KB)
    plan = WeightSyncPlan(
        version=3, transport="gloo", buckets=layout_to_buckets(layout), total_bytes=layout.total_bytes
    )
    wire = common_pb2.WeightSyncPlan.FromString(to_message(plan, common_pb2.WeightSyncPlan).SerializeToString())
    again = layout_from_plan(from_message(wire, WeightSyncPlan))
    assert again.buckets == layout.buckets

    def first_tensor_of(bucket: int, **changes: object) -> WeightSyncPlan:
        """`plan` with its bucket's first tensor changed."""
        b = plan.buckets[bucket]
        changed = replace(b, tensors=(replace(b.tensors[0], **changes), *b.tensors[1:]))  # type: ignore[arg-type]
        return replace(plan, buckets=tuple(changed if i == bucket else x for i, x in enumerate(plan.buckets)))

    with pytest.raises(ValueError, match="offset"):
        layout_from_plan(first_tensor_of(0, offset_bytes=8))
    with pytest.raises(ValueError, match="bucket"):
        layout_from_plan(first_tensor_of(1, dtype="int32"))
    with pytest.raises(ValueError, match="does not match"):
        layout_from_plan(first_tensor_of(0, nbytes=plan.buckets[0].tensors[0].nbytes + 2))


def test_specs_reject_duplicates_and_unknown_dtypes():
    with pytest.raises(ValueError, match="twice"):
        plan_layout([TensorSpec("a", "float32", (1,)), TensorSpec("a", "float32", (1,))], bucket_bytes=KB)
    with pytest.raises(ValueError, match="unsupported weight dtype"):
        TensorSpec("a", "complex64", (1,))
    as_json = [2, 3]  # a shape as JSON gives it: a list
    assert TensorSpec("a", "torch.bfloat16", as_json) == TensorSpec("a", "bfloat16", (2, 3))  # type: ignore[arg-type]


def test_checksum_is_bit_exact():
    x = torch.randn(64, 32, dtype=torch.float32)
    assert tensor_checksum(x) == tensor_checksum(x.clone())
    assert tensor_checksum(x.t().contiguous().t()) == tensor_checksum(x)  # layout-independent: C-order bytes
    flipped = x.clone()
    flipped.view(torch.int32)[3, 4] ^= 1  # one low mantissa bit
    assert tensor_checksum(flipped) != tensor_checksum(x)
    assert tensor_checksum(torch.tensor(0.0)) != tensor_checksum(torch.tensor(-0.0))
    nan_a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan_b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert tensor_checksum(nan_a) != tensor_checksum(nan_b)
    b = torch.randn(7, 5).to(torch.bfloat16)
    assert tensor_checksum(b) == tensor_checksum(b.clone()) and len(tensor_checksum(b)) == 32
    assert tensor_checksum(torch.empty(0, 3)) == tensor_checksum(torch.empty(0, 5))
    swapped = x.clone().view(-1)
    swapped[[5, 9]] = swapped[[9, 5]]  # two words trade places
    assert tensor_checksum(swapped.view(64, 32)) != tensor_checksum(x)
    odd = torch.arange(3, dtype=torch.uint8)  # not a whole number of words
    assert tensor_checksum(odd) != tensor_checksum(torch.arange(4, dtype=torch.uint8))


def test_checksums_of_many_tensors_match_one_at_a_time_and_span_chunks(monkeypatch):
    from services.weights import checksums

    monkeypatch.setattr(checksums, "_CHECKSUM_CHUNK_WORDS", 7)  # several chunks per tensor
    tensors = [torch.randn(5, 11), torch.randn(3).to(torch.bfloat16), torch.randint(0, 9, (13,))]
    many = checksums.tensor_checksums(tensors)
    assert many == [tensor_checksum(t) for t in tensors]
    assert checksums.named_checksums(zip("abc", tensors, strict=True)) == dict(zip("abc", many, strict=True))
    monkeypatch.setattr(checksums, "_CHECKSUM_CHUNK_WORDS", 1 << 24)
    assert checksums.tensor_checksums(tensors) == many  # chunking does not change it


def _reference_checksum(tensor: torch.Tensor) -> str:
    """The definition in plain Python: the bytes as little-endian signed 32-bit words (zero-padded), their sum and
    their 1-based position-weighted sum, modulo 2**64."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).tolist()
    raw += [0] * (-len(raw) % 4)
    words = [int.from_bytes(bytes(raw[i : i + 4]), "little", signed=True) for i in range(0, len(raw), 4)]
    mask = (1 << 64) - 1
    return f"{sum(words) & mask:016x}{sum((i + 1) * w for i, w in enumerate(words)) & mask:016x}"


def test_packed_checksums_equal_the_definition_for_every_tensor_and_pack_size(monkeypatch):
    """Packs (prefix sums over concatenated tensors) against the definition, for tensors that fill, straddle and
    exceed a pack, empty ones, odd byte counts and views at offsets that are not word-aligned."""
    from services.weights import checksums

    gen = torch.Generator().manual_seed(3)
    base = torch.randn(101, generator=gen).to(torch.bfloat16)
    tensors = [
        torch.randn(5, 11, generator=gen),
        base[1:8],
        torch.empty(0),
        torch.randint(-9, 9, (13,)),
        torch.randn(2, 3, generator=gen).to(torch.float64),
        torch.arange(3, dtype=torch.uint8),
        base[8:40],
        torch.full((6,), float("nan")),
        torch.tensor(-0.0),
    ]
    expected = [_reference_checksum(t) for t in tensors]
    for chunk in (1, 4, 7, 40, 1 << 24):
        monkeypatch.setattr(checksums, "_CHECKSUM_CHUNK_WORDS", chunk)
        assert checksums.tensor_checksums(tensors) == expected, chunk
        assert checksums.named_checksums(zip(map(str, range(len(tensors))), tensors, strict=True)) == dict(
            zip(map(str, range(len(tensors))), expected, strict=True)
        )
    assert checksums.tensor_checksums([torch.empty(0), torch.empty(0, 3)]) == [_reference_checksum(torch.empty(0))] * 2


def test_checksums_of_many_tensors_issue_as_many_ops_as_of_a_few():
    """The ops do not grow with the tensor count (a sync of 291 tensors verified in ~2.3k launches before)."""
    from torch.profiler import ProfilerActivity, profile

    from services.weights import checksums

    def ops(count: int) -> int:
        tensors = [torch.randn(64) for _ in range(count)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            checksums.tensor_checksums(tensors)
        work = {"aten::cat", "aten::cumsum", "aten::mul", "aten::_to_copy", "aten::index", "aten::where", "aten::sum"}
        return sum(e.name in work for e in prof.events())

    assert ops(300) == ops(3)


def test_check_params_lists_every_mismatch():
    layout = plan_layout(_specs(), bucket_bytes=10 * KB)
    params = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in _specs()}
    assert check_params(layout, params) == []
    del params["w1"]
    params["w2"] = torch.zeros(64, 32, dtype=torch.bfloat16)
    params["norm0"] = torch.zeros(64, dtype=torch.float16)
    problems = check_params(layout, params)
    assert len(problems) == 3 and any("w1: missing" in p for p in problems)
    assert any("w2" in p and "[64, 32]" in p for p in problems)
    assert any("norm0" in p and "float16" in p for p in problems)


def _disk_publisher(tmp_path: Path, timeout_s: float = 2.0) -> WeightPublisher:
    return WeightPublisher(
        config=DiskWeights(bucket_mb=0.01, timeout_s=timeout_s), run_dir=tmp_path, trainer_id="actor-0"
    )


def test_receiver_refuses_mismatched_params_before_anything(tmp_path: Path):
    plan = _disk_publisher(tmp_path).prepare(_specs(), 1, 1, False)
    params = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in _specs()[1:]}
    params["w0"] = torch.zeros(3)
    started = time.monotonic()
    with pytest.raises(
        ValueError,
        match=r"disk weight sync v1 .*2 problem\(s\).*embed: missing.*"
        r"w0: have float32 \[3\]",
    ):
        WeightReceiver().receive(plan, 1, params)
    assert time.monotonic() - started < 1.0  # refused up front, not after waiting for the files


def test_receiver_accepts_only_its_trainer(tmp_path: Path):
    plan = _disk_publisher(tmp_path).prepare(_specs(), 1, 1, False)
    params = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in _specs()}
    with pytest.raises(WeightSyncRefused, match="'actor-0' is not the accepted trainer 'actor-9'"):
        WeightReceiver(accepted_trainer_id="actor-9").receive(plan, 1, params)


def test_publish_validates_names_shapes_dtypes(tmp_path: Path):
    publisher = _disk_publisher(tmp_path)
    plan = publisher.prepare(_specs(), 2, 1, False)
    tensors = [(s.name, torch.zeros(s.shape, dtype=getattr(torch, s.dtype))) for s in _specs()]
    tensors[2] = ("w0", torch.zeros(32, 64, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"tensor #2 is 'w0' float32 \[32, 64\], the plan expects 'w0' bfloat16"):
        publisher.publish(plan, tensors)
    with pytest.raises(ValueError, match="got 3 tensors, the plan has 9"):
        publisher.publish(plan, [(s.name, torch.zeros(s.shape, dtype=getattr(torch, s.dtype))) for s in _specs()[:3]])
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == []  # no half-written version left
    other = publisher.prepare(_specs()[:2], 3, 1, False)
    with pytest.raises(ValueError, match="latest prepare"):
        publisher.publish(plan, tensors)
    assert other.version == 3

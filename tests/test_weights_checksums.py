"""Bucket checksums (services/weights/checksums.py): the definition in plain Python against the torch sums, the
view of a bucket where its tensors lie back to back against a concatenation, and the corruptions they catch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from services.weights import checksums
from services.weights.checksums import BucketSums, bucket_checksums, describe_bucket, named_bucket_checksums
from services.weights.layout import Layout, TensorSpec, plan_layout
from services.weights.transports.cuda_ipc import flat_views

MASK = (1 << 64) - 1
SPECS = [
    TensorSpec("embed", "bfloat16", (40, 16)),
    TensorSpec("norm", "float32", (16,)),
    TensorSpec("odd", "bfloat16", (7,)),
    TensorSpec("w", "bfloat16", (16, 16)),
    TensorSpec("none", "bfloat16", (0,)),
    TensorSpec("bytes", "uint8", (5,)),
    TensorSpec("big", "float32", (600,)),
]


def _reference(data: bytes, block: int) -> str:
    """The definition: little-endian int32 words (the last zero-padded), s0 = sum, s1 = sum (i+1) w_i, s2 = sum over
    blocks of splitmix64(block index) times the block's sum, all modulo 2**64."""
    data += bytes(-len(data) % 4)
    words = [int.from_bytes(data[i : i + 4], "little", signed=True) for i in range(0, len(data), 4)]

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    s0 = sum(words) & MASK
    s1 = sum((i + 1) * w for i, w in enumerate(words)) & MASK
    s2 = sum(mix(b) * sum(words[b * block : (b + 1) * block]) for b in range(-(-len(words) // block))) & MASK
    return f"{s0:016x}{s1:016x}{s2:016x}"


def _bytes_of(layout: Layout, tensors: dict[str, torch.Tensor], index: int) -> bytes:
    return b"".join(
        bytes(tensors[s.name].contiguous().reshape(-1).view(torch.uint8).tolist())
        for s in layout.buckets[index].tensors
    )


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for spec in SPECS:
        dtype = getattr(torch, spec.dtype)
        values = (
            torch.randint(0, 255, spec.shape, generator=gen)
            if dtype == torch.uint8
            else torch.randn(spec.shape, generator=gen)
        )
        out[spec.name] = values.to(dtype)
    return out


@pytest.fixture(params=[4, 1024], ids=["blocks_of_4", "blocks_of_1024"])
def block(request, monkeypatch):
    monkeypatch.setattr(checksums, "BLOCK_WORDS", request.param)  # small blocks: many blocks and partial ones
    return request.param


def test_bucket_checksums_equal_the_definition_for_separate_tensors_and_for_one_flat_buffer(block):
    layout = plan_layout(SPECS, bucket_bytes=1200)
    tensors = _tensors()
    expected = [_reference(_bytes_of(layout, tensors, b.index), block) for b in layout.buckets]
    assert len(layout.buckets) > 3 and any(b.nbytes % 4 for b in layout.buckets)  # partial words covered
    assert bucket_checksums(layout, tensors) == expected  # concatenated per bucket
    _flat, views = flat_views(layout, "cpu")  # a native engine's FlatParams
    for name, view in views.items():
        view.copy_(tensors[name])
    assert bucket_checksums(layout, views) == expected  # at the buckets' starts
    assert bucket_checksums(layout, dict(views)) == expected  # found to lie back to back
    assert named_bucket_checksums(layout, ((s.name, tensors[s.name]) for s in SPECS), where="test") == expected


def test_a_bucket_at_an_odd_offset_of_a_flat_buffer_is_summed_from_a_copy(block):
    """A trainer's flat bf16 buffer: a bucket may start at an odd element, which no int32 view can take."""
    specs = [TensorSpec("a", "bfloat16", (3,)), TensorSpec("b", "bfloat16", (9,))]
    layout = plan_layout(specs, bucket_bytes=10)  # a in one bucket, b in another
    flat = torch.randn(12).to(torch.bfloat16)
    views = {"a": flat[:3], "b": flat[3:]}  # b starts 6 bytes in
    assert bucket_checksums(layout, views) == bucket_checksums(layout, {n: v.clone() for n, v in views.items()})


def _changed(layout: Layout, tensors: dict[str, torch.Tensor], edit) -> list[str]:
    _flat, views = flat_views(layout, "cpu")
    for name, view in views.items():
        view.copy_(tensors[name])
    edit(views)
    return bucket_checksums(layout, views)


def test_a_flipped_bit_swapped_words_and_a_tensor_at_the_wrong_offset_change_only_their_bucket(block):
    layout = plan_layout(SPECS, bucket_bytes=1 << 20)  # one bucket per dtype
    tensors = _tensors(seed=1)
    clean = bucket_checksums(layout, tensors)
    bf16 = next(b.index for b in layout.buckets if b.dtype == torch.bfloat16)

    def flip(views):
        views["w"].view(torch.int16)[3, 4] ^= 1  # one low mantissa bit

    def swap(views):
        words = views["embed"].view(-1).view(torch.int32)
        words[[2, 150]] = words[[150, 2]]  # two words trade places, far apart

    def swap_near(views):
        words = views["embed"].view(-1).view(torch.int32)
        words[[0, 1]] = words[[1, 0]]  # neighbours, inside one block

    def shift(views):
        w = views["w"].reshape(-1)
        w[2:] = tensors["w"].reshape(-1)[:-2].clone()  # w written one word later than planned

    for edit in (flip, swap, swap_near, shift):
        got = _changed(layout, tensors, edit)
        assert got[bf16] != clean[bf16], edit.__name__
        assert [c for i, c in enumerate(got) if i != bf16] == [c for i, c in enumerate(clean) if i != bf16]


def test_changes_that_cancel_in_both_word_sums_still_change_the_block_sum():
    """+1, -2, +1 at the same place of three blocks keeps s0 and s1 (1 - 2 + 1 = 0, 1*1 - 2*5 + 1*9 = 0); the
    blocks' weights (s2) are not linear in the block index, so it changes."""
    layout = plan_layout([TensorSpec("x", "int32", (3 * checksums.BLOCK_WORDS,))], bucket_bytes=1 << 20)
    clean = {"x": torch.zeros(3 * checksums.BLOCK_WORDS, dtype=torch.int32)}
    changed = {"x": clean["x"].clone()}
    changed["x"][[0, checksums.BLOCK_WORDS, 2 * checksums.BLOCK_WORDS]] = torch.tensor([1, -2, 1], dtype=torch.int32)
    [before], [after] = bucket_checksums(layout, clean), bucket_checksums(layout, changed)
    assert before[:32] == after[:32] and before != after


def test_buckets_of_many_tensors_that_lie_back_to_back_issue_as_many_ops_as_of_a_few():
    """Tensors found to lie back to back are summed where they lie: the ops grow with the buckets, not the
    tensors."""
    from torch.profiler import ProfilerActivity, profile

    def ops(count: int) -> int:
        layout = plan_layout([TensorSpec(f"t{i}", "float32", (64,)) for i in range(count)], bucket_bytes=1 << 20)
        _flat, views = flat_views(layout, "cpu")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            bucket_checksums(layout, dict(views))  # a plain mapping: the tensors are looked at
        return sum(e.name in {"aten::sum", "aten::cat", "aten::mul", "aten::add_"} for e in prof.events())

    assert ops(200) == ops(2)


def test_a_mismatch_names_the_bucket_its_dtype_size_and_tensors():
    layout = plan_layout(SPECS, bucket_bytes=1 << 20)
    bucket = next(b for b in layout.buckets if b.dtype == torch.bfloat16)
    assert describe_bucket(bucket) == (
        f"bucket {bucket.index} (bfloat16, {bucket.nbytes / 2**20:.1f} MiB: embed, odd, w and 1 more)"
    )
    assert BucketSums(plan_layout([], bucket_bytes=1)).hex() == []


# The one-pass kernel (bucket_kernel, Triton) against the torch path, on CPU through Triton's interpreter; where
# triton is not installed (CI's CPU wheel) this skips, and tests/test_weights_checksums_gpu.py runs it on a GPU.
KERNEL_VS_TORCH = textwrap.dedent("""
    import sys, torch
    from services.weights import bucket_kernel, checksums
    from services.weights.layout import TensorSpec, plan_layout
    gen = torch.Generator().manual_seed(5)
    for block in (4, 1024):
        checksums.BLOCK_WORDS = block
        for count in (1, 3, 4, 5, 33, 1023, 1024, 1025, 8 * 1024 + 7, 20000):
            layout = plan_layout([TensorSpec("x", "int16", (2 * count + 1,))], bucket_bytes=1 << 30)   # + a half word
            tensors = {"x": torch.randint(-2**15, 2**15 - 1, (2 * count + 1,), dtype=torch.int16, generator=gen)}
            bucket_kernel.usable = lambda words: False
            torch_path = checksums.bucket_checksums(layout, tensors)
            bucket_kernel.usable = lambda words: True
            kernel = checksums.bucket_checksums(layout, tensors)
            if kernel != torch_path:
                sys.exit(f"block {block}, {count} words: kernel {kernel} != torch {torch_path}")
    print("equal")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package (its interpreter)")
def test_the_one_pass_kernel_computes_the_torch_paths_sums_in_tritons_interpreter():
    done = subprocess.run(
        [sys.executable, "-c", KERNEL_VS_TORCH],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0 and done.stdout == "equal\n", done.stderr[-3000:]

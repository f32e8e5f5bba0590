"""The bucket checksum's three sums in one pass over a bucket's int32 words (Triton, on a CUDA device).

Torch's reductions sum int32 words into int64 by casting them first: a copy of 8 bytes per word that the sum then
reads, twice for the two reductions of `checksums.BucketSums`' torch path, ~40 bytes of traffic per 4-byte word. Here
each program loads its words once, widens them in registers and accumulates s0 = sum w_i, s1 = sum (i+1) w_i and
s2 = sum h(block) w_i (= sum over blocks of h(block) times the block's sum) in int64, wrapping like the torch path;
a torch sum over the programs' partial sums follows. The result is the same three numbers as the torch path
(checksums.py's definition), which tests/test_weights_checksums*.py check (on CPU through Triton's interpreter,
TRITON_INTERPRET=1, where triton is installed).

The splitmix64 constants of h live here, for both paths.
"""

from __future__ import annotations

import importlib.util

import torch


def _int64(value: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch and Triton integer scalars are signed)."""
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN, MIX1, MIX2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)
SHIFTS = (30, 27, 31)
_BLOCKS_PER_PROGRAM = 8  # blocks of words one program sums (32 KB of int32 words at 1024-word blocks)

AVAILABLE = importlib.util.find_spec("triton") is not None


def usable(words: torch.Tensor) -> bool:
    """The kernel runs on CUDA tensors, where Triton is installed (CPU tensors take the torch path)."""
    return AVAILABLE and words.is_cuda and words.numel() > 0


def word_sums(words: torch.Tensor, *, block_words: int, out: torch.Tensor) -> None:
    """(s0, s1, s2) of the contiguous int32 `words` into `out` (int64 [3], on their device). No host sync."""
    import triton

    per_program = block_words * _BLOCKS_PER_PROGRAM
    programs = triton.cdiv(words.numel(), per_program)
    partial = torch.empty(programs, 3, dtype=torch.int64, device=words.device)
    _bucket_sums[(programs,)](words, partial, words.numel(), BLOCK_WORDS=block_words, BLOCKS=_BLOCKS_PER_PROGRAM)
    torch.sum(partial, 0, out=out)


if AVAILABLE:
    import triton
    import triton.language as tl

    _GOLDEN, _MIX1, _MIX2 = tl.constexpr(GOLDEN), tl.constexpr(MIX1), tl.constexpr(MIX2)
    _S1, _S2, _S3 = (tl.constexpr(s) for s in SHIFTS)

    @triton.jit
    def _shr(z, k: tl.constexpr):
        """Logical right shift of int64 bits."""
        return (z.to(tl.uint64, bitcast=True) >> k).to(tl.int64, bitcast=True)

    @triton.jit
    def _mix(index):
        """splitmix64 of a block index, as checksums._mix computes it."""
        z = index + _GOLDEN
        z = (z ^ _shr(z, _S1)) * _MIX1
        z = (z ^ _shr(z, _S2)) * _MIX2
        return z ^ _shr(z, _S3)

    @triton.jit
    def _bucket_sums(words_ptr, partial_ptr, n_words, BLOCK_WORDS: tl.constexpr, BLOCKS: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK_WORDS).to(tl.int64)
        s0 = tl.zeros([BLOCK_WORDS], dtype=tl.int64)
        s1 = tl.zeros([BLOCK_WORDS], dtype=tl.int64)
        s2 = tl.zeros([BLOCK_WORDS], dtype=tl.int64)
        for i in tl.static_range(BLOCKS):
            block = pid * BLOCKS + i
            index = block * BLOCK_WORDS + lanes
            w = tl.load(words_ptr + index, mask=index < n_words, other=0).to(tl.int64)
            s0 += w
            s1 += w * (index + 1)
            s2 += w * _mix(block)
        tl.store(partial_ptr + pid * 3, tl.sum(s0, axis=0))
        tl.store(partial_ptr + pid * 3 + 1, tl.sum(s1, axis=0))
        tl.store(partial_ptr + pid * 3 + 2, tl.sum(s2, axis=0))

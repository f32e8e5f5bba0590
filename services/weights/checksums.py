"""Checksums of a weight sync (`weights.check_weight_update_equal`): what the trainer announces and each engine
computes again from what it received.

Two granularities, the same copy check:

- **per bucket** (`bucket_checksums`, `named_bucket_checksums`; what the coordinator's syncs use): one checksum of
  each bucket's bytes, the plan's layout. Where a bucket's tensors lie back to back in memory (a native engine's
  FlatParams, a trainer whose weights are views of one flat buffer) it is summed where it lies; else its tensors are
  concatenated once. On a CUDA device with Triton a bucket is one kernel that reads each byte once
  (`bucket_kernel`); elsewhere torch's block and column sums read it twice. Either way a few launches per bucket,
  whatever its tensor count.
- **per tensor** (`tensor_checksums`, `named_checksums`): one checksum of each tensor. A sync whose bucket checksums
  differ is sent again with these (the coordinator's recheck), which names the tensors that differ.

A bucket checksum covers the bucket's bytes as little-endian int32 words w_0..w_{n-1} (the last one zero-padded), in
blocks of BLOCK_WORDS words: s0 = sum w_i, s1 = sum (i+1) w_i and s2 = sum_b h(b) (sum of block b's words), all modulo
2**64, h = splitmix64. Integer sums are exact and order-free, so any device and reduction order agree. s0 changes with
any change confined to one word (a flipped bit); s1 with two words swapped anywhere (the change is (i-j)(w_i-w_j),
nonzero and under 2**64 in size) and with a tensor moved by k words (k times its word sum, plus what it overwrote);
s2 with changes that cancel in both (+1, -2, +1 at one place of three blocks: its block weights are not linear).
What keeps all three, e.g. two blocks with equal sums and mirrored contents trading places, goes unnoticed: it is a
copy check, not a cryptographic hash. A mismatch pinpoints the bucket: its index, dtype, byte size and tensors; the
per-tensor recheck then names the tensors.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace

import torch

from services.contracts.weight_plan import WeightSyncPlan
from services.weights import bucket_kernel
from services.weights.layout import Bucket, Layout

# ---- per tensor -------------------------------------------------------------------------------------------

_CHECKSUM_CHUNK_WORDS = 1 << 24  # bounds the int64 temporaries to 128 MB each at a time
_U64 = (1 << 64) - 1


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words in C order, the last one zero-padded: a view where the bytes allow."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.numel() % 4 == 0:
        with contextlib.suppress(RuntimeError):  # a view needs a 4-byte aligned storage offset
            return data.view(torch.int32)
    return torch.cat([data, data.new_zeros(-data.numel() % 4)]).view(torch.int32)


def _word_sums(words: torch.Tensor) -> torch.Tensor:
    """int64 [2] on the words' device: the sum of the 32-bit words and their sum weighted by position (1-based),
    both modulo 2**64 (integer addition is exact and order-free, so any device and reduction order agree)."""
    out = torch.zeros(2, dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHECKSUM_CHUNK_WORDS):
        chunk = words[start : start + _CHECKSUM_CHUNK_WORDS].to(torch.int64)
        position = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=words.device)
        out[0] += chunk.sum()
        out[1] += (chunk * position).sum()
    return out


_BLOCK_WORDS = 256  # a pack places each tensor at a multiple of this many words (zeros between: they add 0)


def _pack_sums(words: list[torch.Tensor]) -> torch.Tensor:
    """int64 [n, 2]: _word_sums of each of `words` (one device, together at most a chunk). They are concatenated
    with zero padding so each starts a block of _BLOCK_WORDS words; per block the plain sum b0 and the sum
    weighted by position within the block b1; a tensor over blocks first..last-1 then has s0 = sum b0 and
    s1 = sum (b1 + (block - first) * B * b0), read off prefix sums over the blocks."""
    block, device = _BLOCK_WORDS, words[0].device
    counts = [w.numel() for w in words]
    blocks = [-(-c // block) for c in counts]
    pad = words[0].new_zeros(block)
    parts = []
    for w, count, n in zip(words, counts, blocks, strict=True):
        parts.append(w)
        if n * block > count:
            parts.append(pad[: n * block - count])
    grid = torch.cat(parts).to(torch.int64).view(-1, block)
    within = torch.arange(1, block + 1, dtype=torch.int64, device=device)
    b0 = grid.sum(1)
    index = torch.arange(grid.shape[0], dtype=torch.int64, device=device)
    prefix = torch.stack([b0, (grid * within).sum(1), index * b0], dim=1).cumsum(0)  # [blocks, 3]
    ends = torch.tensor(list(itertools.accumulate(blocks)), dtype=torch.int64).to(device, non_blocking=True)
    firsts = ends - torch.tensor(blocks, dtype=torch.int64).to(device, non_blocking=True)

    def upto(at: torch.Tensor) -> torch.Tensor:  # the prefix sums of the blocks before `at` ([n, 3])
        taken = prefix[(at - 1).clamp(min=0)]
        return torch.where((at > 0).unsqueeze(1), taken, torch.zeros_like(taken))

    span = upto(ends) - upto(firsts)
    s0 = span[:, 0]
    return torch.stack([s0, span[:, 1] + block * (span[:, 2] - firsts * s0)], dim=1)


def _word_sums_many(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """_word_sums of each tensor, in order: runs of small tensors on one device in packs (_pack_sums), a tensor of
    more than a chunk alone."""
    out: list[torch.Tensor] = []
    pack: list[torch.Tensor] = []
    packed = 0

    def flush() -> None:
        nonlocal packed
        if pack:
            sums = (
                _pack_sums(pack)
                if any(w.numel() for w in pack)
                else torch.zeros(len(pack), 2, dtype=torch.int64, device=pack[0].device)
            )
            out.extend(sums.unbind(0))
            pack.clear()
            packed = 0

    for tensor in tensors:
        words = _words(tensor)
        if words.numel() > _CHECKSUM_CHUNK_WORDS:
            flush()
            out.append(_word_sums(words))
            continue
        if pack and (packed + words.numel() > _CHECKSUM_CHUNK_WORDS or words.device != pack[0].device):
            flush()
        pack.append(words)
        packed += words.numel()
    flush()
    return out


def named_checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """tensor_checksums over (name, tensor) pairs as they stream by: at most a pack of tensors is held at once."""
    names: list[str] = []

    def tensors() -> Iterator[torch.Tensor]:
        for name, tensor in named:
            names.append(name)
            yield tensor

    sums = _word_sums_many(tensors())
    return dict(zip(names, _hex_pairs(sums), strict=True))


def with_checksums(plan: WeightSyncPlan, sums: Mapping[str, str] | Sequence[str], *, seconds: float) -> WeightSyncPlan:
    """`plan` announcing the trainer's checksums, what the engines and the coordinator compare the receivers' with:
    per bucket (a sequence, in bucket order: WeightBucket.checksum) or per tensor (name -> checksum:
    TensorMeta.checksum); `seconds`, what computing them took."""
    buckets = tuple(
        replace(bucket, checksum=sums[index])
        if not isinstance(sums, Mapping)
        else replace(bucket, tensors=tuple(replace(meta, checksum=sums[meta.name]) for meta in bucket.tensors))
        for index, bucket in enumerate(plan.buckets)
    )
    return replace(plan, buckets=buckets, checksum_s=seconds)


def announced_checksums(plan: WeightSyncPlan) -> dict[str, str]:
    """The trainer's checksums a plan carries (TensorMeta.checksum; set when it asked for verification)."""
    return {m.name: m.checksum for b in plan.buckets for m in b.tensors if m.checksum}


class PendingChecksums(Mapping[str, str]):
    """Checksums filled in as tensors stream by: known ones (announced in the plan) as given, the others summed on
    their device without a host sync, and turned into hex together at the first read."""

    def __init__(self) -> None:
        self._hex: dict[str, str] = {}
        self._pending: list[tuple[str, torch.Tensor]] = []

    def set_known(self, name: str, checksum: str) -> None:
        self._hex[name] = checksum

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._pending.append((name, _word_sums_many([tensor])[0]))

    def _settled(self) -> dict[str, str]:
        if self._pending:
            names, sums = zip(*self._pending, strict=True)
            self._hex.update(zip(names, _hex_pairs(list(sums)), strict=True))
            self._pending.clear()
        return self._hex

    def __getitem__(self, name: str) -> str:
        return self._settled()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._settled())

    def __len__(self) -> int:
        return len(self._settled())


def _hex_pairs(sums: list[torch.Tensor]) -> list[str]:
    if not sums:
        return []
    same_device = len({s.device for s in sums}) == 1
    pairs = (torch.stack(sums).cpu() if same_device else torch.stack([s.cpu() for s in sums])).tolist()
    return [f"{a & _U64:016x}{b & _U64:016x}" for a, b in pairs]


def tensor_checksums(tensors: Sequence[torch.Tensor]) -> list[str]:
    """One 128-bit checksum per tensor (hex), computed where each tensor lives, with one host sync for all.

    It covers every byte (C order; dtype and shape are checked separately by both sides) as two 64-bit sums of the
    tensor's 32-bit words, plain and position-weighted: any change confined to one word, a flipped bit, -0.0 vs 0.0,
    another NaN payload, or two words swapped always changes it; an arbitrary corruption goes unnoticed only when
    both sums collide modulo 2**64. It is a copy check, not a cryptographic hash.

    Tensors are summed in packs of up to _CHECKSUM_CHUNK_WORDS words (one concatenation, block sums, prefix sums over
    the blocks read at the tensors' boundaries), so the kernels launched grow with the bytes, not with the tensor
    count: a 0.36B model's 291 tensors took ~2.3k launches one tensor at a time."""
    return _hex_pairs(_word_sums_many(tensors))


def tensor_checksum(tensor: torch.Tensor) -> str:
    return tensor_checksums([tensor])[0]


# ---- per bucket -------------------------------------------------------------------------------------------

BLOCK_WORDS = 1024  # words per block of a bucket's two-level sums


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(index: torch.Tensor) -> torch.Tensor:
    """splitmix64 of each index: a block weight no linear pattern of blocks cancels."""
    s1, s2, s3 = bucket_kernel.SHIFTS
    z = index + bucket_kernel.GOLDEN
    z = (z ^ _shr(z, s1)) * bucket_kernel.MIX1
    z = (z ^ _shr(z, s2)) * bucket_kernel.MIX2
    return z ^ _shr(z, s3)


def _last_word_sums(last: torch.Tensor, *, index: int) -> torch.Tensor:
    """What the zero-padded last word (`last`, one int32) at word `index` adds to the three sums."""
    w = last.to(torch.int64).reshape(())
    block = torch.tensor(index // BLOCK_WORDS, dtype=torch.int64, device=last.device)
    return torch.stack([w, w * (index + 1), w * _mix(block)])


def _bucket_bytes(bucket: Bucket, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bucket's bytes (its tensors in slot order) as one uint8 tensor: a view of where they lie when they are
    back to back in one storage, else one concatenation."""
    first = tensors[0].detach()
    ptr, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    for tensor in tensors:
        if (
            not tensor.is_contiguous()
            or not tensor.numel()
            or tensor.data_ptr() != ptr
            or tensor.untyped_storage().data_ptr() != storage
            or tensor.device != first.device
        ):
            return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])
        ptr += tensor.numel() * tensor.element_size()
    raw = first.reshape(-1).view(torch.uint8)
    return raw.as_strided((bucket.nbytes,), (1,), raw.storage_offset())  # bounds-checked against the storage


def _as_words(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 words of the whole 4-byte groups, a view where aligned; the zero-padded last word, 0 or 1 of it)."""
    whole = data.numel() // 4 * 4
    head = data[:whole]
    try:
        words = head.view(torch.int32)
    except RuntimeError:  # a view needs a 4-byte aligned start
        words = head.clone().view(torch.int32)
    rest = data[whole:]
    last = (
        torch.cat([rest, rest.new_zeros(-rest.numel() % 4)]).view(torch.int32) if rest.numel() else words.new_zeros(0)
    )
    return words, last


class BucketSums:
    """The checksums of a layout's buckets, no host sync until `hex` (one for all). On a CUDA device with Triton each
    bucket is one pass of `bucket_kernel` (its three sums, read once); elsewhere its block and column sums (torch
    reductions, two passes), whose three sums are worked out for every bucket together at the end."""

    def __init__(self, layout: Layout):
        self._rows_per_bucket = max((-(-b.nbytes // 4) // BLOCK_WORDS + 1 for b in layout.buckets), default=1)
        self._count = len(layout.buckets)
        self._rows: torch.Tensor | None = None  # [buckets, rows]: block sums (the last block may be partial)
        self._cols: torch.Tensor | None = None  # [buckets, BLOCK_WORDS]: column sums over the blocks
        self._direct: torch.Tensor | None = None  # [buckets, 3]: the sums of buckets the kernel summed

    def _buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._rows is None or self._cols is None or self._direct is None:
            self._rows = torch.zeros(self._count, self._rows_per_bucket, dtype=torch.int64, device=device)
            self._cols = torch.zeros(self._count, BLOCK_WORDS, dtype=torch.int64, device=device)
            self._direct = torch.zeros(self._count, 3, dtype=torch.int64, device=device)
        return self._rows, self._cols, self._direct

    def add(self, bucket: Bucket, tensors: Sequence[torch.Tensor]) -> None:
        """The bucket's tensors, in slot order."""
        if bucket.nbytes:
            self.add_bytes(bucket, _bucket_bytes(bucket, tensors))

    def add_bytes(self, bucket: Bucket, data: torch.Tensor) -> None:
        """The bucket's bytes, as one uint8 tensor."""
        rows, cols, direct = self._buffers(data.device)
        words, last = _as_words(data.to(rows.device))
        if bucket_kernel.usable(words):
            bucket_kernel.word_sums(words, block_words=BLOCK_WORDS, out=direct[bucket.index])
            if last.numel():
                direct[bucket.index] += _last_word_sums(last, index=words.numel())
            return
        full = words.numel() // BLOCK_WORDS
        blocks = words[: full * BLOCK_WORDS].view(full, BLOCK_WORDS)
        torch.sum(blocks, 1, dtype=torch.int64, out=rows[bucket.index, :full])
        torch.sum(blocks, 0, dtype=torch.int64, out=cols[bucket.index])
        tail = words[full * BLOCK_WORDS :]
        tail = torch.cat([tail, last]) if last.numel() else tail
        if tail.numel():  # the last, partial block
            torch.sum(tail, 0, dtype=torch.int64, out=rows[bucket.index, full])
            cols[bucket.index, : tail.numel()] += tail

    def hex(self) -> list[str]:
        rows, cols, direct = self._buffers(torch.device("cpu"))
        device = rows.device
        block = torch.arange(rows.shape[1], dtype=torch.int64, device=device)
        column = torch.arange(1, BLOCK_WORDS + 1, dtype=torch.int64, device=device)
        s0 = rows.sum(1)
        s1 = (rows * (block * BLOCK_WORDS)).sum(1) + (cols * column).sum(1)  # word i = b*BLOCK_WORDS + c weighs i+1
        s2 = (rows * _mix(block)).sum(1)
        triples = (torch.stack([s0, s1, s2], dim=1) + direct).cpu().tolist()
        return [f"{a & _U64:016x}{b & _U64:016x}{c & _U64:016x}" for a, b, c in triples]


def bucket_checksums(layout: Layout, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """One checksum per bucket of `layout` over `tensors` (name -> tensor: an engine's params), in bucket order. A
    FlatParams of this layout (a native engine's) holds each bucket at a known place: no look at its tensors."""
    from services.weights.transports.cuda_ipc import FlatParams, bucket_starts  # the package loads no transport

    sums = BucketSums(layout)
    if isinstance(tensors, FlatParams) and tensors.layout_key == layout.key:
        for bucket, start in zip(layout.buckets, bucket_starts(layout)[0], strict=True):
            if bucket.nbytes:
                sums.add_bytes(bucket, tensors.flat[start : start + bucket.nbytes])
        return sums.hex()
    for bucket in layout.buckets:
        sums.add(bucket, [tensors[slot.name] for slot in bucket.tensors])
    return sums.hex()


def named_bucket_checksums(layout: Layout, named: Iterable[tuple[str, torch.Tensor]], *, where: str) -> list[str]:
    """bucket_checksums over (name, tensor) pairs as they stream by, in any order (each checked against its slot):
    a bucket is summed as soon as its last tensor came, so only the open buckets' tensors are held."""
    sums = BucketSums(layout)
    slots = {slot.name: slot for bucket in layout.buckets for slot in bucket.tensors}
    held: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        slot = slots.pop(name, None)
        if slot is None:
            raise ValueError(f"{where}: tensor {name!r} is not in the plan, or came twice")
        if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
            raise ValueError(
                f"{where}: tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, the plan has "
                f"{slot.dtype} {list(slot.shape)}"
            )
        bucket = layout.buckets[slot.bucket]
        parts = held.setdefault(bucket.index, {})
        parts[name] = tensor
        if len(parts) == len(bucket.tensors):
            sums.add(bucket, [parts[s.name] for s in bucket.tensors])
            del held[bucket.index]
    if slots:
        raise ValueError(f"{where}: {len(slots)} planned tensor(s) never came (first: {next(iter(slots))!r})")
    return sums.hex()


def describe_bucket(bucket: Bucket, *, listed: int = 3) -> str:
    """What a bucket mismatch pinpoints: `bucket 3 (bfloat16, 64.0 MiB: a, b, c and 5 more)`."""
    names = [slot.name for slot in bucket.tensors]
    more = f" and {len(names) - listed} more" if len(names) > listed else ""
    return (
        f"bucket {bucket.index} ({str(bucket.dtype).removeprefix('torch.')}, {bucket.nbytes / 2**20:.1f} MiB: "
        f"{', '.join(names[:listed])}{more})"
    )


def announced_bucket_checksums(plan: WeightSyncPlan) -> list[str]:
    """The trainer's bucket checksums a plan carries (WeightBucket.checksum; set when it verifies by bucket)."""
    return [wb.checksum for wb in plan.buckets]

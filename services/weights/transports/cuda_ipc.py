"""`cuda_ipc` transport: trainer and engine processes on one node (or one GPU) share the trainer's buckets.

Step by step:
  prepare (trainer)   allocates one flat CUDA buffer for all buckets (once per layout, reused), exports it with
                      `UntypedStorage._share_cuda_()` once, and writes each bucket's handle into
                      `WeightBucket.ipc` as explicit fields (bucket offset folded into storage_offset_bytes,
                      size = bucket bytes). Like the process-group transports it also announces its TCPStore
                      (master_addr/port, group_name) for the control handshake.
  receive (engine)    checks params and the trainer id; posts ready; waits for the trainer's go.
  publish (trainer)   copies tensors into the buckets, synchronizes the device, says go, then waits until every
                      engine rank confirms (done) — an abort or the deadline fails it.
  receive (engine)    maps the handles (`UntypedStorage._new_shared_cuda`, once per allocation: every bucket
                      lives in the same one), copies into params, synchronizes, posts done. The mapping is
                      kept while the trainer's handles stay the same (saves the open, ~0.5 ms a GiB) and
                      dropped when the engine releases its memory (`release()`), a sync brings other handles,
                      or TANDEM_CUDA_IPC_KEEP_MAPPED=0.
Copies are coalesced on both sides (`_Runs`): consecutive tensors whose source and destination bytes both
continue the previous tensor's are one copy. A receiver whose params are a `FlatParams` (views of one buffer
laid out like the buckets: `flat_views`, NativeEngine.flatten_parameters) gets whole bucket spans with no
per-tensor work — one copy for all buckets, since the trainer's buckets share one allocation at the same
starts. A trainer whose params are views of a flat buffer in spec order (DeepSpeed's flat bf16 groups) fills
the buckets with one copy; anything else falls back to a copy per tensor. Bucket starts are aligned to
`ALIGN` bytes. A trainer that offloads frees its buckets (`release()`); a receiver's kept mapping would hold
that memory until the next sync, which is why the engine drops it when it releases memory.
The buffers stay alive on the trainer after publish (receivers confirmed they are done) until a prepare with a
different layout, `release()` or `close()`. Lifetime follows that explicit handshake rather than torch's
cross-process refcount (which counts one mapping per share, while here every receiver maps every bucket on
every sync): receivers map with an empty ref-counter handle, and the trainer drops its own share count when it
frees the buffer. The plan still carries torch's ref-counter fields as exported. Handles never travel as
pickle. A handle maps the CUDA allocation the buffer lives in: only share with processes you trust with the
trainer's device memory. cudaIpc cannot open a handle inside the process that exported it, so trainer and
engine must be different processes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TypeVar

import torch

from services.contracts.config import CudaIpcWeights
from services.contracts.weight_plan import CudaIpcHandle, WeightBucket, WeightSyncPlan
from services.weights.layout import Layout, Slot
from services.weights.transport_base import (
    Deadline,
    Received,
    ReceiverTransport,
    SenderTransport,
    SyncContext,
    WeightSyncError,
)
from services.weights.transports import rendezvous

_Alloc = TypeVar("_Alloc")  # what names an allocation (the receiver: (device, IPC handle))


def _device_uuid(index: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))


@functools.cache
def _index_of_uuid(uuid: str) -> int | None:
    """A process's visible devices never change, and a receive asks for every bucket: look each uuid up once."""
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == uuid:
            return index
    return None


_NO_HANDLE = CudaIpcHandle(0, b"", 0, 0, b"", 0, b"", False, "")  # a bucket sent without one (refused when used)


def _handle(bucket: WeightBucket) -> CudaIpcHandle:
    return bucket.ipc or _NO_HANDLE


def _local_device(handle: CudaIpcHandle) -> int:
    """The local index of the trainer's GPU (CUDA_VISIBLE_DEVICES may number it differently here)."""
    if handle.device_uuid:
        index = _index_of_uuid(handle.device_uuid)
        if index is not None:
            return index
        raise WeightSyncError(
            f"cuda_ipc: the trainer's GPU {handle.device_uuid} is not visible to this process "
            f"(CUDA_VISIBLE_DEVICES={torch.cuda.device_count()} devices)"
        )
    return handle.device


ALIGN = 256  # bytes; bucket starts in the shared buffer and in flat_views


def _typed(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    return buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def bucket_starts(layout: Layout) -> tuple[list[int], int]:
    """Byte offset of each bucket in one flat buffer (aligned to ALIGN) and the buffer's size."""
    starts, total = [], 0
    for bucket in layout.buckets:
        starts.append(total)
        total += -(-bucket.nbytes // ALIGN) * ALIGN
    return starts, total


def flat_views(
    layout: Layout, device: torch.device | str, names: set[str] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One uint8 buffer holding every bucket (bucket_starts) and a typed view per tensor (of `names`, default
    all) at its slot: params re-pointed to these views receive a bucket with one copy. With every slot's view
    the mapping is a FlatParams (a receive then copies whole bucket spans)."""
    starts, total = bucket_starts(layout)
    flat = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
    views = {}
    for bucket, start in zip(layout.buckets, starts, strict=True):
        region = flat[start : start + bucket.nbytes]
        for slot in bucket.tensors:
            if names is None or slot.name in names:
                views[slot.name] = _typed(region, slot)
    if len(views) == len(layout.order):
        return flat, FlatParams(views, flat=flat, layout_key=layout.key)
    return flat, views


class FlatParams(dict):
    """A receiver's params (name -> tensor, usable by every transport) that are views of one uint8 buffer laid
    out by `bucket_starts(layout)` for the layout with key `layout_key`, every slot of it included. A cuda_ipc
    receive into them copies whole bucket spans with no per-tensor work: one copy when the trainer's buckets
    come from one allocation at the same starts (as `_SharedBuckets` lays them)."""

    def __init__(self, views: Mapping[str, torch.Tensor], *, flat: torch.Tensor, layout_key: object):
        super().__init__(views)
        self.flat = flat
        self.layout_key = layout_key


def flat_spans(
    *, sizes: list[int], dst_starts: list[int], sources: Sequence[tuple[_Alloc, int]]
) -> list[tuple[_Alloc, int, int, int]]:
    """Copies (source allocation, source offset, destination offset, bytes) that move every bucket i
    (`sizes[i]` bytes from `sources[i]` = (allocation, offset) to `dst_starts[i]`), merging a bucket into the
    previous copy when it lies at the same distance in the same allocation on both sides; the gap between
    them (alignment padding) is then copied too, which is harmless. Empty buckets need no copy."""
    spans: list[list] = []
    for size, dst, (alloc, src) in zip(sizes, dst_starts, sources, strict=True):
        if not size:
            continue
        last = spans[-1] if spans else None
        if last is not None and last[0] == alloc and src - last[1] == dst - last[2] and dst >= last[2] + last[3]:
            last[3] = dst + size - last[2]
            continue
        spans.append([alloc, src, dst, size])
    return [(a, s, d, n) for a, s, d, n in spans]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return tensor.detach().reshape(-1).view(torch.uint8)


class _Run:
    __slots__ = ("count", "d_next", "d_storage", "dst", "nbytes", "s_next", "s_storage", "src")

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
        self.dst, self.src, self.nbytes, self.count = dst, src, nbytes, 1
        self.d_next, self.s_next = dst.data_ptr() + nbytes, src.data_ptr() + nbytes
        self.d_storage: int | None = None  # looked up only when a pair lines up
        self.s_storage: int | None = None

    def continues(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        if dst.data_ptr() != self.d_next or src.data_ptr() != self.s_next:
            return False
        if self.d_storage is None:
            self.d_storage = self.dst.untyped_storage().data_ptr()
            self.s_storage = self.src.untyped_storage().data_ptr()
        return dst.untyped_storage().data_ptr() == self.d_storage and src.untyped_storage().data_ptr() == self.s_storage

    def copy(self) -> None:
        if self.count == 1:
            self.dst.copy_(self.src)
            return
        d, s, n = _bytes(self.dst), _bytes(self.src), self.nbytes
        # as_strided re-checks the storage bounds, so a merged run can never leave its storage
        d.as_strided((n,), (1,), d.storage_offset()).copy_(s.as_strided((n,), (1,), s.storage_offset()))


class _Runs:
    """Copies dst <- src pairs (same dtype and shape), merging a pair into the previous copy when both its
    destination and its source bytes continue the previous pair's in the same storage. Call flush() at the
    end. Pairs that do not line up cost one pointer comparison over a plain copy."""

    def __init__(self) -> None:
        self.copies = 0
        self._run: _Run | None = None

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        run = self._run
        contiguous = dst.is_contiguous() and src.is_contiguous() and dst.numel() > 0
        if run is not None and contiguous and run.continues(dst, src):
            n = dst.numel() * dst.element_size()
            run.nbytes += n
            run.d_next += n
            run.s_next += n
            run.count += 1
            return
        self.flush()
        if not contiguous:
            dst.copy_(src)
            self.copies += 1
            return
        self._run = _Run(dst, src, dst.numel() * dst.element_size())

    def flush(self) -> None:
        if self._run is not None:
            self._run.copy()
            self.copies += 1
            self._run = None


def _recipe(layout: Layout, params: Mapping[str, torch.Tensor]) -> list[tuple[int, Slot, int, bool]]:
    """The receiver's copies for `params`: (bucket, first slot, bytes, merged) — a merged entry covers
    consecutive slots whose params are consecutive bytes of one storage (one copy per bucket for params
    laid out by flat_views)."""
    out: list[list] = []
    for bucket in layout.buckets:
        run: list | None = None  # [bucket, slot, nbytes, merged, next ptr, storage ptr]
        for slot in bucket.tensors:
            t = params[slot.name]
            if not t.is_contiguous() or not slot.nbytes:
                if run is not None:
                    out.append(run)
                run = None
                out.append([bucket.index, slot, slot.nbytes, False])
                continue
            ptr = t.data_ptr()
            if run is not None and run[4] == ptr and t.untyped_storage().data_ptr() == run[5]:
                run[2] += slot.nbytes
                run[4] += slot.nbytes
                run[3] = True
                continue
            if run is not None:
                out.append(run)
            run = [bucket.index, slot, slot.nbytes, False, ptr + slot.nbytes, t.untyped_storage().data_ptr()]
        if run is not None:
            out.append(run)
    return [(r[0], r[1], r[2], r[3]) for r in out]


class _SharedBuckets:
    """One flat device buffer holding every bucket, exported once."""

    def __init__(self, *, layout: Layout, device: torch.device):
        self.key = (layout.key, device)
        self.starts, total = bucket_starts(layout)
        self.flat = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)  # the allocation must exist before another process maps it
        (dev, handle, _size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
            self.flat.untyped_storage()._share_cuda_()
        )
        self._ref_counter = (bytes(ref_handle), int(ref_offset))
        self.handles = [
            CudaIpcHandle(
                device=int(dev),
                handle=bytes(handle),
                storage_size_bytes=bucket.nbytes,
                storage_offset_bytes=int(offset) + start,
                ref_counter_handle=bytes(ref_handle),
                ref_counter_offset=int(ref_offset),
                event_handle=bytes(event_handle or b""),
                event_sync_required=bool(event_sync),
                device_uuid=_device_uuid(device.index),
            )
            for bucket, start in zip(layout.buckets, self.starts, strict=True)
        ]
        self.views = {
            slot.name: _typed(self.bucket(bucket.index, bucket.nbytes), slot)  # each tensor's place
            for bucket in layout.buckets
            for slot in bucket.tensors
        }

    def bucket(self, index: int, nbytes: int) -> torch.Tensor:
        return self.flat[self.starts[index] : self.starts[index] + nbytes]

    def free(self) -> None:
        """Drop the share count `_share_cuda_` took (receivers never touch it, see the module docstring), so
        the buffer returns to the caching allocator instead of waiting in torch's IPC limbo forever."""
        with contextlib.suppress(Exception):  # best effort, as torch's own release
            torch.UntypedStorage._release_ipc_counter_cuda(*self._ref_counter)
        self.views = {}
        self.flat = torch.empty(0)


class CudaIpcSender(SenderTransport):
    name = "cuda_ipc"

    def __init__(self, *, config: CudaIpcWeights, trainer_id: str):
        self._config = config
        self._trainer_id = trainer_id
        self._master = rendezvous.MasterStore(host=config.master_addr, timeout_s=config.timeout_s)
        self._group_name: str | None = None
        self._shared: _SharedBuckets | None = None
        self.last_copies = 0  # copies the last publish needed to fill the buckets

    def prepare(self, *, plan: WeightSyncPlan, layout: Layout, engine_world_size: int) -> WeightSyncPlan:
        if not torch.cuda.is_available():
            raise WeightSyncError("transport cuda_ipc needs CUDA; use gloo or disk")
        device = torch.device("cuda", torch.cuda.current_device())
        if self._shared is None or self._shared.key != (layout.key, device):
            self.release()
            self._shared = _SharedBuckets(layout=layout, device=device)
        if self._group_name is None:
            self._group_name = f"tandem-ipc-{self._trainer_id}-{uuid.uuid4().hex[:12]}"
        return self._master.announce(
            plan,
            group_name=self._group_name,
            world_size=1 + engine_world_size,
            buckets=tuple(replace(wb, ipc=h) for wb, h in zip(plan.buckets, self._shared.handles, strict=True)),
        )

    def publish(
        self,
        *,
        plan: WeightSyncPlan,
        layout: Layout,
        tensors: Iterable[tuple[Slot, torch.Tensor]],
        deadline: Deadline,
        checksums: Mapping[str, str],
    ) -> float:
        shared = self._shared
        if shared is None or plan.group_name != self._group_name:
            raise ValueError(f"cuda_ipc weight sync v{plan.version}: plan is not the one this trainer prepared last")
        ctx = SyncContext(
            "cuda_ipc", plan.version, "trainer", f"engine rank(s) {list(range(1, plan.world_size))}", plan.timeout_s
        )
        ctl = rendezvous.ctl_store(self._master.store, plan.group_name)
        try:
            runs = _Runs()
            for slot, tensor in tensors:
                runs.add(shared.views[slot.name], tensor.detach())
            runs.flush()
            self.last_copies = runs.copies
            torch.cuda.synchronize(shared.flat.device)
            rendezvous.signal_go(ctl, version=plan.version, value="ok", ctx=ctx)
            rendezvous.await_engines(
                ctl, version=plan.version, world_size=plan.world_size, kind="done", deadline=deadline, ctx=ctx
            )
            return 0.0
        except BaseException as exc:
            rendezvous.try_signal_abort(ctl, version=plan.version, why=str(exc))
            self._group_name = None  # fresh control keys next time; the buffers stay (a receiver may map them)
            raise

    def release(self) -> None:
        if self._shared is not None:
            self._shared.free()
        self._shared = None

    def close(self) -> None:
        self.release()
        self._master.close()


class CudaIpcReceiver(ReceiverTransport):
    name = "cuda_ipc"

    def __init__(self, *, keep_mapped: bool | None = None) -> None:
        self._trainer_store = rendezvous.TrainerStore()
        if keep_mapped is None:
            keep_mapped = os.environ.get("TANDEM_CUDA_IPC_KEEP_MAPPED", "1") != "0"
        self._keep_mapped = keep_mapped
        self._kept: dict[tuple, torch.Tensor] = {}  # mapped allocations kept between syncs (keep_mapped)
        self.last_copies = 0  # copies the last receive needed (one per bucket at best)
        self.last_timings: dict[str, float] = {}  # where the last receive's time went (map, plan, launch, ...)
        self._recipe: tuple[tuple, list] | None = None  # (where the params were, the copies for that)

    @staticmethod
    def _context(plan: WeightSyncPlan, rank: int) -> SyncContext:
        peer = f"trainer at {plan.master_addr}:{plan.master_port} (trainer_id {plan.trainer_id or '?'})"
        return SyncContext("cuda_ipc", plan.version, f"engine rank {rank}", peer, plan.timeout_s)

    def refuse(self, *, plan: WeightSyncPlan, rank: int, reason: str, deadline: Deadline) -> None:
        self._trainer_store.refuse(plan, ranks=[rank], reason=reason, deadline=deadline, ctx=self._context(plan, rank))

    def receive(
        self,
        *,
        plan: WeightSyncPlan,
        layout: Layout,
        rank: int,
        params: Mapping[str, torch.Tensor],
        deadline: Deadline,
    ) -> Received:
        ctx = self._context(plan, rank)
        started = time.monotonic()
        try:
            ctl = self._trainer_store.ctl(plan, deadline=deadline, ctx=ctx)
            rendezvous.post(ctl, version=plan.version, kind="ready", rank=rank, value="1", ctx=ctx)
            ready = time.monotonic()
            # the handles are in the plan: map them and plan every copy while the trainer fills its buckets
            copies = self._plan_copies(plan=plan, layout=layout, params=params, ctx=ctx)
            t = time.monotonic()
            rendezvous.await_go(ctl, version=plan.version, deadline=deadline, ctx=ctx)
            waited = (ready - started) + (time.monotonic() - t)  # preparing is work, not waiting
            self._run_copies(copies, ctx=ctx)
            t = time.perf_counter()
            rendezvous.post(ctl, version=plan.version, kind="done", rank=rank, value="1", ctx=ctx)
            self.last_timings["done_post_s"] = time.perf_counter() - t
            return Received(waited_s=waited)
        except BaseException:
            self._trainer_store.clear()
            raise

    def _map_allocations(
        self, plan: WeightSyncPlan, layout: Layout, ctx: SyncContext
    ) -> dict[tuple[int, bytes], tuple[int, torch.Tensor]]:
        """(device, handle) -> (lo, uint8 view of the allocation from byte `lo`): every allocation the buckets
        live in, mapped with one open covering all of its buckets (or kept from the last sync)."""
        spans: dict[tuple[int, bytes], list[int]] = {}
        for bucket, wb in zip(layout.buckets, plan.buckets, strict=True):
            if not bucket.nbytes:
                continue
            handle = _handle(wb)
            if handle.storage_size_bytes != bucket.nbytes or not handle.handle:
                raise WeightSyncError(ctx.message(f"bucket {bucket.index} has no usable IPC handle"))
            key = (_local_device(handle), bytes(handle.handle))
            lo, hi = handle.storage_offset_bytes, handle.storage_offset_bytes + bucket.nbytes
            span = spans.setdefault(key, [lo, hi])
            span[0], span[1] = min(span[0], lo), max(span[1], hi)
        mapped = {}
        for (device, raw), (lo, hi) in spans.items():
            cache_key = (device, raw, lo, hi)
            view = self._kept.get(cache_key)
            if view is None:
                first = next(_handle(wb) for wb in plan.buckets if bytes(_handle(wb).handle) == raw)
                with torch.cuda.device(device):
                    # b"" as ref-counter handle: lifetime follows our done-handshake, not torch's refcount
                    storage = torch.UntypedStorage._new_shared_cuda(
                        device, raw, hi - lo, lo, b"", 0, first.event_handle, first.event_sync_required
                    )
                    view = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage, 0, (hi - lo,), (1,))
            mapped[(device, raw)] = (lo, view, cache_key)
        if self._keep_mapped and not plan.buffers_freed_after:
            self._kept = {cache_key: view for lo, view, cache_key in mapped.values()}
        else:
            self._kept = {}
        return {key: (lo, view) for key, (lo, view, _) in mapped.items()}

    @staticmethod
    def _bucket_views(
        plan: WeightSyncPlan, layout: Layout, mapped: dict[tuple[int, bytes], tuple[int, torch.Tensor]]
    ) -> list[torch.Tensor | None]:
        """A uint8 view of each bucket (None for empty ones)."""
        out: list[torch.Tensor | None] = []
        for bucket, wb in zip(layout.buckets, plan.buckets, strict=True):
            if not bucket.nbytes:
                out.append(None)
                continue
            handle = _handle(wb)
            lo, view = mapped[(_local_device(handle), bytes(handle.handle))]
            start = handle.storage_offset_bytes - lo
            out.append(view[start : start + bucket.nbytes])
        return out

    @staticmethod
    def _flat_copies(
        plan: WeightSyncPlan,
        layout: Layout,
        flat: torch.Tensor,
        mapped: dict[tuple[int, bytes], tuple[int, torch.Tensor]],
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Whole bucket spans into a FlatParams buffer (one copy when the trainer's buckets share an allocation)."""
        handles = [_handle(wb) for wb in plan.buckets]
        sources = [((_local_device(h), bytes(h.handle)), h.storage_offset_bytes) for h in handles]
        spans = flat_spans(
            sizes=[b.nbytes for b in layout.buckets], dst_starts=bucket_starts(layout)[0], sources=sources
        )
        copies = []
        for alloc, src, dst, nbytes in spans:
            lo, view = mapped[alloc]
            copies.append((flat[dst : dst + nbytes], view[src - lo : src - lo + nbytes]))
        return copies

    def _plan_copies(
        self, *, plan: WeightSyncPlan, layout: Layout, params: Mapping[str, torch.Tensor], ctx: SyncContext
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) pairs that move every bucket into params: whole bucket spans into a FlatParams
        buffer, else copies from a recipe cached by where each param lives (shapes and dtypes match the plan,
        checked). Nothing is read from the trainer's buffers yet."""
        try:
            t0 = time.perf_counter()
            mapped = self._map_allocations(plan, layout, ctx)
            t1 = time.perf_counter()
            if isinstance(params, FlatParams) and params.layout_key == layout.key:
                copies = self._flat_copies(plan, layout, params.flat, mapped)
            else:
                views = self._bucket_views(plan, layout, mapped)
                key = (
                    tuple(params[s.name].data_ptr() for s in layout.order),
                    tuple(len(b.tensors) for b in layout.buckets),
                )
                if self._recipe is None or self._recipe[0] != key:
                    self._recipe = (key, _recipe(layout, params))
                copies = []
                for index, slot, nbytes, merged in self._recipe[1]:
                    view = views[index]
                    assert view is not None
                    if merged:
                        dst = _bytes(params[slot.name])
                        copies.append(
                            (
                                dst.as_strided((nbytes,), (1,), dst.storage_offset()),
                                view[slot.offset : slot.offset + nbytes],
                            )
                        )
                    else:
                        copies.append((params[slot.name], _typed(view, slot)))
            self.last_timings = {"map_s": t1 - t0, "plan_s": time.perf_counter() - t1}
            return copies
        except WeightSyncError:
            self._kept.clear()
            raise
        except Exception as exc:
            self._kept.clear()
            raise WeightSyncError(ctx.message(f"mapping the trainer's buffers failed: {exc}")) from exc

    def _run_copies(self, copies: list[tuple[torch.Tensor, torch.Tensor]], *, ctx: SyncContext) -> None:
        """The trainer's buckets are filled: copy, and wait for the copies before the trainer may reuse them."""
        try:
            t0 = time.perf_counter()
            for dst, src in copies:
                dst.copy_(src)
            t1 = time.perf_counter()
            for device in {dst.device for dst, _ in copies}:
                torch.cuda.synchronize(device)
            self.last_copies = len(copies)
            self.last_timings.update(launch_s=t1 - t0, sync_s=time.perf_counter() - t1)
        except Exception as exc:
            self._kept.clear()
            raise WeightSyncError(ctx.message(f"copying the trainer's buffers failed: {exc}")) from exc
        finally:
            copies.clear()  # drop the mapped views now (a kept mapping stays in self._kept)

    @property
    def kept_mappings(self) -> int:
        """Trainer allocations still mapped after the last receive (each holds that memory on the GPU)."""
        return len(self._kept)

    def release(self) -> None:
        """Unmap the trainer's buffers kept between syncs, so that memory the trainer frees is really free."""
        self._kept.clear()

    def close(self) -> None:
        self._kept.clear()
        self._trainer_store.clear()
        self._recipe = None

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
  receive (engine)    maps the handles (`UntypedStorage._new_shared_cuda`), copies into params, synchronizes,
                      drops the mappings, posts done.
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

import time
import uuid
from typing import Iterable, Mapping

import torch

from services.common.config import WeightsConfig
from services.common.gen.tandem.v1 import common_pb2
from services.common.weights import rendezvous
from services.common.weights.base import (Deadline, Received, ReceiverTransport, SenderTransport, SyncContext,
                                          WeightSyncError, register_transport)
from services.common.weights.layout import Layout, Slot


def _device_uuid(index: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))


def _local_device(handle: common_pb2.CudaIpcHandle) -> int:
    """The local index of the trainer's GPU (CUDA_VISIBLE_DEVICES may number it differently here)."""
    if handle.device_uuid:
        for index in range(torch.cuda.device_count()):
            if _device_uuid(index) == handle.device_uuid:
                return index
        raise WeightSyncError(f"cuda_ipc: the trainer's GPU {handle.device_uuid} is not visible to this process "
                              f"(CUDA_VISIBLE_DEVICES={torch.cuda.device_count()} devices)")
    return handle.device


def _typed(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    return buffer[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


class _SharedBuckets:
    """One flat device buffer holding every bucket, exported once."""

    def __init__(self, *, layout: Layout, device: torch.device):
        self.key = (layout.key, device)
        self.starts = []
        total = 0
        for bucket in layout.buckets:
            self.starts.append(total)
            total += bucket.nbytes
        self.flat = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)   # the allocation must exist before another process maps it
        (dev, handle, _size, offset, ref_handle, ref_offset, event_handle, event_sync) = \
            self.flat.untyped_storage()._share_cuda_()
        self._ref_counter = (bytes(ref_handle), int(ref_offset))
        self.handles = [common_pb2.CudaIpcHandle(
            device=int(dev), handle=bytes(handle), storage_size_bytes=bucket.nbytes,
            storage_offset_bytes=int(offset) + start, ref_counter_handle=bytes(ref_handle),
            ref_counter_offset=int(ref_offset), event_handle=bytes(event_handle or b""),
            event_sync_required=bool(event_sync), device_uuid=_device_uuid(device.index))
            for bucket, start in zip(layout.buckets, self.starts)]

    def bucket(self, index: int, nbytes: int) -> torch.Tensor:
        return self.flat[self.starts[index]: self.starts[index] + nbytes]

    def free(self) -> None:
        """Drop the share count `_share_cuda_` took (receivers never touch it, see the module docstring), so
        the buffer returns to the caching allocator instead of waiting in torch's IPC limbo forever."""
        try:
            torch.UntypedStorage._release_ipc_counter_cuda(*self._ref_counter)
        except Exception:  # noqa: BLE001, S110 - best effort, as torch's own release
            pass
        self.flat = torch.empty(0)


class CudaIpcSender(SenderTransport):
    name = "cuda_ipc"

    def __init__(self, *, config: WeightsConfig, trainer_id: str):
        self._config = config
        self._trainer_id = trainer_id
        self._master = rendezvous.MasterStore(host=config.master_addr, timeout_s=config.timeout_s)
        self._group_name: str | None = None
        self._shared: _SharedBuckets | None = None

    def prepare(self, *, plan: common_pb2.WeightSyncPlan, layout: Layout, engine_world_size: int) -> None:
        if not torch.cuda.is_available():
            raise WeightSyncError("transport cuda_ipc needs CUDA; use gloo or disk")
        device = torch.device("cuda", torch.cuda.current_device())
        if self._shared is None or self._shared.key != (layout.key, device):
            self.release()
            self._shared = _SharedBuckets(layout=layout, device=device)
        if self._group_name is None:
            self._group_name = f"tandem-ipc-{self._trainer_id}-{uuid.uuid4().hex[:12]}"
        for wb, handle in zip(plan.buckets, self._shared.handles):
            wb.ipc.CopyFrom(handle)
        plan.group_name = self._group_name
        plan.master_addr = self._config.master_addr
        plan.master_port = self._master.port
        plan.world_size = 1 + engine_world_size
        rendezvous.clear_version(rendezvous.ctl_store(self._master.store, self._group_name),
                                 version=plan.version, world_size=plan.world_size)

    def publish(self, *, plan: common_pb2.WeightSyncPlan, layout: Layout,
                tensors: Iterable[tuple[Slot, torch.Tensor]], deadline: Deadline,
                checksums: Mapping[str, str]) -> float:
        shared = self._shared
        if shared is None or plan.group_name != self._group_name:
            raise ValueError(f"cuda_ipc weight sync v{plan.version}: plan is not the one this trainer prepared last")
        ctx = SyncContext("cuda_ipc", plan.version, "trainer", f"engine rank(s) {list(range(1, plan.world_size))}",
                          plan.timeout_s)
        ctl = rendezvous.ctl_store(self._master.store, plan.group_name)
        try:
            for slot, tensor in tensors:
                _typed(shared.bucket(slot.bucket, layout.buckets[slot.bucket].nbytes), slot).copy_(tensor.detach())
            torch.cuda.synchronize(shared.flat.device)
            rendezvous.signal_go(ctl, version=plan.version, value="ok", ctx=ctx)
            rendezvous.await_engines(ctl, version=plan.version, world_size=plan.world_size, kind="done",
                                     deadline=deadline, ctx=ctx)
            return 0.0
        except BaseException as exc:
            rendezvous.try_signal_abort(ctl, version=plan.version, why=str(exc))
            self._group_name = None   # fresh control keys next time; the buffers stay (a receiver may map them)
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

    def __init__(self) -> None:
        self._stores: dict[tuple[str, int], object] = {}

    @staticmethod
    def _context(plan: common_pb2.WeightSyncPlan, rank: int) -> SyncContext:
        peer = f"trainer at {plan.master_addr}:{plan.master_port} (trainer_id {plan.trainer_id or '?'})"
        return SyncContext("cuda_ipc", plan.version, f"engine rank {rank}", peer, plan.timeout_s)

    def _ctl(self, plan: common_pb2.WeightSyncPlan, deadline: Deadline, ctx: SyncContext):  # noqa: ANN202
        key = (plan.master_addr, plan.master_port)
        if key not in self._stores:
            self._stores.clear()
            self._stores[key] = rendezvous.connect_store(host=plan.master_addr, port=plan.master_port,
                                                         deadline=deadline, ctx=ctx)
        return rendezvous.ctl_store(self._stores[key], plan.group_name)

    def refuse(self, *, plan: common_pb2.WeightSyncPlan, rank: int, reason: str, deadline: Deadline) -> None:
        ctx = self._context(plan, rank)
        try:
            ctl = self._ctl(plan, Deadline(min(deadline.remaining(), 5.0)), ctx)
            rendezvous.post(ctl, version=plan.version, kind="abort", rank=rank, value=reason[:4000], ctx=ctx)
        except WeightSyncError:
            pass

    def receive(self, *, plan: common_pb2.WeightSyncPlan, layout: Layout, rank: int,
                params: Mapping[str, torch.Tensor], deadline: Deadline) -> Received:
        ctx = self._context(plan, rank)
        started = time.monotonic()
        try:
            ctl = self._ctl(plan, deadline, ctx)
            rendezvous.post(ctl, version=plan.version, kind="ready", rank=rank, value="1", ctx=ctx)
            rendezvous.await_go(ctl, version=plan.version, deadline=deadline, ctx=ctx)
            waited = time.monotonic() - started
            self._copy(plan=plan, layout=layout, params=params, ctx=ctx)
            rendezvous.post(ctl, version=plan.version, kind="done", rank=rank, value="1", ctx=ctx)
            return Received(waited_s=waited)
        except BaseException:
            self._stores.clear()
            raise

    @staticmethod
    def _copy(*, plan: common_pb2.WeightSyncPlan, layout: Layout, params: Mapping[str, torch.Tensor],
              ctx: SyncContext) -> None:
        mapped = []   # keep every mapping until the end: buckets share one allocation, open it once
        try:
            for bucket, wb in zip(layout.buckets, plan.buckets):
                if not bucket.nbytes:
                    continue
                handle = wb.ipc
                if handle.storage_size_bytes != bucket.nbytes or not handle.handle:
                    raise WeightSyncError(ctx.message(f"bucket {bucket.index} has no usable IPC handle"))
                device = _local_device(handle)
                with torch.cuda.device(device):
                    # b"" as ref-counter handle: lifetime follows our done-handshake, not torch's refcount
                    storage = torch.UntypedStorage._new_shared_cuda(
                        device, handle.handle, handle.storage_size_bytes, handle.storage_offset_bytes,
                        b"", 0, handle.event_handle, handle.event_sync_required)
                    view = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(
                        storage, 0, (bucket.nbytes,), (1,))
                mapped.append(view)
                for slot in bucket.tensors:
                    params[slot.name].copy_(_typed(view, slot))
            for view in mapped:
                torch.cuda.synchronize(view.device)   # copies done before the trainer may reuse the buffers
        except WeightSyncError:
            raise
        except Exception as exc:  # noqa: BLE001 - CUDA errors surface as RuntimeError
            raise WeightSyncError(ctx.message(f"mapping or copying the trainer's buffers failed: {exc}")) from exc
        finally:
            mapped.clear()


register_transport("cuda_ipc",
                   sender=lambda config, run_dir, trainer_id: CudaIpcSender(config=config, trainer_id=trainer_id),
                   receiver=CudaIpcReceiver)

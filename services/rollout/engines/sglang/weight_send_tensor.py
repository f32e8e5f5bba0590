"""`cuda_ipc` toward SGLang: the trainer's half of /update_weights_from_tensor (same host, usually the same GPU).

SGLang 0.5.17's route takes, per TP rank, one string that its `MultiprocessingSerializer.deserialize` reads: base64
of a `multiprocessing.reduction.ForkingPickler` dump. Over it, torch's reducers turn a CUDA tensor into its IPC
handle, offsets and ref-counter (`torch.multiprocessing.reductions.rebuild_cuda_tensor` and its arguments), never its
data; SGLang's `SafeUnpickler` (an allow-list: builtins, types, torch.*) rebuilds the tensor on its side and loads
it with `model.load_weights`. So, per sync:
  prepare   a fresh, ordinary CUDA buffer per plan bucket (the plain caching allocator: memory from a cuMem pool
            such as torch_memory_saver's cannot be exported over legacy CUDA IPC), and per engine rank one
            serialisation of the bucket: `[(name, typed view), ...]` (load_format "tensor") or
            `{"flattened_tensor": the bucket's bytes, "metadata": [SimpleNamespace(name, shape, dtype, start_idx,
            end_idx, numel)]}` ("flattened_bucket": SGLang reads those six attributes, byte offsets, and rebuilds
            its FlattenedTensorMetadata from them, so sglang need not be importable here). Both carry one IPC handle
            per bucket (the views share its storage). The strings go into the plan (`WeightBucket.sglang_payloads`,
            `plan.sglang_load_format`); the buffers of the previous sync are dropped first (SGLang answered for
            them; `torch.cuda.ipc_collect` frees what its ref-counters held back).
  publish   copies the tensors into the buffers, synchronises the device, says go on the trainer's store and waits
            for every engine rank's done: the rollout adapter posts it once SGLang answered every bucket.
The buffers stay alive until the next prepare (or `release`, before an offload): SGLang answers once its copies
are enqueued, without a device sync, so a buffer must outlive the answer. Each engine rank gets its own
serialisation because torch's ref-counting expects one consumer per share.

Devices are named by UUID (argument 6 of rebuild_cuda_tensor), which SGLang's consumer maps to its own index, so
CUDA_VISIBLE_DEVICES may differ between the trainer and SGLang; this is done by a reducer of this pickler only.
SGLang's own `monkey_patch_torch_reductions` is never called here: it swaps torch's reducer for the whole process.
Tandem unpickles nothing: the rollout service checks only each string's shape (base64, a pickle protocol header).
"""

from __future__ import annotations

import base64
import io
import types
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import replace
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing import reductions  # importing it registers torch's reducers with ForkingPickler

from services.contracts.config import CudaIpcWeights
from services.contracts.weight_plan import WeightSyncPlan
from services.weights.layout import Bucket, Layout, Slot
from services.weights.transport_base import Deadline, SenderTransport, SyncContext, WeightSyncError
from services.weights.transports import rendezvous

LOAD_FORMATS = ("tensor", "flattened_bucket")
_DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device argument (SGLang's patch rewrites the same index)


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _reduce_cuda_tensor_by_uuid(tensor: torch.Tensor) -> tuple[Any, tuple]:
    """torch's reducer, with the device as its UUID string (SGLang's consumer accepts an index or a UUID)."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is not reductions.rebuild_cuda_tensor:
        raise WeightSyncError(f"cuda_ipc toward SGLang sends CUDA tensors only, got one on {tensor.device}")
    args = (*args[:_DEVICE_ARG], _device_uuid(int(args[_DEVICE_ARG])), *args[_DEVICE_ARG + 1 :])
    return rebuild, args


def serialize_for_sglang(obj: object, *, cuda_uuid: bool = True) -> str:
    """What SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)` writes: base64 of a ForkingPickler
    dump. `cuda_uuid` names CUDA devices by UUID (a reducer of this pickler only); tests on CPU turn it off."""
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    if cuda_uuid:
        pickler.dispatch_table[torch.Tensor] = _reduce_cuda_tensor_by_uuid
    pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def typed_view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    return buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def wire_slots(bucket: Bucket) -> list[Slot]:
    """The tensors of a bucket that SGLang loads: those with elements (an empty one has nothing to load)."""
    return [s for s in bucket.tensors if s.nbytes > 0]


# One bucket as SGLang's load path reads it: (name, tensor) pairs, or the flattened bucket with its metadata
SGLangBucket = list[tuple[str, torch.Tensor]] | dict[str, object]


def bucket_payload(bucket: Bucket, buffer: torch.Tensor, *, load_format: str) -> SGLangBucket:
    """The object SGLang's load path expects for one bucket held in `buffer` (uint8, the bucket's bytes)."""
    slots = wire_slots(bucket)
    match load_format:
        case "tensor":
            return [(s.name, typed_view(buffer, s)) for s in slots]
        case "flattened_bucket":
            # FlattenedTensorMetadata's fields, as SGLang's _update_weights_from_flattened_bucket reads them (byte
            # offsets into the uint8 tensor); start/end are the plan's own offsets, so padding would be harmless
            meta = [
                types.SimpleNamespace(
                    name=s.name,
                    shape=torch.Size(s.shape),
                    dtype=s.dtype,
                    start_idx=s.offset,
                    end_idx=s.offset + s.nbytes,
                    numel=s.nbytes,
                )
                for s in slots
            ]
            return {"flattened_tensor": buffer[: bucket.nbytes], "metadata": meta}
        case _:
            raise ValueError(f"SGLang load format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")


class SGLangTensorSender(SenderTransport):
    """The cuda_ipc sender when the rollout engines are SGLang servers (rollout.engine: sglang)."""

    name = "cuda_ipc"

    def __init__(self, *, config: CudaIpcWeights, trainer_id: str, load_format: str, device: str | None = None):
        """`device`: where the bucket buffers live, default the current CUDA device. Tests on machines without CUDA
        pass "cpu": torch then serialises shared-memory handles where it would write CUDA IPC handles."""
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"SGLang load format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
        self._config = config
        self._trainer_id = trainer_id
        self._load_format = load_format
        self._master = rendezvous.MasterStore(host=config.master_addr, timeout_s=config.timeout_s)
        self._group_name: str | None = None
        self._buffers: list[torch.Tensor] = []  # this sync's buckets, kept until the next prepare
        self._device = device

    def prepare(self, *, plan: WeightSyncPlan, layout: Layout, engine_world_size: int) -> WeightSyncPlan:
        if self._device is None and not torch.cuda.is_available():
            raise WeightSyncError("transport cuda_ipc needs CUDA; use disk or nccl with rollout.engine sglang")
        self.release()
        device = torch.device(self._device or f"cuda:{torch.cuda.current_device()}")
        self._buffers = [torch.empty(max(b.nbytes, 1), dtype=torch.uint8, device=device) for b in layout.buckets]
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the allocations exist before another process maps them
        buckets = []
        for wb, bucket, buffer in zip(plan.buckets, layout.buckets, self._buffers, strict=True):
            if wire_slots(bucket):
                obj = bucket_payload(bucket, buffer, load_format=self._load_format)
                payloads = tuple(
                    serialize_for_sglang(obj, cuda_uuid=device.type == "cuda") for _ in range(engine_world_size)
                )
                wb = replace(wb, sglang_payloads=payloads)
            buckets.append(wb)
        if self._group_name is None:
            self._group_name = f"tandem-sgl-{self._trainer_id}-{uuid.uuid4().hex[:12]}"
        return self._master.announce(
            plan,
            group_name=self._group_name,
            world_size=1 + engine_world_size,
            buckets=tuple(buckets),
            sglang_load_format=self._load_format,
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
        if not self._buffers or plan.group_name != self._group_name:
            raise ValueError(f"cuda_ipc weight sync v{plan.version}: plan is not the one this trainer prepared last")
        ctx = SyncContext(
            "cuda_ipc",
            plan.version,
            "trainer",
            f"SGLang engine rank(s) {list(range(1, plan.world_size))}",
            plan.timeout_s,
        )
        ctl = rendezvous.ctl_store(self._master.store, plan.group_name)
        try:
            for slot, tensor in tensors:
                if slot.nbytes:
                    typed_view(self._buffers[slot.bucket], slot).copy_(tensor.detach())
            if self._buffers[0].is_cuda:
                torch.cuda.synchronize(self._buffers[0].device)
            rendezvous.signal_go(ctl, version=plan.version, value="ok", ctx=ctx)
            rendezvous.await_engines(
                ctl, version=plan.version, world_size=plan.world_size, kind="done", deadline=deadline, ctx=ctx
            )
            return 0.0
        except BaseException as exc:
            rendezvous.try_signal_abort(ctl, version=plan.version, why=str(exc))
            self._group_name = None  # fresh control keys next time; the buffers stay (SGLang may still read them)
            raise

    def release(self) -> None:
        """Drop the last sync's buffers (SGLang answered for them) and free what torch's IPC limbo still holds."""
        if self._buffers:
            cuda = self._buffers[0].is_cuda
            self._buffers = []
            if cuda:
                torch.cuda.ipc_collect()

    def close(self) -> None:
        self.release()
        self._master.close()

"""The weight-sync plan: what a PrepareWeightSync answers and every engine follows (buckets, tensor names and
offsets, the rendezvous, checksums). Frozen dataclasses in every process: the trainer's publisher fills one in, the
coordinator annotates a copy (dataclasses.replace) and hands it to the engines; only the gRPC edges turn it into the
tandem.v1 messages of the same names (services/contracts/convert.py), field by field."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int  # inside its bucket
    nbytes: int
    checksum: str = ""  # hex digest of the tensor's bytes (empty unless verification asked)


@dataclass(frozen=True)
class CudaIpcHandle:
    """A CUDA IPC handle of a trainer bucket, as explicit fields (what torch's storage sharing needs)."""

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str


@dataclass(frozen=True)
class WeightBucket:
    index: int
    dtype: str
    nbytes: int
    tensors: tuple[TensorMeta, ...] = ()
    ipc: CudaIpcHandle | None = None  # transport cuda_ipc toward native engines
    # cuda_ipc toward SGLang: per engine rank, this bucket serialised as SGLang's MultiprocessingSerializer reads it
    # (the rollout service forwards them and decodes nothing); empty for a bucket whose tensors have no elements.
    sglang_payloads: tuple[str, ...] = ()
    checksum: str = ""  # the bucket's checksum (hex) when the plan verifies by bucket


@dataclass(frozen=True)
class WeightSyncPlan:
    """What the trainer announces before a transfer; the receiver consumes buckets in this order."""

    version: int
    transport: str  # "gloo" | "nccl" | "cuda_ipc" | "disk" | ...
    buckets: tuple[WeightBucket, ...] = ()
    group_name: str = ""  # process-group transports: rendezvous prefix
    master_addr: str = ""
    master_port: int = 0
    world_size: int = 0  # 1 (trainer) + all engine ranks
    disk_path: str = ""  # transport disk: safetensors directory
    timeout_s: float = 0.0
    verify: bool = False  # receivers return checksums (per tensor, or per bucket: verify_by_bucket)
    total_bytes: int = 0
    trainer_id: str = ""  # receivers accept IPC handles only from the configured trainer
    # the trainer frees its buffers right after this sync (offload_train): cuda_ipc receivers must not keep them
    buffers_freed_after: bool = False
    # cuda_ipc: "" = a plan for native engines (ipc handles); "tensor" or "flattened_bucket" = one for SGLang
    sglang_load_format: str = ""
    verify_by_bucket: bool = False  # with verify: one checksum per bucket (WeightBucket.checksum), not per tensor
    checksum_s: float = 0.0  # the trainer's seconds computing the checksums it announces

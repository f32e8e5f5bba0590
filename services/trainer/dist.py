"""Process-group set-up for the trainer and the rank-0 → all-ranks command relay.

One code path serves 1 and N ranks: rank 0 receives gRPC calls and relays each command (JSON header +
raw byte payloads, e.g. encoded rollout batches) to the other ranks over a dedicated gloo group, then
every rank executes it in lockstep. Nothing is pickled: `broadcast_object_list` is avoided on purpose.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.contracts.untyped import JsonObject, JsonValue

log = logging.getLogger(__name__)

LAUNCHER_ENV = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def launched_by_launcher() -> bool:
    return all(k in os.environ for k in LAUNCHER_ENV)


def resolve_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{local_rank}"
    return torch.device(device)


def _skip_shm_comm_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory all-reduce (~30 s) at comm init on CPU. Only its inference
    all-reduce uses it; training collectives go through gloo, so tell it the op is not available."""
    if os.environ.get("TANDEM_DS_SHM_COMM") == "1":
        return
    import deepspeed.ops

    compatible = dict(deepspeed.ops.__dict__.get("__compatible_ops__") or {})
    compatible["deepspeed_shm_comm"] = False
    deepspeed.ops.__compatible_ops__ = compatible


def init_process_group(*, device: str = "auto", timeout_s: float) -> DistInfo:
    """Joins (or creates) the default group. Without a launcher this is a 1-rank group on an in-memory
    store: no port, and no RANK/WORLD_SIZE/MASTER_* left in os.environ, where child processes (a
    `tandem run` started later from the same process) would mistake them for a launcher's. `timeout_s` bounds
    every collective (services.timeouts.process_group_s)."""
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine reads it
    local_rank = int(os.environ["LOCAL_RANK"])
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        _skip_shm_comm_build()
    backend = "nccl" if dev.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized() and not launched_by_launcher():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    # auto_mpi_discovery off: without a launcher's variables DeepSpeed would look for MPI.
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=dev)


class CommandRelay:
    """Broadcasts (header dict, [payload bytes]) from rank 0 to every rank of a gloo group."""

    def __init__(self, *, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        # Its own gloo group: works beside an NCCL default group and never interleaves with DeepSpeed's.
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0, group=self.group)

    def send(self, header: JsonObject, payloads: Sequence[bytes] = ()) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 relays commands")
        if self.world_size == 1:
            return
        parts = [json.dumps(header).encode(), *payloads]
        self._broadcast(torch.tensor([len(parts)], dtype=torch.int64))
        self._broadcast(torch.tensor([len(p) for p in parts], dtype=torch.int64))
        blob = b"".join(parts)
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
        self._broadcast(data)

    def recv(self) -> tuple[JsonValue, list[bytes]]:
        count = torch.zeros(1, dtype=torch.int64)
        self._broadcast(count)
        sizes = torch.zeros(int(count.item()), dtype=torch.int64)
        self._broadcast(sizes)
        data = torch.empty(int(sizes.sum().item()), dtype=torch.uint8)
        self._broadcast(data)
        blob = data.numpy().tobytes()
        parts: list[bytes] = []
        offset = 0
        for size in sizes.tolist():
            parts.append(blob[offset : offset + size])
            offset += size
        return json.loads(parts[0].decode()), parts[1:]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """In-place SUM over all ranks (no-op on one rank); the tensor may live on the accelerator."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max_int(value: int, device: torch.device) -> int:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()

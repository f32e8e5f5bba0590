"""`disk` transport: safetensors files in a shared directory — the universal fallback.

Layout on disk: `<weights.disk_dir or RUN_DIR/weights>/v<version>/` holding one safetensors file per bucket
(`bucket-00000.safetensors`, ...) and `manifest.json` (version, trainer id, files, checksums when verifying).
The trainer writes into a hidden temporary directory and renames it into place, so a reader sees a version
completely or not at all; the manifest is written last. Tensors are streamed to the files as they arrive
(the header is known from the layout up front), so no bucket buffer is needed. Older versions are removed,
keeping the last `KEEP_VERSIONS`. The receiver waits for the manifest until the plan's deadline, then loads
each file with `safetensors.safe_open` and copies into its params.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open

from services.contracts.config import DiskWeights
from services.contracts.weight_plan import WeightSyncPlan
from services.weights.layout import SAFETENSORS_DTYPES, Bucket, Layout, Slot, dtype_name, tensor_bytes
from services.weights.transport_base import (
    Deadline,
    Received,
    ReceiverTransport,
    SenderTransport,
    SyncContext,
    WeightSyncError,
    WeightSyncTimeout,
)

KEEP_VERSIONS = 2
_MANIFEST_POLL_S = 0.02  # receiver: between looks for the trainer's manifest
MANIFEST = "manifest.json"
_VERSION_DIR = re.compile(r"^v(\d+)$")


def bucket_file(index: int) -> str:
    return f"bucket-{index:05d}.safetensors"


def _safetensors_header(bucket: Bucket, metadata: dict[str, str]) -> bytes:
    """The safetensors header of a bucket: our bucket offsets are exactly its data offsets."""
    entries: dict[str, object] = {"__metadata__": metadata}
    for slot in bucket.tensors:
        if slot.name == "__metadata__":
            raise ValueError("a tensor cannot be named '__metadata__' in a safetensors file")
        entries[slot.name] = {
            "dtype": SAFETENSORS_DTYPES[dtype_name(slot.dtype)],
            "shape": list(slot.shape),
            "data_offsets": [slot.offset, slot.offset + slot.nbytes],
        }
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format recommends an 8-byte aligned data section
    return struct.pack("<Q", len(raw)) + raw


class _BucketWriter:
    def __init__(self, *, path: Path, bucket: Bucket, metadata: dict[str, str]):
        self.bucket = bucket
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in finish()/abort()
        self._file.write(_safetensors_header(bucket, metadata))
        self._left = len(bucket.tensors)

    def write(self, tensor: torch.Tensor) -> bool:
        """Append one tensor's bytes; True once the bucket is complete (and the file closed)."""
        data = tensor_bytes(tensor)
        if data.numel():
            self._file.write(data.numpy().data)
        self._left -= 1
        if self._left == 0:
            self._file.close()
        return self._left == 0

    def abort(self) -> None:
        self._file.close()


def _install(tmp: Path, final: Path) -> None:
    """Rename the finished directory into place; a retried version replaces the old one."""
    if final.exists():
        trash = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)


class DiskSender(SenderTransport):
    name = "disk"

    def __init__(self, *, config: DiskWeights, run_dir: Path, trainer_id: str):
        self._root = Path(config.disk_dir) if config.disk_dir else Path(run_dir) / "weights"
        self._trainer_id = trainer_id
        self._tag = re.sub(r"[^A-Za-z0-9_-]", "_", trainer_id)[:64] or "trainer"

    def prepare(self, *, plan: WeightSyncPlan, layout: Layout, engine_world_size: int) -> WeightSyncPlan:
        self._root.mkdir(parents=True, exist_ok=True)
        for leftover in self._root.glob(f".v*.tmp-{self._tag}-*"):  # our own crashed writes
            shutil.rmtree(leftover, ignore_errors=True)
        return replace(plan, disk_path=str(self._root / f"v{plan.version}"), world_size=1 + engine_world_size)

    def publish(
        self,
        *,
        plan: WeightSyncPlan,
        layout: Layout,
        tensors: Iterable[tuple[Slot, torch.Tensor]],
        deadline: Deadline,
        checksums: Mapping[str, str],
    ) -> float:
        final = Path(plan.disk_path)
        tmp = final.with_name(f".{final.name}.tmp-{self._tag}-{uuid.uuid4().hex[:8]}")
        tmp.mkdir(parents=True)
        writers: dict[int, _BucketWriter] = {}
        metadata = {"format": "pt", "tandem_version": str(plan.version), "trainer_id": self._trainer_id}
        try:
            for slot, tensor in tensors:
                writer = writers.get(slot.bucket)
                if writer is None:
                    writer = writers[slot.bucket] = _BucketWriter(
                        path=tmp / bucket_file(slot.bucket), bucket=layout.buckets[slot.bucket], metadata=metadata
                    )
                if writer.write(tensor):
                    del writers[slot.bucket]
            manifest = {
                "version": plan.version,
                "trainer_id": self._trainer_id,
                "total_bytes": layout.total_bytes,
                "files": [bucket_file(b.index) for b in layout.buckets],
                "checksums": dict(checksums),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            _install(tmp, final)
        except BaseException:
            for writer in writers.values():
                writer.abort()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._cleanup(keep_version=plan.version)
        return 0.0

    def _cleanup(self, *, keep_version: int) -> None:
        versions = sorted(int(m.group(1)) for p in self._root.iterdir() if (m := _VERSION_DIR.match(p.name)))
        keep = set(versions[-KEEP_VERSIONS:]) | {keep_version}
        for version in versions:
            if version not in keep:
                shutil.rmtree(self._root / f"v{version}", ignore_errors=True)


class DiskReceiver(ReceiverTransport):
    name = "disk"

    def receive(
        self,
        *,
        plan: WeightSyncPlan,
        layout: Layout,
        rank: int,
        params: Mapping[str, torch.Tensor],
        deadline: Deadline,
    ) -> Received:
        path = Path(plan.disk_path)
        ctx = SyncContext(
            "disk",
            plan.version,
            f"engine rank {rank}",
            f"trainer {plan.trainer_id or '?'} writing {path}",
            plan.timeout_s,
        )
        started = time.monotonic()
        while not (path / MANIFEST).exists():
            if deadline.expired():
                raise WeightSyncTimeout(ctx.message(f"{path / MANIFEST} did not appear within {plan.timeout_s:g}s"))
            time.sleep(_MANIFEST_POLL_S)
        waited = time.monotonic() - started
        manifest = json.loads((path / MANIFEST).read_text())
        foreign = plan.trainer_id and manifest.get("trainer_id") != plan.trainer_id
        if manifest.get("version") != plan.version or foreign:
            raise WeightSyncError(
                ctx.message(
                    f"{path} holds version {manifest.get('version')} of trainer "
                    f"{manifest.get('trainer_id')!r}, not the planned one"
                )
            )
        for bucket in layout.buckets:
            self._load_bucket(path / bucket_file(bucket.index), bucket=bucket, params=params, ctx=ctx)
        return Received(waited_s=waited, sender_checksums=manifest.get("checksums") or {})

    @staticmethod
    def _load_bucket(file: Path, *, bucket: Bucket, params: Mapping[str, torch.Tensor], ctx: SyncContext) -> None:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                names = set(reader.keys())
                expected = {slot.name for slot in bucket.tensors}
                if names != expected:
                    raise WeightSyncError(
                        ctx.message(
                            f"{file.name} holds {sorted(names - expected)} extra and lacks {sorted(expected - names)}"
                        )
                    )
                for slot in bucket.tensors:
                    tensor = reader.get_tensor(slot.name)
                    if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
                        raise WeightSyncError(
                            ctx.message(
                                f"{file.name}: {slot.name} is {tensor.dtype} {list(tensor.shape)}, "
                                f"the plan says {slot.dtype} {list(slot.shape)}"
                            )
                        )
                    params[slot.name].copy_(tensor)
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(ctx.message(f"cannot read {file}: {exc}")) from exc

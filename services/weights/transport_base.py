"""Shared pieces of the weight-sync transports: stats, errors, deadlines and the transport plug-in point.

A transport is a pair of classes, one per side, listed in transport_registry.py under the name that
`WeightSyncPlan.transport` and `weights.transport` use. The publisher/receiver front ends (front_ends.py) do everything
transport-neutral (layout, validation, stats) and hand a transport a validated layout and a deadline.
"""

from __future__ import annotations

import datetime
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from services.contracts.errors import DataLoss, FailedPrecondition
from services.contracts.weight_plan import WeightSyncPlan
from services.weights.layout import Layout, Slot


class WeightSyncError(FailedPrecondition):
    """A weight transfer failed; the message names the transport, the version and the peer."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A peer did not join or a transfer stalled past the plan's deadline (gRPC: DEADLINE_EXCEEDED)."""


class WeightSyncPeerLost(WeightSyncError, ConnectionError):
    """A peer closed its connection mid-transfer, e.g. it crashed (gRPC: UNAVAILABLE)."""


class WeightChecksumMismatch(WeightSyncError, DataLoss):
    """What an engine received differs from the trainer's checksums (gRPC: DATA_LOSS); the message names the
    buckets or the tensors."""


class WeightSyncRefused(WeightSyncError):
    """The other side refused this sync (mismatched params, foreign trainer) (gRPC: FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class SyncStats:
    """One side's view of one sync. `seconds` is the transfer (after the peers met), `wait_seconds` the
    rendezvous before it; when the plan asked for verification `checksums` (name -> tensor_checksum) or, verifying
    by bucket, `bucket_checksums` (in bucket order), and `checksum_seconds` what computing them took."""

    version: int
    bytes: int
    seconds: float
    checksums: dict[str, str] = field(default_factory=dict)
    transport: str = ""
    wait_seconds: float = 0.0
    bucket_checksums: tuple[str, ...] = ()
    checksum_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Deadline:
    timeout_s: float
    start: float = field(default_factory=time.monotonic)

    def remaining(self) -> float:
        return max(0.0, self.start + self.timeout_s - time.monotonic())

    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def timedelta(self, *, floor_s: float = 0.05) -> datetime.timedelta:
        """What is left, as torch.distributed wants it; never zero (zero means 'no timeout' to some APIs)."""
        return datetime.timedelta(seconds=max(floor_s, self.remaining()))


@dataclass(frozen=True)
class SyncContext:
    """Who is talking to whom, for error messages that say which transport, version and peer failed."""

    transport: str
    version: int
    side: str  # "trainer" or "engine rank N"
    peer: str  # "engine rank(s) [1, 2]" or "trainer rank 0 at HOST:PORT (trainer_id X)"
    timeout_s: float

    def message(self, what: str) -> str:
        return (
            f"{self.transport} weight sync v{self.version} failed on the {self.side}: {what} "
            f"(peer: {self.peer}; deadline {self.timeout_s:g}s)"
        )


@dataclass(frozen=True)
class Received:
    """What a receiving transport reports: seconds it waited for the trainer before data moved, and the
    sender's checksums when the transport carries them (disk manifest), for the receiver to compare."""

    waited_s: float = 0.0
    sender_checksums: Mapping[str, str] = field(default_factory=dict)


class SenderTransport(ABC):
    """Trainer side of a transport. `prepare` returns the plan with the transport's fields filled; `publish` moves the
    tensors (validated pairs in spec order) and returns the seconds it waited for receivers before moving data.
    On failure a transport tears down what it shares with receivers, so the next `prepare` starts afresh."""

    name: str  # the registry key (services/weights/transport_registry.py)

    @abstractmethod
    def prepare(self, *, plan: WeightSyncPlan, layout: Layout, engine_world_size: int) -> WeightSyncPlan: ...

    @abstractmethod
    def publish(
        self,
        *,
        plan: WeightSyncPlan,
        layout: Layout,
        tensors: Iterable[tuple[Slot, torch.Tensor]],
        deadline: Deadline,
        checksums: Mapping[str, str],
    ) -> float:
        """`checksums` fills up (when plan.verify) as `tensors` is consumed, for transports that carry them."""

    def release(self) -> None:  # noqa: B027 - optional hook, a no-op unless overridden
        """Free what the last sync kept alive for receivers (CUDA IPC buffers)."""

    def close(self) -> None:
        self.release()


class ReceiverTransport(ABC):
    """Engine side of a transport: copy the plan's tensors into `params` in place (already validated)."""

    name: str  # the registry key (services/weights/transport_registry.py)

    @abstractmethod
    def receive(
        self, *, plan: WeightSyncPlan, layout: Layout, rank: int, params: Mapping[str, torch.Tensor], deadline: Deadline
    ) -> Received: ...

    def refuse(  # noqa: B027 - optional hook, a no-op unless overridden
        self,
        *,
        plan: WeightSyncPlan,
        rank: int,
        reason: str,
        deadline: Deadline,
    ) -> None:
        """Tell the trainer this receiver will not take part, so it fails now instead of at its deadline; best
        effort within `deadline` (short: the caller raises the real reason next)."""

    def release(self) -> None:  # noqa: B027 - optional hook, a no-op unless overridden
        """Drop what holds device memory between syncs (cuda_ipc: the kept mapping of the trainer's buffers)."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op unless overridden
        """Tear down whatever the transport keeps between syncs."""

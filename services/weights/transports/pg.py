"""`gloo` and `nccl` transports: one process group of trainer rank 0 + every engine rank (SGLang's recipe).

Step by step (trainer = rank 0, engine i = rank `rank_offset`):
  prepare (trainer)   TCPStore(master_addr, port 0, wait_for_workers=False) once; plan gets host/port,
                      group name, world size, timeout; the version's control keys are cleared.
  receive (engine)    params checked against the plan first; then it connects to the store and posts
                      ready (or abort + why, and raises); waits for the trainer's go.
  publish (trainer)   waits until every rank is ready (an abort or the deadline fails it), says go.
  both                build the group once on PrefixStore(group_name, store) — later syncs reuse it — and
                      broadcast bucket after bucket in plan order from rank 0.
Each ready says which group generation the rank holds; if any rank lacks the trainer's (a replaced engine
process), the go names the next generation and every member rebuilds under a fresh prefix, so replacing a
replica costs one group construction, not a failed sync.
Every broadcast and wait carries what is left of the plan's deadline, so a dead or stalled peer fails both
sides within `timeout_s`. A failed sync aborts the group (closing its sockets, which also wakes the peers)
and the trainer's next prepare announces a fresh group name.

Buckets stream: the trainer copies each tensor into its bucket's staging buffer as it arrives and broadcasts
the bucket as soon as it is complete, while filling the next (two buffers per dtype, allocated once per
layout). One-tensor buckets (typically tensors larger than a bucket) skip staging: broadcast from/to the
tensor itself. Everything is sent as uint8 views, so any dtype travels bit-exactly.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import NoReturn

import torch
import torch.distributed as dist

from services.contracts.config import ProcessGroupWeights
from services.contracts.weight_plan import WeightSyncPlan
from services.weights import torch_compat
from services.weights.layout import Bucket, Layout, Slot
from services.weights.transport_base import (
    Deadline,
    Received,
    ReceiverTransport,
    SenderTransport,
    SyncContext,
    WeightSyncError,
    WeightSyncPeerLost,
    WeightSyncTimeout,
)
from services.weights.transports import rendezvous

_STAGING_DEPTH = 2  # staging buffers per dtype: fill one while the other is on the wire


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _gloo_device(*, master_addr: str, is_trainer: bool):
    """Which interface gloo binds: GLOO_SOCKET_IFNAME if set, loopback for a loopback master, the master
    address on the trainer, else the default (the host name's address)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        return dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0])
    if _is_loopback(master_addr):
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    if is_trainer:
        return dist.ProcessGroupGloo.create_device(hostname=master_addr)
    return dist.ProcessGroupGloo.create_default_device()


def _transport_device(backend: str) -> torch.device:
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise WeightSyncError("transport nccl needs CUDA; use gloo (CPU) or disk")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _short(exc: BaseException) -> str:
    """gloo's message without its source location and boilerplate advice."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(" This is typically")[0]


def _classify(exc: BaseException, *, ctx: SyncContext, what: str) -> WeightSyncError:
    if isinstance(exc, WeightSyncError):
        return exc
    text = _short(exc)
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered:
        return WeightSyncTimeout(ctx.message(f"{what} timed out: {text}"))
    if any(s in lowered for s in ("closed by peer", "reset by peer", "broken pipe", "connection refused")):
        return WeightSyncPeerLost(ctx.message(f"{what}: the peer went away: {text}"))
    return WeightSyncError(ctx.message(f"{what}: {text}"))


class _Group:
    """A built process group plus what it needs alive (its store)."""

    def __init__(
        self, *, key: tuple, generation: int, pg: torch_compat.DirectGroup, store: dist.Store, device: torch.device
    ):
        self.key, self.generation, self.pg, self.store, self.device = key, generation, pg, store, device

    def broadcast(self, tensor: torch.Tensor, deadline: Deadline) -> dist.Work:
        return self.pg.broadcast(tensor, 0, deadline.timedelta())

    def abort(self) -> None:
        """Abort closes the sockets at once (peers blocked on us fail immediately) and never blocks."""
        with contextlib.suppress(Exception):  # tearing down a broken group is best effort
            self.pg.abort()


def _build_group(
    *,
    backend: str,
    store: dist.Store,
    group_name: str,
    generation: int,
    rank: int,
    world_size: int,
    master_addr: str,
    deadline: Deadline,
    ctx: SyncContext,
) -> torch_compat.DirectGroup:
    """Construct the group on PrefixStore(group_name); a rebuild (generation g > 0) on PrefixStore(f"{group_name}/g{g}")
    so it never meets the old group's rendezvous keys. Bounded by the deadline like everything else."""
    left = deadline.timedelta()
    store.set_timeout(left)
    prefix = dist.PrefixStore(group_name if generation == 0 else f"{group_name}/g{generation}", store)
    try:
        if backend == "gloo":
            return torch_compat.gloo_group(
                prefix,
                rank=rank,
                world_size=world_size,
                timeout=left,
                device=_gloo_device(master_addr=master_addr, is_trainer=rank == 0),
            )
        return torch_compat.nccl_group(prefix, rank=rank, world_size=world_size, timeout=left)
    except Exception as exc:
        raise _classify(exc, ctx=ctx, what=f"building group {group_name!r} (rank {rank} of {world_size})") from exc


def _wait(work: dist.Work, *, deadline: Deadline, ctx: SyncContext, what: str) -> None:
    try:
        work.wait(deadline.timedelta())
    except Exception as exc:
        raise _classify(exc, ctx=ctx, what=what) from exc


class _Staging:
    """Per-dtype rings of staging buffers for one layout's multi-tensor buckets, allocated once."""

    def __init__(self, *, layout: Layout, device: torch.device, depth: int = _STAGING_DEPTH):
        self.key = (layout.key, device)
        staged = [b for b in layout.buckets if not b.direct]
        sizes: dict[torch.dtype, int] = {}
        counts: dict[torch.dtype, int] = {}
        self._where: dict[int, tuple[torch.dtype, int]] = {}
        for bucket in staged:
            k = counts.get(bucket.dtype, 0)
            self._where[bucket.index] = (bucket.dtype, k % depth)
            counts[bucket.dtype] = k + 1
            sizes[bucket.dtype] = max(sizes.get(bucket.dtype, 0), bucket.nbytes)
        self._rings = {
            dtype: [
                torch.empty(sizes[dtype], dtype=torch.uint8, device=device) for _ in range(min(depth, counts[dtype]))
            ]
            for dtype in sizes
        }

    def get(self, bucket: Bucket) -> tuple[tuple[torch.dtype, int], torch.Tensor]:
        """(ring slot id, the bucket's bytes in it)."""
        where = self._where[bucket.index]
        return where, self._rings[where[0]][where[1]][: bucket.nbytes]


def _typed(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    return buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class ProcessGroupSender(SenderTransport):
    def __init__(self, *, backend: str, config: ProcessGroupWeights, trainer_id: str):
        self.name = backend
        self._backend = backend
        self._config = config
        self._trainer_id = trainer_id
        self._master = rendezvous.MasterStore(host=config.master_addr, timeout_s=config.timeout_s)
        self._group_name: str | None = None
        self._world_size = 0
        self._group: _Group | None = None
        self._generation = -1  # of the group under the current name; bumped on every (re)build
        self._staging: _Staging | None = None

    def prepare(self, *, plan: WeightSyncPlan, layout: Layout, engine_world_size: int) -> WeightSyncPlan:
        world_size = 1 + engine_world_size
        if self._group_name is None or world_size != self._world_size:
            self._teardown()
            self._group_name = f"tandem-{self._backend}-{self._trainer_id}-{uuid.uuid4().hex[:12]}"
            self._world_size = world_size
            self._generation = -1
        plan = self._master.announce(plan, group_name=self._group_name, world_size=world_size)
        device = _transport_device(self._backend)
        if self._staging is None or self._staging.key != (layout.key, device):
            self._staging = None  # free the old layout's buffers before allocating the new ones
            self._staging = _Staging(layout=layout, device=device)
        return plan

    def publish(
        self,
        *,
        plan: WeightSyncPlan,
        layout: Layout,
        tensors: Iterable[tuple[Slot, torch.Tensor]],
        deadline: Deadline,
        checksums: Mapping[str, str],
    ) -> float:
        ctx, ctl = self._begin_publish(plan)
        started = time.monotonic()
        try:
            held = rendezvous.await_engines(
                ctl, version=plan.version, world_size=plan.world_size, kind="ready", deadline=deadline, ctx=ctx
            )
            return self._publish_ready(
                plan=plan,
                layout=layout,
                tensors=tensors,
                deadline=deadline,
                ctx=ctx,
                ctl=ctl,
                held=held,
                started=started,
            )
        except BaseException as exc:  # noqa: BLE001 - _fail re-raises it, or a WeightSyncError for it
            self._fail(exc, plan=plan, ctl=ctl, ctx=ctx, what="sending")

    def _begin_publish(self, plan: WeightSyncPlan) -> tuple[SyncContext, dist.PrefixStore]:
        """The plan must be the one prepared last; (who talks to whom, the control store of its group)."""
        if plan.group_name != self._group_name or self._staging is None:
            raise ValueError(
                f"{self.name} weight sync v{plan.version}: plan is not the one this trainer prepared "
                f"last (group {plan.group_name!r}, expected {self._group_name!r})"
            )
        ctx = SyncContext(
            self.name, plan.version, "trainer", f"engine rank(s) {list(range(1, plan.world_size))}", plan.timeout_s
        )
        return ctx, rendezvous.ctl_store(self._master.store, plan.group_name)

    def _publish_ready(
        self,
        *,
        plan: WeightSyncPlan,
        layout: Layout,
        tensors: Iterable[tuple[Slot, torch.Tensor]],
        deadline: Deadline,
        ctx: SyncContext,
        ctl: dist.Store,
        held: dict[int, str],
        started: float,
    ) -> float:
        """Every rank is ready (`held`: what each posted, the group generation it holds): go, then broadcast
        bucket by bucket. Returns the seconds waited for the ranks since `started`."""
        generation = self._choose_generation(plan=plan, held=held)
        rendezvous.signal_go(ctl, version=plan.version, value=f"ok {generation}", ctx=ctx)
        waited = time.monotonic() - started
        group = self._ensure_group(plan=plan, generation=generation, deadline=deadline, ctx=ctx)
        self._send(group=group, layout=layout, tensors=tensors, deadline=deadline, ctx=ctx)
        return waited

    def _fail(
        self, exc: BaseException, *, plan: WeightSyncPlan, ctl: dist.Store, ctx: SyncContext, what: str
    ) -> NoReturn:
        """Tell the engines, drop the group (the next prepare announces a fresh one), raise a WeightSyncError."""
        rendezvous.try_signal_abort(ctl, version=plan.version, why=str(exc))
        self._teardown()
        if isinstance(exc, (WeightSyncError, ValueError)) or not isinstance(exc, Exception):
            raise exc
        raise _classify(exc, ctx=ctx, what=what) from exc

    def _choose_generation(self, *, plan: WeightSyncPlan, held: dict[int, str]) -> int:
        """Reuse the built group only if every rank holds it; a rank that does not (a replaced engine process)
        makes every member rebuild under the next generation, instead of failing this sync."""
        group = self._group
        if group is not None and group.key == (plan.group_name, plan.world_size):
            if all(value == str(group.generation) for value in held.values()):
                return group.generation
            group.abort()
            self._group = None
        self._generation += 1
        return self._generation

    def _ensure_group(self, *, plan: WeightSyncPlan, generation: int, deadline: Deadline, ctx: SyncContext) -> _Group:
        key = (plan.group_name, plan.world_size)
        if self._group is None or self._group.key != key or self._group.generation != generation:
            store = self._master.store
            pg = _build_group(
                backend=self._backend,
                store=store,
                group_name=plan.group_name,
                generation=generation,
                rank=0,
                world_size=plan.world_size,
                master_addr=plan.master_addr,
                deadline=deadline,
                ctx=ctx,
            )
            self._group = _Group(
                key=key, generation=generation, pg=pg, store=store, device=_transport_device(self._backend)
            )
        return self._group

    def _send(
        self,
        *,
        group: _Group,
        layout: Layout,
        tensors: Iterable[tuple[Slot, torch.Tensor]],
        deadline: Deadline,
        ctx: SyncContext,
    ) -> None:
        staging = self._staging
        assert staging is not None
        left = {b.index: len(b.tensors) for b in layout.buckets}
        on_wire: dict[tuple[torch.dtype, int], tuple[int, dist.Work]] = {}  # ring slot -> (bucket, work)
        next_index = 0
        for slot, tensor in tensors:
            bucket = layout.buckets[slot.bucket]
            completes = bucket.direct or left[bucket.index] == 1  # this tensor completes its bucket
            if completes and bucket.index != next_index:  # cannot happen: layout indices follow completion order
                raise WeightSyncError(ctx.message(f"internal: bucket {bucket.index} completes before {next_index}"))
            if bucket.direct:
                if bucket.nbytes:
                    source = tensor.detach().to(group.device).contiguous()
                    # the caller may reuse the tensor's memory after we move on: wait for this one
                    _wait(
                        group.broadcast(_wire(source), deadline),
                        deadline=deadline,
                        ctx=ctx,
                        what=f"broadcasting bucket {bucket.index} of {len(layout.buckets)} ({slot.name})",
                    )
                next_index += 1
                continue
            ring_slot, buffer = staging.get(bucket)
            if slot == bucket.tensors[0] and ring_slot in on_wire:
                previous, work = on_wire.pop(ring_slot)
                _wait(work, deadline=deadline, ctx=ctx, what=f"broadcasting bucket {previous} of {len(layout.buckets)}")
            _typed(buffer, slot).copy_(tensor.detach())
            left[bucket.index] -= 1
            if left[bucket.index] == 0:
                if bucket.nbytes:
                    on_wire[ring_slot] = (bucket.index, group.broadcast(buffer, deadline))
                next_index += 1
        for index, work in sorted(on_wire.values(), key=lambda item: item[0]):
            _wait(work, deadline=deadline, ctx=ctx, what=f"broadcasting bucket {index} of {len(layout.buckets)}")

    def _teardown(self) -> None:
        if self._group is not None:
            self._group.abort()
        self._group = None
        self._group_name = None  # the next prepare announces a fresh group

    def close(self) -> None:
        self._teardown()
        self._staging = None
        self._master.close()


class ProcessGroupReceiver(ReceiverTransport):
    def __init__(self, *, backend: str):
        self.name = backend
        self._backend = backend
        self._trainer_store = rendezvous.TrainerStore()
        self._group: _Group | None = None
        self._staging: _Staging | None = None

    @staticmethod
    def _context(plan: WeightSyncPlan, rank: int) -> SyncContext:
        peer = f"trainer rank 0 at {plan.master_addr}:{plan.master_port} (trainer_id {plan.trainer_id or '?'})"
        return SyncContext(plan.transport, plan.version, f"engine rank {rank}", peer, plan.timeout_s)

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
            store = self._trainer_store.get(plan, deadline=deadline, ctx=ctx)
            ctl = rendezvous.ctl_store(store, plan.group_name)
            key = (plan.master_addr, plan.master_port, plan.group_name, plan.world_size, rank)
            held = str(self._group.generation) if self._group is not None and self._group.key == key else "-"
            rendezvous.post(ctl, version=plan.version, kind="ready", rank=rank, value=held, ctx=ctx)
            answer = rendezvous.await_go(ctl, version=plan.version, deadline=deadline, ctx=ctx)
            waited = time.monotonic() - started
            group = self._ensure_group(
                plan=plan, key=key, generation=int(answer or 0), store=store, deadline=deadline, ctx=ctx
            )
            self._recv(group=group, layout=layout, params=params, deadline=deadline, ctx=ctx)
            return Received(waited_s=waited)
        except BaseException as exc:
            self._teardown()
            if isinstance(exc, WeightSyncError) or not isinstance(exc, Exception):
                raise
            raise _classify(exc, ctx=ctx, what="receiving") from exc

    def _ensure_group(
        self,
        *,
        plan: WeightSyncPlan,
        key: tuple,
        generation: int,
        store: dist.TCPStore,
        deadline: Deadline,
        ctx: SyncContext,
    ) -> _Group:
        if self._group is None or self._group.key != key or self._group.generation != generation:
            if self._group is not None:
                self._group.abort()
            self._group = None
            pg = _build_group(
                backend=self._backend,
                store=store,
                group_name=plan.group_name,
                generation=generation,
                rank=key[-1],
                world_size=plan.world_size,
                master_addr=plan.master_addr,
                deadline=deadline,
                ctx=ctx,
            )
            self._group = _Group(
                key=key, generation=generation, pg=pg, store=store, device=_transport_device(self._backend)
            )
        return self._group

    def _recv(
        self, *, group: _Group, layout: Layout, params: Mapping[str, torch.Tensor], deadline: Deadline, ctx: SyncContext
    ) -> None:
        """Post broadcasts in plan order (at most two staged per dtype in flight); unpack each as it lands."""
        if self._staging is None or self._staging.key != (layout.key, group.device):
            self._staging = None
            self._staging = _Staging(layout=layout, device=group.device)
        in_ring: dict[tuple[torch.dtype, int], tuple[Bucket, dist.Work, torch.Tensor]] = {}
        direct: list[tuple[Bucket, dist.Work, torch.Tensor]] = []
        total = len(layout.buckets)

        def land(bucket: Bucket, work: dist.Work, buffer: torch.Tensor) -> None:
            _wait(work, deadline=deadline, ctx=ctx, what=f"receiving bucket {bucket.index} of {total}")
            if bucket.direct:
                target = params[bucket.tensors[0].name]
                if buffer.data_ptr() != target.data_ptr() or buffer.device != target.device:
                    target.copy_(buffer.view(target.dtype).view(target.shape))
                return
            for slot in bucket.tensors:
                params[slot.name].copy_(_typed(buffer, slot))

        for bucket in layout.buckets:
            if not bucket.nbytes:
                continue
            if bucket.direct:
                target = params[bucket.tensors[0].name].detach()
                if target.device != group.device or not target.is_contiguous():
                    target = torch.empty(target.shape, dtype=target.dtype, device=group.device)
                buffer = _wire(target)
                direct.append((bucket, group.broadcast(buffer, deadline), buffer))
                continue
            ring_slot, buffer = self._staging.get(bucket)
            if ring_slot in in_ring:
                land(*in_ring.pop(ring_slot))
            in_ring[ring_slot] = (bucket, group.broadcast(buffer, deadline), buffer)
        for item in sorted([*in_ring.values(), *direct], key=lambda item: item[0].index):
            land(*item)

    def _teardown(self) -> None:
        if self._group is not None:
            self._group.abort()
        self._group = None
        self._trainer_store.clear()

    def close(self) -> None:
        self._teardown()
        self._staging = None

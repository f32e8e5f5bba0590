"""`gloo` / `nccl` toward SGLang engines: the trainer joins SGLang's own weight-update group protocol.

An SGLang server builds its side of the group itself, inside POST /init_weights_update_group, with
`init_custom_process_group` (sglang/srt/utils: `rendezvous("tcp://addr:port", rank, world)` ->
`PrefixStore(group_name, store)` -> torch's `_new_process_group_helper(world, rank, [], backend, store,
group_name=...)`), and receives inside POST /update_weights_from_distributed: per tensor (an async
`broadcast(torch.empty(shape, dtype), src=0)` for each announced name, in order, then waits) or, with
`load_format: "flattened_bucket"`, one uint8 broadcast of the announced tensors' bytes concatenated without
padding (FlattenedTensorBucket). So the trainer side here:
  - is rank 0 of world = 1 + engine GPUs; engine i's ranks start at rank_offset = 1 + sum of the previous tp;
  - plays the tcp:// rendezvous' rank-0 store with the TCPStore that `prepare` started (SGLang's ranks connect to
    master_address:master_port as clients) and builds the group on `PrefixStore(group_name, store)` through the
    same torch helper, so both sides meet on the same keys. A group built any other way (init_process_group, or
    ProcessGroupGloo straight on the prefix as pg.py does) never meets SGLang's: a silent timeout;
  - broadcasts exactly what each update request announces, in the announced order. The rollout adapter sends one
    /update_weights_from_distributed per plan bucket (tensors in bucket order; tensors without elements are
    left out, there is nothing to load), so the trainer broadcasts bucket after bucket as pg.py does, staging
    multi-tensor buckets, and either each tensor of a bucket in its own dtype and shape ("tensor") or the bucket's
    bytes ("flattened_bucket" — a plan bucket is exactly a FlattenedTensorBucket's layout).

Handshake over the trainer's store (rendezvous.py keys). SGLang cannot post keys; the rollout adapter
(services/rollout/engines/sglang/engine.py) does it for its servers: `ready` for each engine rank with the value `sglang
held=<generation|-> format=<tensor|flattened_bucket>`, then it waits for `go` ("ok <generation>") and only then
calls /init_weights_update_group (which blocks inside SGLang until the trainer joins) and the updates; once every
update request of a server has answered success it posts `done` for that server's ranks, and the trainer's publish
returns only after every rank's done (a broadcast can complete into socket buffers before SGLang has the tensors).
The group of generation g is named `group_name` (g = 0) or `group_name-g<g>`: SGLang registers group names with
torch and keeps its groups between requests, so a rebuild (a replaced server or adapter) needs a new name. When an
SGLang call fails the adapter posts `abort` with SGLang's message; the trainer watches for it while it joins and
broadcasts, so it fails at once with that message instead of at its deadline.

`SGLangAwareSender` is the sender of "gloo" and "nccl" in the registry (weights/transport_registry.py): when every
rank's ready says sglang it takes this path; when none does it is pg.ProcessGroupSender unchanged; a mix is refused.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.contracts.config import ProcessGroupWeights
from services.contracts.weight_plan import WeightSyncPlan
from services.weights import torch_compat
from services.weights.layout import Bucket, Layout, Slot
from services.weights.transport_base import (
    Deadline,
    SyncContext,
    WeightSyncError,
    WeightSyncRefused,
    WeightSyncTimeout,
)
from services.weights.transports import rendezvous
from services.weights.transports.pg import (
    ProcessGroupSender,
    _classify,
    _transport_device,
    _typed,
    _wire,
)

READY_PREFIX = "sglang"
FORMATS = ("tensor", "flattened_bucket")
_ABORT_CHECK_S = 0.02  # how often a wait looks at the engines' abort keys
_WORK_POLL_MAX_S = 0.005  # the longest pause between looks at pending broadcasts


@dataclass(frozen=True)
class SGLangReady:
    held: int | None  # generation of the group the engine holds under this plan's name, None = none
    format: str


def ready_value(*, held: int | None, load_format: str) -> str:
    if load_format not in FORMATS:
        raise ValueError(f"load format must be one of {', '.join(FORMATS)}, got {load_format!r}")
    return f"{READY_PREFIX} held={'-' if held is None else held} format={load_format}"


def parse_ready(value: str) -> SGLangReady | None:
    """The adapter's ready value, or None for a native receiver's (a plain generation number or "-")."""
    parts = value.split()
    if not parts or parts[0] != READY_PREFIX:
        return None
    fields = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
    held = fields.get("held", "-")
    load_format = fields.get("format", "")
    if load_format not in FORMATS or not (held == "-" or held.isdigit()):
        raise WeightSyncRefused(f"malformed SGLang ready value {value!r}")
    return SGLangReady(held=None if held == "-" else int(held), format=load_format)


def group_name_for(group_name: str, generation: int) -> str:
    return group_name if generation == 0 else f"{group_name}-g{generation}"


def wire_tensors(bucket: Bucket) -> list[Slot]:
    """The tensors of a bucket that travel (and are announced to SGLang): those with elements."""
    return [s for s in bucket.tensors if s.nbytes > 0]


def join_sglang_group(
    *, backend: str, store: dist.Store, group_name: str, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    """The trainer's half of SGLang's init_custom_process_group: the same PrefixStore(group_name) over the rendezvous
    store and the same torch helper (torch_compat.registered_group)."""
    store.set_timeout(timeout)
    return torch_compat.registered_group(
        backend=backend, store=store, group_name=group_name, rank=rank, world_size=world_size, timeout=timeout
    )


class _SGLangGroup:
    def __init__(self, *, key: tuple, generation: int, pg: dist.ProcessGroup, store: dist.Store, device: torch.device):
        self.key, self.generation, self.pg, self.store, self.device = key, generation, pg, store, device

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        return dist.broadcast(tensor, src=0, group=self.pg, async_op=True)

    def close(self, *, abort: bool) -> None:
        try:
            if abort:
                self.pg.abort()
            dist.destroy_process_group(self.pg)
        except Exception:  # noqa: BLE001 - tearing down a broken group is best effort
            pass


class _Watch:
    """Waits that also watch the engines' abort keys and the deadline (a failed SGLang call fails us at once)."""

    def __init__(self, *, ctl: dist.Store, plan: WeightSyncPlan, deadline: Deadline, ctx: SyncContext):
        self.ctl, self.plan, self.deadline, self.ctx = ctl, plan, deadline, ctx
        self._next_check = 0.0

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + _ABORT_CHECK_S
        version = self.plan.version
        for rank in range(1, self.plan.world_size):
            if self.ctl.check([f"v{version}/abort/{rank}"]):
                why = self.ctl.get(f"v{version}/abort/{rank}").decode(errors="replace")
                raise WeightSyncRefused(self.ctx.message(f"SGLang engine rank {rank} gave up: {why}"))
        if self.deadline.expired():
            raise WeightSyncTimeout(
                self.ctx.message(f"SGLang engines did not finish within {self.deadline.timeout_s:g}s")
            )

    def works(self, works: Sequence[dist.Work], *, what: str) -> None:
        sleep = 0.0001
        while not all(w.is_completed() for w in works):
            try:
                self.check()
            except WeightSyncTimeout as exc:
                raise WeightSyncTimeout(
                    self.ctx.message(f"{what} did not complete within {self.deadline.timeout_s:g}s")
                ) from exc
            time.sleep(sleep)
            sleep = min(_WORK_POLL_MAX_S, sleep * 2)
        for work in works:
            try:
                work.wait()
            except Exception as exc:
                raise _classify(exc, ctx=self.ctx, what=what) from exc

    def thread(self, target, *, what: str):
        value: list[Any] = []
        error: list[BaseException] = []

        def run() -> None:
            try:
                value.append(target())
            except BaseException as exc:  # noqa: BLE001 - handed to the watching thread
                error.append(exc)

        worker = threading.Thread(target=run, daemon=True, name="sglang-group-join")
        worker.start()
        while worker.is_alive():
            worker.join(timeout=_ABORT_CHECK_S)
            if worker.is_alive():
                self.check()  # on a refusal or the deadline the join thread is left to time out on its own
        if error:
            raise _classify(error[0], ctx=self.ctx, what=what)
        return value[0]


class SGLangAwareSender(ProcessGroupSender):
    """pg.ProcessGroupSender, plus the SGLang protocol when the engine ranks' ready values say they are SGLang
    servers (publish is pg's; what follows every rank's ready is chosen here)."""

    def __init__(self, *, backend: str, config: ProcessGroupWeights, trainer_id: str):
        super().__init__(backend=backend, config=config, trainer_id=trainer_id)
        self._sglang: _SGLangGroup | None = None
        self._sglang_generation = -1

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
        readies = {rank: parse_ready(value) for rank, value in held.items()}
        sglang = {rank: r for rank, r in readies.items() if r is not None}
        if not sglang:  # native receivers: the plain process-group transport
            return super()._publish_ready(
                plan=plan,
                layout=layout,
                tensors=tensors,
                deadline=deadline,
                ctx=ctx,
                ctl=ctl,
                held=held,
                started=started,
            )
        try:
            formats = {r.format for r in sglang.values()}
            if len(sglang) != len(readies) or len(formats) != 1:
                raise WeightSyncRefused(
                    ctx.message(
                        f"engine ranks disagree: SGLang ranks {sorted(sglang)} (formats {sorted(formats)}) and "
                        f"native ranks {sorted(set(readies) - set(sglang))} cannot share one sync"
                    )
                )
            generation = self._choose_sglang_generation(plan=plan, readies=sglang)
            rendezvous.signal_go(ctl, version=plan.version, value=f"ok {generation}", ctx=ctx)
            waited = time.monotonic() - started
            watch = _Watch(ctl=ctl, plan=plan, deadline=deadline, ctx=ctx)
            group = self._ensure_sglang_group(plan=plan, generation=generation, deadline=deadline, watch=watch)
            self._send_sglang(group=group, layout=layout, tensors=tensors, load_format=formats.pop(), watch=watch)
            # a broadcast can complete into socket buffers: done is SGLang's success answer, relayed by the adapter
            rendezvous.await_engines(
                ctl, version=plan.version, world_size=plan.world_size, kind="done", deadline=deadline, ctx=ctx
            )
            return waited
        except BaseException as exc:  # noqa: BLE001 - _fail re-raises it, or a WeightSyncError for it
            self._fail(exc, plan=plan, ctl=ctl, ctx=ctx, what="sending to SGLang")

    def _choose_sglang_generation(self, *, plan: WeightSyncPlan, readies: Mapping[int, SGLangReady]) -> int:
        """Keep the group only if every SGLang rank still holds it; else every member joins the next one."""
        group = self._sglang
        if (
            group is not None
            and group.key == (plan.group_name, plan.world_size)
            and all(r.held == group.generation for r in readies.values())
        ):
            return group.generation
        if group is not None:
            group.close(abort=True)
            self._sglang = None
        self._sglang_generation += 1
        return self._sglang_generation

    def _ensure_sglang_group(
        self, *, plan: WeightSyncPlan, generation: int, deadline: Deadline, watch: _Watch
    ) -> _SGLangGroup:
        key = (plan.group_name, plan.world_size)
        if self._sglang is not None and self._sglang.key == key and self._sglang.generation == generation:
            return self._sglang
        name = group_name_for(plan.group_name, generation)
        # A client connection of its own: the join blocks in store reads, and a TCPStore client serves one request
        # at a time, so sharing the master's would stall the abort polling (and the abort signal) behind it.
        store = rendezvous.connect_store(
            host=self._config.master_addr, port=self._master.port, deadline=deadline, ctx=watch.ctx
        )
        pg = watch.thread(
            lambda: join_sglang_group(
                backend=self._backend,
                store=store,
                group_name=name,
                rank=0,
                world_size=plan.world_size,
                timeout=deadline.timedelta(),
            ),
            what=f"joining SGLang's group {name!r} (rank 0 of {plan.world_size})",
        )
        self._sglang = _SGLangGroup(
            key=key, generation=generation, pg=pg, store=store, device=_transport_device(self._backend)
        )
        return self._sglang

    def _send_sglang(
        self,
        *,
        group: _SGLangGroup,
        layout: Layout,
        tensors: Iterable[tuple[Slot, torch.Tensor]],
        load_format: str,
        watch: _Watch,
    ) -> None:
        """Bucket after bucket, as one /update_weights_from_distributed request each receives it; a ring slot of
        the staging buffers is refilled only once the broadcasts that read it have completed."""
        staging = self._staging
        assert staging is not None
        total = len(layout.buckets)
        left = {b.index: len(b.tensors) for b in layout.buckets}
        on_wire: dict[tuple[torch.dtype, int], tuple[int, list[dist.Work]]] = {}
        direct: list[tuple[int, list[dist.Work], torch.Tensor]] = []

        def send(bucket: Bucket, source: torch.Tensor) -> list[dist.Work]:
            slots = wire_tensors(bucket)
            if not slots:
                return []
            if load_format == "flattened_bucket":
                return [group.broadcast(source if bucket.direct else source[: bucket.nbytes])]
            if bucket.direct:
                return [group.broadcast(source.view(slots[0].dtype).view(slots[0].shape))]
            return [group.broadcast(_typed(source, slot)) for slot in slots]

        for slot, tensor in tensors:
            bucket = layout.buckets[slot.bucket]
            watch.check()
            if bucket.direct:
                source = _wire(tensor.detach().to(group.device).contiguous())
                works = send(bucket, source)
                direct.append((bucket.index, works, source))  # keeps the source alive until it is sent
                if len(direct) > 2:
                    index, pending, _ = direct.pop(0)
                    watch.works(pending, what=f"broadcasting bucket {index} of {total}")
                continue
            ring_slot, buffer = staging.get(bucket)
            if slot == bucket.tensors[0] and ring_slot in on_wire:
                previous, pending = on_wire.pop(ring_slot)
                watch.works(pending, what=f"broadcasting bucket {previous} of {total}")
            _typed(buffer, slot).copy_(tensor.detach())
            left[bucket.index] -= 1
            if left[bucket.index] == 0:
                on_wire[ring_slot] = (bucket.index, send(bucket, buffer))
        for index, pending in sorted([*on_wire.values(), *((i, w) for i, w, _ in direct)], key=lambda x: x[0]):
            watch.works(pending, what=f"broadcasting bucket {index} of {total}")

    def _teardown(self) -> None:
        if self._sglang is not None:
            self._sglang.close(abort=True)
        self._sglang = None
        self._sglang_generation = -1  # the next prepare announces a new group name
        super()._teardown()


class EngineHandshake:
    """The rollout adapter's half of the handshake, on behalf of the SGLang servers it drives (SGLang itself only
    ever connects to the store inside init_custom_process_group)."""

    def __init__(self, *, refuse_timeout_s: float) -> None:
        """`refuse_timeout_s`: how long a best-effort refusal may try to reach the trainer's store."""
        self._trainer_store = rendezvous.TrainerStore()
        self._refuse_timeout_s = refuse_timeout_s

    def ctl(self, plan: WeightSyncPlan, *, deadline: Deadline, ctx: SyncContext) -> dist.Store:
        return self._trainer_store.ctl(plan, deadline=deadline, ctx=ctx)

    def post_ready(
        self, plan: WeightSyncPlan, *, ranks: Sequence[int], value: str, deadline: Deadline, ctx: SyncContext
    ) -> None:
        ctl = self.ctl(plan, deadline=deadline, ctx=ctx)
        for rank in ranks:
            rendezvous.post(ctl, version=plan.version, kind="ready", rank=rank, value=value, ctx=ctx)

    def await_go(self, plan: WeightSyncPlan, *, deadline: Deadline, ctx: SyncContext) -> int:
        """The trainer's go once every rank is ready: the generation of the group to join."""
        ctl = self.ctl(plan, deadline=deadline, ctx=ctx)
        answer = rendezvous.await_go(ctl, version=plan.version, deadline=deadline, ctx=ctx)
        if not answer.isdigit():
            raise WeightSyncError(
                ctx.message(
                    f"the trainer answered {answer!r}, not a group generation: does its "
                    f"Tandem version speak the SGLang protocol?"
                )
            )
        return int(answer)

    def post_done(self, plan: WeightSyncPlan, *, ranks: Sequence[int], deadline: Deadline, ctx: SyncContext) -> None:
        """Every update request of these ranks' server answered success."""
        ctl = self.ctl(plan, deadline=deadline, ctx=ctx)
        for rank in ranks:
            rendezvous.post(ctl, version=plan.version, kind="done", rank=rank, value="ok", ctx=ctx)

    def refuse(self, plan: WeightSyncPlan, *, ranks: Sequence[int], reason: str, ctx: SyncContext) -> None:
        """Best effort: the trainer fails now with `reason` instead of at its deadline."""
        self._trainer_store.refuse(plan, ranks=ranks, reason=reason, deadline=Deadline(self._refuse_timeout_s), ctx=ctx)

    def close(self) -> None:
        self._trainer_store.clear()

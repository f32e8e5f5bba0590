"""The SGLang adapter's side of a gloo / nccl weight sync, for every server of one engine.

Ready for every server's ranks -> the trainer's go -> each server, concurrently: join the group when it does not
hold this generation (/init_weights_update_group), then one /update_weights_from_distributed per plan bucket
inside /begin_weight_update ... /end_weight_update where the server has them (none asks SGLang to flush: a failed
flush inside an update kills its scheduler), the adapter's own /flush_cache, then `done` for its ranks. The
trainer's half and the handshake keys are in services/rollout/engines/sglang/weight_send_group.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.contracts.weight_plan import WeightSyncPlan
from services.rollout.engines.sglang.http import SGLangError, SGLangNotFound, wait_for_all
from services.rollout.engines.sglang.protocol import BadAnswer, distributed_update_body, init_group_body
from services.rollout.engines.sglang.servers import Server
from services.rollout.engines.sglang.weight_send_group import EngineHandshake, group_name_for, ready_value, wire_tensors
from services.weights.layout import dtype_name, layout_from_plan
from services.weights.transport_base import Deadline, SyncContext, WeightSyncError


class DistributedSync:
    """`probe_s` bounds the best-effort cleanup calls (end_weight_update after a failure, destroying an old group);
    `flush` is the adapter's best-effort /flush_cache on one server once its update is complete."""

    def __init__(
        self,
        servers: Sequence[Server],
        *,
        handshake: EngineHandshake,
        pool: ThreadPoolExecutor,
        load_format: str,
        probe_s: float,
        flush: Callable[[Server], None],
    ):
        self.servers = servers
        self._flush = flush
        self._handshake = handshake
        self._pool = pool
        self._load_format = load_format
        self._probe_s = probe_s

    def receive(self, plan: WeightSyncPlan, *, rank_offset: int, deadline: Deadline, ctx: SyncContext) -> None:
        """Takes part in `plan` for every server (the steps in the module docstring); the first server's failure is
        raised once all have answered."""
        offsets: list[tuple[int, list[int]]] = []  # per server: its rank offset and its ranks
        next_rank = rank_offset
        for server in self.servers:
            offsets.append((next_rank, list(range(next_rank, next_rank + server.info.tp_size))))
            next_rank += server.info.tp_size
        key = (plan.master_addr, plan.master_port, plan.group_name, plan.world_size)
        try:
            for server, (offset, ranks) in zip(self.servers, offsets, strict=True):
                held = server.held((*key, offset))
                value = ready_value(held=held, load_format=self._load_format)
                self._handshake.post_ready(plan, ranks=ranks, value=value, deadline=deadline, ctx=ctx)
            generation = self._handshake.await_go(plan, deadline=deadline, ctx=ctx)
        except WeightSyncError:
            for server in self.servers:
                server.group = None
            raise
        buckets = [wire_tensors(b) for b in layout_from_plan(plan).buckets]
        futures = [
            self._pool.submit(
                self._update_server,
                server,
                plan,
                offset=offset,
                ranks=ranks,
                generation=generation,
                buckets=[b for b in buckets if b],
                deadline=deadline,
                ctx=ctx,
            )
            for server, (offset, ranks) in zip(self.servers, offsets, strict=True)
        ]
        wait_for_all(futures)

    def _update_server(
        self,
        server: Server,
        plan: WeightSyncPlan,
        *,
        offset: int,
        ranks: list[int],
        generation: int,
        buckets: list[list[Any]],
        deadline: Deadline,
        ctx: SyncContext,
    ) -> None:
        key = (plan.master_addr, plan.master_port, plan.group_name, plan.world_size, offset)
        name = group_name_for(plan.group_name, generation)
        session = False
        try:
            if server.held(key) != generation:
                self._leave_group(server)
                server.client.post(
                    "/init_weights_update_group",
                    init_group_body(
                        master_address=plan.master_addr,
                        master_port=plan.master_port,
                        rank_offset=offset,
                        world_size=plan.world_size,
                        group_name=name,
                        backend=plan.transport,
                    ),
                    timeout_s=_left(deadline),
                )
                server.group, server.group_name = (*key, generation), name
            session = begin_session(server, deadline)
            for i, slots in enumerate(buckets):
                last = i == len(buckets) - 1
                server.client.post(
                    "/update_weights_from_distributed",
                    distributed_update_body(
                        names=[s.name for s in slots],
                        dtypes=[dtype_name(s.dtype) for s in slots],
                        shapes=[list(s.shape) for s in slots],
                        group_name=name,
                        weight_version=str(plan.version) if last else None,
                        load_format=self._load_format,
                    ),
                    timeout_s=_left(deadline),
                )
            if session:
                server.client.post("/end_weight_update", {}, timeout_s=_left(deadline))
            self._flush(server)
            self._handshake.post_done(plan, ranks=ranks, deadline=deadline, ctx=ctx)
        except (SGLangError, BadAnswer) as exc:
            server.group = None  # the trainer drops its group after any failure; the next sync joins a new one
            self._handshake.refuse(plan, ranks=ranks, reason=str(exc), ctx=ctx)
            if session:  # best effort: a session left open would refuse the next sync's begin
                with contextlib.suppress(SGLangError):
                    server.client.post("/end_weight_update", {}, timeout_s=self._probe_s)
            raise WeightSyncError(ctx.message(f"SGLang at {server.url}: {exc}")) from exc

    def _leave_group(self, server: Server) -> None:
        """Best effort: the server frees the group it holds under an older name (SGLang keeps groups by name)."""
        if server.group is None or not server.group_name:
            return
        with contextlib.suppress(SGLangError):
            server.client.post(
                "/destroy_weights_update_group", {"group_name": server.group_name}, timeout_s=self._probe_s
            )
        server.group, server.group_name = None, ""


def begin_session(server: Server, deadline: Deadline) -> bool:
    """POST /begin_weight_update where the server has it (required from 0.5.23; probed once before that, 0.5.17
    answers 404): whether a session is open, to be ended with /end_weight_update."""
    if server.session is False:
        return False
    try:
        server.client.post("/begin_weight_update", {}, timeout_s=_left(deadline))
    except SGLangNotFound as exc:
        if server.profile.session == "required":
            raise SGLangError(
                f"SGLang {server.info.version} at {server.url} has no /begin_weight_update, which "
                f"0.5.23 and later require around weight updates: {exc}"
            ) from exc
        server.session = False
        return False
    server.session = True
    return True


def _left(deadline: Deadline) -> float:
    return max(0.001, deadline.remaining())

"""The control handshake of a sync over the trainer's TCPStore, shared by the process-group and CUDA IPC
transports.

Keys live under `PrefixStore(f"{group_name}/ctl")`, per version:
  v{V}/ready/{rank}   an engine rank arrived and its params match the plan (value: transport-specific, e.g. the
                      process-group generation it holds)
  v{V}/abort/{rank}   an engine rank refuses (value: why) — the trainer fails at once instead of at its deadline
  v{V}/go             the trainer's answer once every rank is ready: b"ok[ <payload>]", or b"abort: <why>"
  v{V}/done/{rank}    (cuda_ipc) the rank has copied the buffers and closed its handles
Everything here polls with `check` (non-blocking) against a deadline, so no step can block past it.
The trainer clears a version's keys in `prepare`, so a retried version cannot see stale answers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch.distributed as dist

from services.contracts.weight_plan import WeightBucket, WeightSyncPlan
from services.weights.transport_base import (
    Deadline,
    SyncContext,
    WeightSyncError,
    WeightSyncPeerLost,
    WeightSyncRefused,
    WeightSyncTimeout,
)

_POLL_MAX_S = 0.005
_REASON_MAX = 4000  # characters of a refusal's reason posted to the trainer


class _Backoff:
    """Poll fast at first (a CUDA IPC sync is over in milliseconds), then every 5 ms."""

    def __init__(self) -> None:
        self._sleep = 0.0001

    def wait(self) -> None:
        time.sleep(self._sleep)
        self._sleep = min(_POLL_MAX_S, self._sleep * 2)


class MasterStore:
    """The trainer's TCPStore: port 0 (the OS picks), no waiting for workers; created once, reused."""

    def __init__(self, *, host: str, timeout_s: float):
        self._host = host
        self._timeout_s = timeout_s
        self._store: dist.TCPStore | None = None

    @property
    def store(self) -> dist.TCPStore:
        if self._store is None:
            self._store = dist.TCPStore(
                host_name=self._host,
                port=0,
                is_master=True,
                wait_for_workers=False,
                timeout=Deadline(self._timeout_s).timedelta(),
            )
        return self._store

    @property
    def port(self) -> int:
        return int(self.store.port)

    def announce(
        self,
        plan: WeightSyncPlan,
        *,
        group_name: str,
        world_size: int,
        buckets: tuple[WeightBucket, ...] | None = None,
        sglang_load_format: str | None = None,
    ) -> WeightSyncPlan:
        """`plan` naming this store and its group (and a transport's filled-in buckets or SGLang load format), the
        version's control keys of an earlier try cleared so the ranks start this sync from nothing."""
        plan = replace(
            plan,
            group_name=group_name,
            master_addr=self._host,
            master_port=self.port,
            world_size=world_size,
            buckets=plan.buckets if buckets is None else buckets,
            sglang_load_format=plan.sglang_load_format if sglang_load_format is None else sglang_load_format,
        )
        clear_version(ctl_store(self.store, group_name), version=plan.version, world_size=world_size)
        return plan

    def close(self) -> None:
        self._store = None


class TrainerStore:
    """An engine's client of the trainer's store, connected once and kept while the plans name the same one."""

    def __init__(self) -> None:
        self._key: tuple[str, int] | None = None
        self._store: dist.TCPStore | None = None

    def get(self, plan: WeightSyncPlan, *, deadline: Deadline, ctx: SyncContext) -> dist.TCPStore:
        key = (plan.master_addr, plan.master_port)
        if self._store is None or self._key != key:
            self.clear()  # a new trainer store: the old trainer is gone or restarted
            self._store = connect_store(host=plan.master_addr, port=plan.master_port, deadline=deadline, ctx=ctx)
            self._key = key
        return self._store

    def ctl(self, plan: WeightSyncPlan, *, deadline: Deadline, ctx: SyncContext) -> dist.PrefixStore:
        return ctl_store(self.get(plan, deadline=deadline, ctx=ctx), plan.group_name)

    def refuse(
        self,
        plan: WeightSyncPlan,
        *,
        ranks: Sequence[int],
        reason: str,
        deadline: Deadline,
        ctx: SyncContext,
    ) -> None:
        """Best effort: post `abort` for `ranks` (a first reason stays), so the trainer fails now with `reason`
        instead of at its deadline. Never raises: the caller raises the real reason next."""
        try:
            ctl = self.ctl(plan, deadline=deadline, ctx=ctx)
            for rank in ranks:
                if not ctl.check([f"v{plan.version}/abort/{rank}"]):
                    ctl.set(f"v{plan.version}/abort/{rank}", reason[:_REASON_MAX])
        except Exception:  # noqa: BLE001 - the store may be what failed
            pass

    def clear(self) -> None:
        self._key, self._store = None, None


def ctl_store(store: dist.Store, group_name: str) -> dist.PrefixStore:
    return dist.PrefixStore(f"{group_name}/ctl", store)


def connect_store(*, host: str, port: int, deadline: Deadline, ctx: SyncContext) -> dist.TCPStore:
    """A client of the trainer's store; connecting retries until the deadline, then fails clearly."""
    try:
        return dist.TCPStore(host_name=host, port=port, is_master=False, timeout=deadline.timedelta())
    except Exception as exc:
        raise WeightSyncTimeout(ctx.message(f"cannot reach the trainer's store at {host}:{port}: {exc}")) from exc


def clear_version(ctl: dist.Store, *, version: int, world_size: int) -> None:
    keys = [f"v{version}/go"] + [
        f"v{version}/{kind}/{rank}" for rank in range(1, world_size) for kind in ("ready", "abort", "done")
    ]
    for key in keys:
        ctl.delete_key(key)


def _call(ctx: SyncContext, what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        raise WeightSyncPeerLost(ctx.message(f"store unreachable while {what}: {exc}")) from exc


def await_engines(
    ctl: dist.Store, *, version: int, world_size: int, kind: str, deadline: Deadline, ctx: SyncContext
) -> dict[int, str]:
    """Trainer: wait until every engine rank posted `kind` (ready/done); an abort key fails at once.
    Returns what each rank posted."""
    pending = set(range(1, world_size))
    backoff = _Backoff()
    while True:
        for rank in sorted(pending):
            if _call(ctx, "polling engines", ctl.check, [f"v{version}/abort/{rank}"]):
                reason = _call(ctx, "reading a refusal", ctl.get, f"v{version}/abort/{rank}").decode(errors="replace")
                raise WeightSyncRefused(ctx.message(f"engine rank {rank} refused the sync: {reason}"))
            if _call(ctx, "polling engines", ctl.check, [f"v{version}/{kind}/{rank}"]):
                pending.discard(rank)
        if not pending:
            return {
                rank: _call(ctx, "reading engines", ctl.get, f"v{version}/{kind}/{rank}").decode(errors="replace")
                for rank in range(1, world_size)
            }
        if deadline.expired():
            if kind == "ready":
                what = f"engine rank(s) {sorted(pending)} did not join the sync"
            else:
                joined = [r for r in sorted(pending) if ctl.check([f"v{version}/ready/{r}"])]
                what = f"engine rank(s) {sorted(pending)} did not confirm ({kind}; joined: {joined})"
            raise WeightSyncTimeout(ctx.message(f"{what} within {deadline.timeout_s:g}s"))
        backoff.wait()


def signal_go(ctl: dist.Store, *, version: int, value: str, ctx: SyncContext) -> None:
    _call(ctx, "signalling engines", ctl.set, f"v{version}/go", value.encode())


def try_signal_abort(ctl: dist.Store | None, *, version: int, why: str) -> None:
    """Best effort: tell waiting engines the trainer gave up (never masks the original error)."""
    if ctl is None:
        return
    try:
        if not ctl.check([f"v{version}/go"]):
            ctl.set(f"v{version}/go", f"abort: {why}"[:2000])
    except Exception:  # noqa: BLE001 - the store may be the thing that failed
        pass


def post(ctl: dist.Store, *, version: int, kind: str, rank: int, value: str, ctx: SyncContext) -> None:
    _call(ctx, f"posting {kind}", ctl.set, f"v{version}/{kind}/{rank}", value.encode())


def await_go(ctl: dist.Store, *, version: int, deadline: Deadline, ctx: SyncContext) -> str:
    """Engine: wait for the trainer's go ("ok" or "ok <payload>"; returns the payload); an abort answer or the
    deadline fails clearly."""
    key = f"v{version}/go"
    backoff = _Backoff()
    while not _call(ctx, "waiting for the trainer", ctl.check, [key]):
        if deadline.expired():
            raise WeightSyncTimeout(
                ctx.message(f"the trainer did not start the transfer within {deadline.timeout_s:g}s")
            )
        backoff.wait()
    answer = _call(ctx, "reading the trainer's answer", ctl.get, key).decode(errors="replace")
    if answer != "ok" and not answer.startswith("ok "):
        raise WeightSyncError(ctx.message(f"the trainer called the sync off ({answer})"))
    return answer[3:]

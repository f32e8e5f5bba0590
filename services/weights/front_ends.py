"""The two front ends: `WeightPublisher` (trainer rank 0) and `WeightReceiver` (each engine rank).

They do the transport-neutral work — layout, validation of both sides against the plan, checksums, stats —
and delegate the moving of bytes to the transport the plan names (base.SenderTransport/ReceiverTransport).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from services.contracts.config import ProcessGroupWeights, TimeoutsConfig, WeightsConfig
from services.contracts.weight_plan import WeightSyncPlan
from services.weights.checksums import (
    PendingChecksums,
    announced_bucket_checksums,
    announced_checksums,
    bucket_checksums,
    describe_bucket,
    tensor_checksums,
)
from services.weights.layout import (
    Layout,
    Slot,
    TensorSpec,
    check_params,
    iter_validated,
    layout_from_plan,
    layout_to_buckets,
    plan_layout,
)
from services.weights.transport_base import (
    Deadline,
    ReceiverTransport,
    SenderTransport,
    SyncStats,
    WeightChecksumMismatch,
    WeightSyncError,
    WeightSyncRefused,
)
from services.weights.transport_registry import transport as registered_transport

_MAX_LISTED = 20  # mismatches listed in one error message
_WEIGHTS, _TIMEOUTS = ProcessGroupWeights(), TimeoutsConfig()  # the defaults of a receiver built without a config


class WeightPublisher:
    """Trainer rank 0's side: `prepare` announces a plan, `publish` sends the tensors of that plan."""

    def __init__(
        self,
        *,
        transport: str | SenderTransport | None = None,
        config: WeightsConfig,
        run_dir: Path,
        trainer_id: str,
        sglang_load_format: str | None = None,
    ):
        """`sglang_load_format`: the engines are SGLang servers (rollout.engine sglang) and receive buckets in that
        format (rollout.sglang.weight_load_format); None = native engines."""
        if isinstance(transport, SenderTransport):
            self._transport = transport
        else:
            entry = registered_transport(transport or config.transport)
            if sglang_load_format is not None and entry.sglang_sender is not None:
                self._transport = entry.sglang_sender(config, trainer_id, sglang_load_format)
            else:
                self._transport = entry.sender(config, Path(run_dir), trainer_id)
        self._config = config
        self._trainer_id = trainer_id
        self._prepared: tuple[WeightSyncPlan, Layout] | None = None
        self._lock = threading.Lock()

    @property
    def transport(self) -> str:
        return self._transport.name

    def prepare(
        self,
        specs: Sequence[TensorSpec],
        version: int,
        engine_world_size: int,
        verify: bool = False,
        verify_by_bucket: bool = False,
    ) -> WeightSyncPlan:
        """`verify`: the engines check what they received against checksums the caller announces in the plan (per
        tensor, TensorMeta.checksum; with `verify_by_bucket` per bucket, WeightBucket.checksum)."""
        if engine_world_size < 1:
            raise ValueError(f"engine_world_size must be at least 1, got {engine_world_size}")
        if version < 0:
            raise ValueError(f"weight version must be >= 0, got {version}")
        layout = plan_layout(list(specs), bucket_bytes=max(1, int(self._config.bucket_mb * 2**20)))
        plan = WeightSyncPlan(
            version=version,
            transport=self._transport.name,
            buckets=layout_to_buckets(layout),
            timeout_s=self._config.timeout_s,
            verify=verify,
            total_bytes=layout.total_bytes,
            trainer_id=self._trainer_id,
            verify_by_bucket=verify and verify_by_bucket,
        )
        with self._lock:
            plan = self._transport.prepare(plan=plan, layout=layout, engine_world_size=engine_world_size)
            self._prepared = (plan, layout)
        return plan

    def publish(self, plan: WeightSyncPlan, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """Send `named_tensors` (in the order of the specs given to prepare); returns once every receiver has
        its copy (process groups, cuda_ipc) or the files are in place (disk)."""
        if not self._lock.acquire(blocking=False):
            raise WeightSyncError(f"{self.transport} weight sync v{plan.version}: a publish is already running")
        try:
            if self._prepared is None or self._prepared[0] != plan:
                raise ValueError(
                    f"{self.transport} weight sync v{plan.version}: publish needs the plan returned by "
                    f"this publisher's latest prepare"
                )
            layout = self._prepared[1]
            checksums = PendingChecksums()
            deadline = Deadline(plan.timeout_s)
            started = time.monotonic()
            with torch.no_grad():
                waited = self._transport.publish(
                    plan=plan,
                    layout=layout,
                    deadline=deadline,
                    checksums=checksums,
                    tensors=self._validated(plan=plan, layout=layout, named_tensors=named_tensors, checksums=checksums),
                )
            elapsed = time.monotonic() - started
            return SyncStats(
                version=plan.version,
                bytes=layout.total_bytes,
                seconds=elapsed - waited,
                checksums=dict(checksums),
                transport=self.transport,
                wait_seconds=waited,
            )
        finally:
            self._lock.release()

    @staticmethod
    def _validated(
        *,
        plan: WeightSyncPlan,
        layout: Layout,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        checksums: PendingChecksums,
    ) -> Iterator[tuple[Slot, torch.Tensor]]:
        """The tensors checked against the plan; verifying per tensor their checksums go to `checksums`: those the
        plan announces (the trainer computed them from these weights in prepare, in one batch) as announced, others
        summed as they pass, with no host sync between the transport's copies. Verifying by bucket, the plan's
        bucket checksums are all there is."""
        where = f"{plan.transport} weight sync v{plan.version} (trainer)"
        per_tensor = plan.verify and not plan.verify_by_bucket
        announced = announced_checksums(plan) if per_tensor else {}
        for slot, tensor in iter_validated(layout, named_tensors, where=where):
            if per_tensor:
                if slot.name in announced:
                    checksums.set_known(slot.name, announced[slot.name])
                else:
                    checksums.add(slot.name, tensor)
            yield slot, tensor

    def release(self) -> None:
        """Free buffers kept for receivers (cuda_ipc); the next prepare allocates again."""
        with self._lock:
            self._transport.release()

    def close(self) -> None:
        with self._lock:
            self._transport.close()
            self._prepared = None


class WeightReceiver:
    """An engine rank's side: `receive` copies a plan's tensors into `params` in place."""

    def __init__(
        self,
        accepted_trainer_id: str | None = None,
        *,
        timeout_s: float = _WEIGHTS.timeout_s,
        refuse_timeout_s: float = _TIMEOUTS.probe_s,
    ):
        """`timeout_s` bounds a plan that names no deadline (weights.timeout_s); `refuse_timeout_s` the best-effort
        notice of a refusal to the trainer (services.timeouts.probe_s)."""
        self.accepted_trainer_id = accepted_trainer_id
        self._timeout_s = timeout_s
        self._refuse_timeout_s = refuse_timeout_s
        self._transports: dict[str, ReceiverTransport] = {}
        self._lock = threading.Lock()

    def _transport(self, name: str) -> ReceiverTransport:
        if name not in self._transports:
            self._transports[name] = registered_transport(name).receiver()
        return self._transports[name]

    def receive(self, plan: WeightSyncPlan, rank_offset: int, params: Mapping[str, torch.Tensor]) -> SyncStats:
        """Everything is checked before joining any transfer; a refusal is posted to the trainer (process
        groups, cuda_ipc) so it fails at once rather than at its deadline. With `plan.verify` the returned
        checksums are computed from `params` after the copy, and compared here with the trainer's where the plan
        (TensorMeta.checksum) or the transport (disk manifest) carries them: a difference raises WeightSyncError.
        On a failure mid-transfer `params` may hold a mix of versions: sync again before generating."""
        with self._lock:
            transport = self._transport(plan.transport)
            deadline = Deadline(plan.timeout_s if plan.timeout_s > 0 else self._timeout_s)
            where = f"{plan.transport} weight sync v{plan.version} (engine rank {rank_offset})"
            if self.accepted_trainer_id and plan.trainer_id != self.accepted_trainer_id:
                reason = f"trainer {plan.trainer_id!r} is not the accepted trainer {self.accepted_trainer_id!r}"
                transport.refuse(plan=plan, rank=rank_offset, reason=reason, deadline=self._refusal(deadline))
                raise WeightSyncRefused(f"{where}: {reason}")
            layout, problems = self._check(plan=plan, rank_offset=rank_offset, params=params)
            if problems:
                reason = f"{len(problems)} problem(s) with the plan or params: " + "; ".join(problems[:_MAX_LISTED])
                transport.refuse(plan=plan, rank=rank_offset, reason=reason, deadline=self._refusal(deadline))
                raise ValueError(f"{where}: {reason}")
            assert layout is not None
            started = time.monotonic()
            with torch.no_grad():
                received = transport.receive(
                    plan=plan, layout=layout, rank=rank_offset, params=params, deadline=deadline
                )
            elapsed = time.monotonic() - started
            t = time.monotonic()
            checksums, buckets = self._verify(
                where=where, plan=plan, layout=layout, params=params, sender_checksums=received.sender_checksums
            )
            return SyncStats(
                version=plan.version,
                bytes=layout.total_bytes,
                seconds=elapsed - received.waited_s,
                checksums=checksums,
                transport=plan.transport,
                wait_seconds=received.waited_s,
                bucket_checksums=buckets,
                checksum_seconds=time.monotonic() - t if plan.verify else 0.0,
            )

    def _verify(
        self,
        *,
        where: str,
        plan: WeightSyncPlan,
        layout: Layout,
        params: Mapping[str, torch.Tensor],
        sender_checksums: Mapping[str, str],
    ) -> tuple[dict[str, str], tuple[str, ...]]:
        """With plan.verify: the checksums of what `params` now hold, per tensor or per bucket as the plan says,
        compared with the trainer's where known (the plan, or the transport: a disk manifest)."""
        if not plan.verify:
            return {}, ()
        if plan.verify_by_bucket:
            buckets = tuple(bucket_checksums(layout, params))
            theirs = announced_bucket_checksums(plan)
            bad = [b for b, mine in zip(layout.buckets, buckets, strict=True) if theirs[b.index] not in ("", mine)]
            if bad:
                raise WeightChecksumMismatch(
                    f"{where}: {len(bad)} of {len(buckets)} bucket(s) differ from the "
                    f"trainer's checksums: {'; '.join(describe_bucket(b) for b in bad[:5])}"
                )
            return {}, buckets
        checksums = dict(
            zip((s.name for s in layout.order), tensor_checksums([params[s.name] for s in layout.order]), strict=True)
        )
        self._compare(where=where, mine=checksums, theirs={**announced_checksums(plan), **sender_checksums})
        return checksums, ()

    def _refusal(self, deadline: Deadline) -> Deadline:
        return Deadline(min(deadline.remaining(), self._refuse_timeout_s))

    @staticmethod
    def _check(
        *, plan: WeightSyncPlan, rank_offset: int, params: Mapping[str, torch.Tensor]
    ) -> tuple[Layout | None, list[str]]:
        try:
            layout = layout_from_plan(plan)
        except ValueError as exc:
            return None, [str(exc)]
        problems = []
        if plan.sglang_load_format:
            problems.append(
                "the trainer prepared this sync for SGLang engines (its rollout.engine is sglang), and "
                "this engine is native: give the trainer and the rollout service the same rollout.engine"
            )
        if plan.world_size and not 1 <= rank_offset < plan.world_size:
            problems.append(f"rank_offset {rank_offset} outside 1..{plan.world_size - 1}")
        return layout, problems + check_params(layout, params)

    @staticmethod
    def _compare(*, where: str, mine: Mapping[str, str], theirs: Mapping[str, str]) -> None:
        if not mine or not theirs:
            return
        bad = [name for name, digest in mine.items() if theirs.get(name) != digest]
        if bad:
            raise WeightChecksumMismatch(
                f"{where}: {len(bad)} tensor(s) differ from the trainer's checksums: {', '.join(bad[:_MAX_LISTED])}"
            )

    def release(self) -> None:
        """The engine gives its GPU memory away: let go of the trainer's memory too (kept IPC mappings)."""
        with self._lock:
            for transport in self._transports.values():
                transport.release()

    def close(self) -> None:
        with self._lock:
            for transport in self._transports.values():
                transport.close()
            self._transports.clear()

"""Weight sync as an explicit state machine: prepare → transfer → verify → resume, each under a deadline.

The coordinator only sequences control messages; the bytes go trainer → engines over the transport
(process group, CUDA IPC or disk). Whatever fails, the engines are resumed so a failed sync never
leaves generation paused, and the error names the phase and the version.

With weights.check_weight_update_equal the trainer announces one checksum per bucket and every engine checks
what it received against them (services/weights/checksums.py). A bucket that differs is named by the engine
(DATA_LOSS) or by the comparison here; the sync is then sent again with per-tensor checksums, the slower path only
on a mismatch, which names the tensors that differ or shows the difference did not repeat.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from enum import Enum
from itertools import accumulate

import grpc

from services.contracts.config import WeightsConfig
from services.contracts.rollout_calls import ReceiveRequest, ReceiveResult
from services.contracts.trainer_calls import PublishResult, WeightSyncRequest
from services.contracts.weight_plan import WeightSyncPlan
from services.coordinator.call_errors import ServiceCallError
from services.coordinator.pool import RolloutPool
from services.coordinator.seams import SyncResult, TrainerWeightsApi
from services.telemetry.tracing import span

log = logging.getLogger(__name__)

__all__ = [
    "ChecksumMismatch",
    "SyncPhase",
    "SyncResult",
    "WeightSync",
    "WeightSyncFailed",
    "compare_bucket_checksums",
    "compare_checksums",
]


class SyncPhase(Enum):
    PREPARE = "prepare"
    TRANSFER = "transfer"
    VERIFY = "verify"
    RESUME = "resume"
    DONE = "done"


class WeightSyncFailed(RuntimeError):
    """A weight sync the coordinator ran failed; the message names the phase, the version and the replicas. (The
    services' own transfer errors are services.weights.WeightSyncError; they reach here as failed calls.)"""


class ChecksumMismatch(WeightSyncFailed):
    """What an engine holds differs from the trainer's checksums."""


def compare_checksums(expected: dict[str, str], received: dict[str, str], *, replica: str) -> None:
    missing = sorted(set(expected) - set(received))
    differ = sorted(n for n in expected if n in received and received[n] != expected[n])
    if missing or differ:
        raise ChecksumMismatch(
            f"check_weight_update_equal failed on {replica}: {len(differ)} tensors differ "
            f"({', '.join(differ[:5])}{'…' if len(differ) > 5 else ''}), {len(missing)} missing "
            f"({', '.join(missing[:5])})"
        )


def compare_bucket_checksums(expected: list[str], received: list[str], *, replica: str) -> None:
    differ = [i for i, digest in enumerate(expected) if i >= len(received) or received[i] != digest]
    if differ:
        raise ChecksumMismatch(
            f"check_weight_update_equal failed on {replica}: {len(differ)} of {len(expected)} "
            f"bucket(s) differ (bucket {', '.join(map(str, differ[:5]))})"
        )


def rank_offsets(ranks: list[int]) -> list[int]:
    """Each replica's first rank in the transfer group; the trainer is rank 0."""
    return [1 + o for o in accumulate([0, *ranks[:-1]])]


class WeightSync:
    def __init__(
        self,
        *,
        trainer: TrainerWeightsApi,
        pool: RolloutPool,
        config: WeightsConfig,
        pause_mode: str = "drain",
        trainer_offloads: bool = False,
    ):
        self.trainer = trainer
        self.trainer_offloads = trainer_offloads  # the trainer frees its buffers after every sync
        self.pool = pool
        self.config = config
        self.pause_mode = pause_mode
        self.executor = ThreadPoolExecutor(max_workers=pool.size + 1, thread_name_prefix="sync")
        self.phase = SyncPhase.DONE

    def run(self, *, version: int, verify: bool | None = None) -> SyncResult:
        verify = self.config.check_weight_update_equal if verify is None else verify
        try:
            return self._attempt(version=version, verify=verify, by_bucket=verify)
        except ChecksumMismatch as exc:
            log.warning(
                "weight sync v%d: %s; sending it again with per-tensor checksums to name the tensors", version, exc
            )
            result = self._attempt(version=version, verify=True, by_bucket=False)  # raises naming the tensors
            log.warning(
                "weight sync v%d: sent again, every tensor matches the trainer's checksums: the bucket "
                "mismatch did not repeat",
                version,
            )
            return result

    def _attempt(self, *, version: int, verify: bool, by_bucket: bool) -> SyncResult:
        times: dict[str, float] = {}
        start = time.monotonic()
        with span("rl.sync", weight_version=version, transport=self.config.transport) as s:
            try:
                self.phase = SyncPhase.PREPARE
                t = time.monotonic()
                prepared = self.pool.prepare_weight_sync(version=version, pause_mode=self.pause_mode)
                ranks = [max(1, p.engine_ranks) for p in prepared]
                times["pause"] = time.monotonic() - t
                announced = self.trainer.prepare_weight_sync(
                    WeightSyncRequest(
                        version=version,
                        transport=self.config.transport,
                        engine_world_size=sum(ranks),
                        verify=verify,
                        verify_by_bucket=by_bucket,
                    )
                )
                plan = replace(announced, buffers_freed_after=self.trainer_offloads)
                times["plan"] = time.monotonic() - t - times["pause"]  # the trainer's checksums, when verifying

                self.phase = SyncPhase.TRANSFER
                t = time.monotonic()
                published, received = self._transfer(plan=plan, ranks=ranks)
                times["transfer"] = time.monotonic() - t
                times["publish"] = published.time_s  # the trainer's own account of it
                times["receive"] = max(r.time_s for r in received)  # the slowest engine's (its checksums included)

                self.phase = SyncPhase.VERIFY
                t = time.monotonic()
                checked = self._verify(plan, received) if verify else 0
                times["verify"] = time.monotonic() - t
                if verify:  # the trainer's and the slowest engine's, inside "plan" and "receive"
                    times["checksum"] = plan.checksum_s + max(r.checksum_s for r in received)
            except WeightSyncFailed:
                self._resume_quietly()
                raise
            except Exception as exc:
                self._resume_quietly()
                raise WeightSyncFailed(
                    f"weight sync to version {version} failed in phase {self.phase.value}: {exc}"
                ) from exc
            self.pool.weights_synced(version)  # every replica holds `version`, restarted ones included
            self.phase = SyncPhase.RESUME
            t = time.monotonic()
            self.pool.resume()
            times["resume"] = time.monotonic() - t
            self.phase = SyncPhase.DONE
            result = SyncResult(
                version=version,
                transport=plan.transport,
                bytes=plan.total_bytes,
                seconds=time.monotonic() - start,
                phase_seconds=times,
                verified_tensors=checked,
            )
            s.set_attribute("rl.bytes", result.bytes)
            s.set_attribute("rl.gbps", result.gbps)
            return result

    def _verify(self, plan: WeightSyncPlan, received: list[ReceiveResult]) -> int:
        """Every engine's checksums against the trainer's (the engines compared them too); the tensors checked."""
        if plan.verify_by_bucket:
            expected_buckets = [b.checksum for b in plan.buckets]
            for replica, reply in zip(self.pool.replicas, received, strict=True):
                compare_bucket_checksums(expected_buckets, list(reply.bucket_checksums), replica=replica.name)
            return sum(len(b.tensors) for b in plan.buckets)
        expected = {m.name: m.checksum for b in plan.buckets for m in b.tensors}
        for replica, reply in zip(self.pool.replicas, received, strict=True):
            compare_checksums(expected, dict(reply.checksums), replica=replica.name)
        return len(expected)

    def _transfer(self, *, plan: WeightSyncPlan, ranks: list[int]) -> tuple[PublishResult, list[ReceiveResult]]:
        # Engines first (they join the group and block), then the trainer broadcasts in the announced order.
        receive = [
            self.executor.submit(r.receive_weights, ReceiveRequest(plan=plan, rank_offset=o))
            for r, o in zip(self.pool.replicas, rank_offsets(ranks), strict=True)
        ]
        publish = self.executor.submit(self.trainer.publish_weights, plan.version)
        waits: list[Future] = [publish, *receive]
        errors: list[ServiceCallError] = []
        for fut in waits:
            try:
                fut.result()
            except ServiceCallError as exc:
                errors.append(exc)
        if errors:
            # the bytes arrived, and what arrived differs: DATA_LOSS from each engine that failed
            kind = ChecksumMismatch if all(e.code == grpc.StatusCode.DATA_LOSS for e in errors) else WeightSyncFailed
            raise kind(
                f"weight transfer of version {plan.version} over {plan.transport} failed: "
                + "; ".join(map(str, errors))
            )
        return publish.result(), [f.result() for f in receive]

    def _resume_quietly(self) -> None:
        try:
            self.pool.resume()
        except Exception as exc:  # noqa: BLE001 - best effort; the original error is what matters
            log.warning("could not resume rollout engines after a failed sync: %s", exc)

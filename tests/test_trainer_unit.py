"""TrainerService's decisions, with fakes of its parts (no DeepSpeed, no Redis, no sockets): the real service, the
real ledger and the real rank commands (their codec included) over parts that record every call in one log.

The exactly-once guards: a retried Train replays its result and acknowledges again without a second step; entries
trained under another rollout id are skipped, and a Train of nothing new is refused; a Save that failed is written
again, a Save of a step already saved is not; a trainer started beside a checkpoint trains only after its Load; and
every command that needs the model runs after an Onload when the model was offloaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest_trainer import make_batch

from services.buffer.entries import BufferEntry
from services.contracts.config import TandemConfig
from services.contracts.config_loading import config_from_dict
from services.contracts.errors import FailedPrecondition
from services.contracts.trainer_calls import LoadRequest, PublishRequest, SaveRequest, TrainRequest, WeightSyncRequest
from services.contracts.weight_plan import WeightSyncPlan
from services.trainer.algo.critic import ValueHandoff
from services.trainer.algo.selection import Selection
from services.trainer.batching import merge_batches
from services.trainer.checkpointing import FoundCheckpoint
from services.trainer.commands import Load, Save, Train
from services.trainer.dist import CommandRelay
from services.trainer.ledger import TrainLedger
from services.trainer.parts import Checksums, TrainerParts, World
from services.trainer.service import TrainerService
from services.weights.layout import TensorSpec
from services.weights.transport_base import SyncStats

Log = list[tuple[object, ...]]


def entry(entry_id: str, rollout_id: int = 0) -> BufferEntry:
    batch = make_batch(rollout_id=rollout_id, groups=1, group_size=2, seed=len(entry_id))
    return BufferEntry(
        entry_id=entry_id,
        batch=batch,
        rollout_id=rollout_id,
        policy_version=0,
        trace_context={},
        producer="rollout-0",
        nbytes=100,
    )


class FakeRollouts:
    """Rank 0's Redis side: hands out the named entries, selects every sample, records acks."""

    def __init__(self, log: Log):
        self.log = log

    def read(self, entry_ids: list[str], num_batches: int) -> list[BufferEntry]:
        self.log.append(("read", tuple(entry_ids)))
        return [entry(e) for e in entry_ids]

    def prepare(
        self, entries: list[BufferEntry], *, rollout_id: int, max_staleness: int, use_critic_values: bool
    ) -> Selection:
        self.log.append(("prepare", rollout_id))
        return Selection(batch=merge_batches([e.batch for e in entries]), dropped_stale=0, filtered=0)

    def commit(self, rollout_id: int, entry_ids: list[str], handoff: ValueHandoff | None) -> None:
        self.log.append(("ack", rollout_id, tuple(entry_ids)))


class FakeBackend:
    """The model: offloaded or not, its memory moves."""

    def __init__(self, log: Log, *, offload_supported: bool = True):
        self.log, self.offloaded, self.offload_supported = log, False, offload_supported

    def check_offload_supported(self) -> None:
        if not self.offload_supported:
            raise FailedPrecondition("offload needs ZeRO 1-3")

    def offload(self) -> str:
        self.log.append(("offload",))
        self.offloaded = True
        return "offloaded"

    def onload(self) -> str:
        self.log.append(("onload",))
        self.offloaded = False
        return "onloaded"

    def close(self) -> None:
        self.log.append(("close",))


class FakeStep:
    """Every rank's Train step."""

    def __init__(self, log: Log):
        self.log = log

    def run(self, command: Train) -> dict[str, float]:
        self.log.append(("step", command.rollout_id, command.entry_ids, command.batch.num_samples))
        return {"loss": 0.5}

    def handoff_for(self, rollout_id: int) -> ValueHandoff | None:
        return None


class FakeCheckpoints:
    """Checkpoint directories as names; `fail_writes` Saves fail (a full disk) before one succeeds."""

    def __init__(self, log: Log, ledger: TrainLedger, root: Path, *, fail_writes: int = 0):
        self.log, self.ledger, self.root, self.fail_writes = log, ledger, root, fail_writes
        self.complete: dict[Path, dict[str, object]] = {}  # directory -> the state it holds

    def save_dir(self, rollout_id: int, path: str = "") -> Path:
        return self.root / f"rollout_{rollout_id:08d}"

    def holds_step(self, directory: Path, step: int) -> bool:
        return directory in self.complete and self.complete[directory]["step"] == step

    def write(self, command: Save) -> None:
        self.log.append(("write", Path(command.directory).name))
        if self.fail_writes:
            self.fail_writes -= 1
            raise OSError(28, "No space left on device")
        self.complete[Path(command.directory)] = {
            **self.ledger.state_dict(),
            "checkpoint_rollout_id": command.rollout_id,
            "extra_state": command.extra_state,
        }

    def find(self, path: str = "") -> FoundCheckpoint | None:
        if not self.complete:
            return None
        directory = max(self.complete)
        return FoundCheckpoint(directory=directory, state=self.complete[directory])

    def read(self, command: Load) -> None:
        self.log.append(("read checkpoint", Path(command.directory).name))

    def restore(self, found: FoundCheckpoint) -> None:
        self.log.append(("restore", found.directory.name))
        self.ledger.load_state_dict(found.state)


class FakeWeights:
    def __init__(self, log: Log):
        self.log = log

    @property
    def trainer_id(self) -> str:
        return "run/actor"

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec("w", "float32", (2,))]

    def iter_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "w", torch.zeros(2)

    def check_request(self, *, engine_world_size: int) -> None:
        self.log.append(("check sync request", engine_world_size))

    def prepare(self, request: WeightSyncRequest) -> WeightSyncPlan:
        self.log.append(("prepare sync", request.version))
        return WeightSyncPlan(version=request.version, transport="gloo")

    def add_checksums(self, plan: WeightSyncPlan, sums: Checksums, *, seconds: float) -> WeightSyncPlan:
        self.log.append(("announce checksums", sums))
        return plan

    def check_prepared(self, version: int) -> None:
        self.log.append(("check prepared", version))

    def forget_plan(self) -> None:
        self.log.append(("forget plan",))

    def checksums(self, *, by_bucket: bool = False) -> Checksums | None:
        self.log.append(("checksums", by_bucket))
        return ["c0"] if by_bucket else {"w": "c0"}

    def publish(self, version: int) -> SyncStats | None:
        self.log.append(("publish", version))
        return SyncStats(version=version, bytes=8, seconds=0.5)

    def release(self) -> None:
        self.log.append(("release buffers",))

    def close(self) -> None:
        self.log.append(("close weights",))


def config(tmp_path: Path) -> TandemConfig:
    return config_from_dict(
        {
            "model": {"path": str(tmp_path)},
            "data": {"train_path": str(tmp_path / "d.jsonl")},
            "trainer": {"device": "cpu", "export_hf_on_save": False},
            "algorithm": {"use_rollout_logprobs": True},
        }
    )


def service(
    tmp_path: Path, *, fail_writes: int = 0, offload_supported: bool = True, unloaded: Path | None = None
) -> tuple[TrainerService, Log, FakeCheckpoints]:
    log: Log = []
    ledger = TrainLedger()
    checkpoints = FakeCheckpoints(log, ledger, tmp_path / "ckpt", fail_writes=fail_writes)
    parts = TrainerParts(
        config=config(tmp_path),
        role="actor",
        world=World(rank=0, world_size=1, device="cpu"),
        backend=FakeBackend(log, offload_supported=offload_supported),
        rollouts=FakeRollouts(log),
        step=FakeStep(log),
        checkpoints=checkpoints,
        weights=FakeWeights(log),
        ledger=ledger,
        relay=CommandRelay(rank=0, world_size=1),  # one rank: the relay sends nothing, the codec runs
        unloaded=unloaded,
    )
    return TrainerService(parts), log, checkpoints


def test_a_retried_train_replays_its_result_and_acks_again_without_a_second_step(tmp_path):
    svc, log, _ = service(tmp_path)
    first = svc.train(TrainRequest(rollout_id=0, entry_ids=("1-0", "2-0")))
    assert log == [("read", ("1-0", "2-0")), ("prepare", 0), ("step", 0, ("1-0", "2-0"), 4), ("ack", 0, ("1-0", "2-0"))]
    log.clear()
    again = svc.train(TrainRequest(rollout_id=0, entry_ids=("1-0", "2-0")))
    assert log == [("ack", 0, ("1-0", "2-0"))]  # the first ack may have been lost
    assert again.replayed and not first.replayed and (again.step, again.samples_trained) == (1, 4)
    assert svc.ledger.step == 1


def test_entries_a_step_trained_are_skipped_by_the_next_and_a_train_of_nothing_new_is_refused(tmp_path):
    svc, log, _ = service(tmp_path)
    svc.train(TrainRequest(rollout_id=0, entry_ids=("1-0",)))
    log.clear()
    reply = svc.train(TrainRequest(rollout_id=1, entry_ids=("1-0", "3-0")))  # 1-0 was rollout 0's: delivered twice
    assert log == [("read", ("3-0",)), ("prepare", 1), ("step", 1, ("3-0",), 2), ("ack", 1, ("3-0",))]
    assert reply.metrics["entries_skipped_duplicate"] == 1.0 and reply.step == 2
    log.clear()
    with pytest.raises(FailedPrecondition, match=r"entries \['1-0', '3-0'\] were already trained \(rollout \[0, 1\]\)"):
        svc.train(TrainRequest(rollout_id=2, entry_ids=("1-0", "3-0")))
    with pytest.raises(ValueError, match="name an entry more than once"):
        svc.train(TrainRequest(rollout_id=2, entry_ids=("4-0", "4-0")))
    assert log == [] and svc.ledger.step == 2


def test_a_failed_save_is_written_again_a_saved_step_is_not_and_load_restores_what_was_saved(tmp_path):
    svc, log, checkpoints = service(tmp_path, fail_writes=1)
    svc.train(TrainRequest(rollout_id=0, entry_ids=("1-0",)))
    log.clear()
    with pytest.raises(OSError, match="No space left"):
        svc.save(SaveRequest(rollout_id=0, extra_state={"coordinator": "{}"}))
    saved = svc.save(SaveRequest(rollout_id=0, extra_state={"coordinator": "{}"}))  # the coordinator's retry
    again = svc.save(SaveRequest(rollout_id=0))  # a retry of a Save that did land
    assert log == [("write", "rollout_00000000"), ("write", "rollout_00000000")]
    assert (saved.step, again.step, saved.path) == (1, 1, str(checkpoints.save_dir(0)))
    svc.train(TrainRequest(rollout_id=1, entry_ids=("2-0",)))  # a step after the checkpoint, rolled back by the Load
    log.clear()
    loaded = svc.load(LoadRequest())
    assert log == [("read checkpoint", "rollout_00000000"), ("restore", "rollout_00000000")]
    assert (loaded.loaded, loaded.rollout_id, loaded.step, loaded.extra_state) == (True, 0, 1, {"coordinator": "{}"})
    assert svc.ledger.step == 1 and not svc.ledger.is_recorded(1)


def test_a_trainer_started_beside_a_checkpoint_trains_only_after_loading_it(tmp_path):
    svc, log, checkpoints = service(tmp_path, unloaded=tmp_path / "ckpt" / "rollout_00000004")
    with pytest.raises(FailedPrecondition, match="has not loaded it: call Load first"):
        svc.train(TrainRequest(rollout_id=5, entry_ids=("1-0",)))
    assert log == []
    checkpoints.complete[tmp_path / "ckpt" / "rollout_00000004"] = {
        **TrainLedger().state_dict(),
        "step": 3,
        "checkpoint_rollout_id": 4,
    }
    assert svc.load(LoadRequest()).step == 3
    svc.train(TrainRequest(rollout_id=5, entry_ids=("1-0",)))
    assert log[-2:] == [("step", 5, ("1-0",), 2), ("ack", 5, ("1-0",))] and svc.ledger.step == 4


def test_an_offloaded_model_is_onloaded_before_each_command_that_needs_it(tmp_path):
    svc, log, _ = service(tmp_path)
    assert svc.offload() == "offloaded"
    svc.train(TrainRequest(rollout_id=0, entry_ids=("1-0",)))
    svc.offload()
    svc.save(SaveRequest(rollout_id=0))
    svc.offload()
    svc.prepare_weight_sync(WeightSyncRequest(version=1, verify=True, verify_by_bucket=True))
    publish = svc.publish_weights(PublishRequest(version=1))
    assert log == [
        ("release buffers",),
        ("offload",),
        ("read", ("1-0",)),
        ("prepare", 0),
        ("onload",),
        ("step", 0, ("1-0",), 2),
        ("ack", 0, ("1-0",)),
        ("release buffers",),
        ("offload",),
        ("onload",),
        ("write", "rollout_00000000"),
        ("release buffers",),
        ("offload",),
        ("check sync request", 1),
        ("onload",),
        ("prepare sync", 1),
        ("checksums", True),
        ("announce checksums", ["c0"]),
        ("check prepared", 1),
        ("publish", 1),
        ("forget plan",),
    ]
    assert (publish.bytes_sent, svc.ledger.weight_version, svc.get_state().offloaded) == (8, 1, False)


def test_an_offload_the_backend_cannot_do_is_refused_before_any_rank_moves(tmp_path):
    svc, log, _ = service(tmp_path, offload_supported=False)
    with pytest.raises(FailedPrecondition, match="offload needs ZeRO 1-3"):
        svc.offload()
    assert log == [] and svc.onload() == "onloaded" and log == [("onload",)]

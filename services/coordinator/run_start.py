"""What the coordinator does before its first step: wait for the services, load the latest checkpoint, and decide
which recorded generations a resume can reuse."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from services.coordinator.seams import BufferApi, TrainerApi
from services.coordinator.state import GeneratedBatch, RunState

log = logging.getLogger(__name__)


class Awaitable(Protocol):
    def wait_healthy(self, timeout_s: float) -> None: ...


def wait_for_services(services: Iterable[Awaitable], *, timeout_s: float) -> None:
    for service in services:
        service.wait_healthy(timeout_s)


@dataclass(frozen=True)
class Restored:
    state: RunState
    checkpoint: str = ""  # the checkpoint it came from ("" for a fresh run)


def restore(trainer: TrainerApi, critic: TrainerApi | None) -> Restored:
    """Loads the latest checkpoint into the trainers; the run state saved in the actor's is where the run resumes."""
    reply = trainer.load()
    if critic is not None:
        critic.load()
    if not (reply.loaded and "coordinator" in reply.extra_state):
        return Restored(RunState())
    saved = RunState.from_json(reply.extra_state["coordinator"])
    log.info("resumed from %s at rollout %d", reply.path, saved.next_rollout_id)
    return Restored(saved.resumed(), checkpoint=reply.path)


def keep_reusable(state: RunState, buffer: BufferApi) -> RunState:
    """Recorded generations whose entries are all still buffered are reused, and so are streaming groups whose entry
    is (the others are generated again); the buffer's other entries (generated after the checkpoint, or the remains
    of a generation trained since) are deleted."""
    reusable = tuple(p for p in state.pending if _still_buffered(p, buffer))
    done = [g.entry_id for g in state.groups if g.entry_id]
    gone = set(buffer.missing(done)) if done else set()
    groups = tuple(replace(g, entry_id="") if g.entry_id in gone else g for g in state.groups)
    dropped = buffer.discard_except(
        [e for p in reusable for e in p.entry_ids] + [g.entry_id for g in groups if g.entry_id]
    )
    if dropped:
        log.info("discarded %d buffer entries generated after the last checkpoint", dropped)
    return replace(state, pending=reusable, groups=groups)


def _still_buffered(gen: GeneratedBatch, buffer: BufferApi) -> bool:
    """A recorded generation trained after the checkpoint was acknowledged and deleted; the checkpoint's weights
    never saw it, so it is generated again from its cursor (same prompts)."""
    missing = buffer.missing(list(gen.entry_ids))
    if missing:
        log.warning(
            "rollout %d: %d of its %d buffered entries were trained after the checkpoint and are gone; "
            "generating it again",
            gen.rollout_id,
            len(missing),
            len(gen.entry_ids),
        )
    return not missing

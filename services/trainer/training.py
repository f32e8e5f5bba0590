"""Train's two halves: rank 0 turns Redis entries into a batch (`RolloutSource`), every rank steps on it (`TrainStep`).

Rank 0 reads the named entries (or the next ones), skips entries the ledger says were trained, selects the samples
to train (selection.py: stale ones dropped, dynamic sampling, the overlong filter) and refuses batches the model
cannot train on. After the step is committed and recorded it acknowledges
the entries and moves the PPO value hand-off along: the critic publishes its values, the actor deletes the key.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.buffer.stream import BufferEntry, RolloutBuffer, connect, stream_key
from services.contracts.config import TandemConfig
from services.contracts.errors import FailedPrecondition
from services.trainer.algo.actor import actor_step
from services.trainer.algo.critic import (
    ValueHandoff,
    critic_step,
    handoff_key,
    publish_handoff,
    read_handoff,
    values_for_batch,
)
from services.trainer.algo.distillation import load_teacher
from services.trainer.algo.old_actor import OldActor
from services.trainer.algo.selection import Selection, select_samples, truncated_samples
from services.trainer.batching import check_trainable, merge_batches
from services.trainer.commands import Train
from services.trainer.ledger import TrainLedger
from services.trainer.model.backend import DeepSpeedBackend, load_frozen_causal_lm

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def check_train_request(
    config: TandemConfig,
    *,
    role: str,
    rollout_id: int,
    num_entry_ids: int,
    num_batches: int,
    use_critic_values: bool,
    unloaded: Path | None,
) -> None:
    """Refuses a Train that cannot be served, before anything is read."""
    if rollout_id < 0:
        raise ValueError(f"rollout_id must be >= 0, got {rollout_id}")
    if unloaded is not None:
        raise FailedPrecondition(
            f"this trainer started after checkpoint {unloaded} was written and has not loaded it: call Load first"
        )
    limit = config.redis.max_buffered_batches
    if num_entry_ids > limit or num_batches > limit:
        raise ValueError(
            f"Train({rollout_id}) asks for {max(num_entry_ids, num_batches)} batches; at most "
            f"redis.max_buffered_batches ({limit}) can be in the buffer at once"
        )
    if use_critic_values and role == "critic":
        raise ValueError("use_critic_values is for the actor's Train, not the critic's")
    if role == "actor" and config.algorithm.uses_critic and not use_critic_values:
        raise FailedPrecondition(
            "advantage_estimator gae: the actor's Train needs use_critic_values (train the critic on the rollout first)"
        )


@dataclass(frozen=True)
class ModelLimits:
    """What a batch must fit: token ids below vocab_size, samples within max_positions (None: no limit known)."""

    vocab_size: int
    max_positions: int | None

    @classmethod
    def of(cls, model_config: PretrainedConfig) -> ModelLimits:
        return cls(
            vocab_size=int(model_config.vocab_size),
            max_positions=getattr(model_config, "max_position_embeddings", None),
        )


class RolloutSource:
    """Rank 0: the role's consumer of the run's rollout stream, connected on first use (Redis may start later)."""

    def __init__(self, config: TandemConfig, *, role: str, ledger: TrainLedger, limits: ModelLimits):
        self.config, self.role, self.ledger, self.limits = config, role, ledger, limits
        self.stream = stream_key(config.redis.stream_prefix, config.run_name)
        self._buffer: RolloutBuffer | None = None

    @property
    def buffer(self) -> RolloutBuffer:
        if self._buffer is None:
            cfg = self.config.redis
            if not cfg.url:
                raise FailedPrecondition("redis.url is not set: the trainer has no rollout buffer to read")
            groups = ("actor", "critic") if self.config.algorithm.uses_critic else ("actor",)
            client = connect(cfg.url, password=cfg.password, timeout_s=self.config.services.timeouts.redis_socket_s)
            self._buffer = RolloutBuffer(
                client,
                self.stream,
                groups=groups,
                group=self.role,
                consumer=f"{self.role}-0",
                max_buffered_batches=cfg.max_buffered_batches,
                claim_idle_ms=cfg.claim_idle_ms,
            )
        return self._buffer

    def read(self, entry_ids: list[str], num_batches: int) -> list[BufferEntry]:
        """The named entries (none trained before: the service filtered them), else the next `num_batches`."""
        if not entry_ids:
            if num_batches <= 0:
                raise ValueError("empty batch: Train needs entry_ids or num_batches > 0")
            return self._take_batches(num_batches)
        return self.buffer.read(entry_ids, timeout_s=self.config.redis.get_timeout_s)

    def _take_batches(self, count: int) -> list[BufferEntry]:
        timeout_s = self.config.redis.get_timeout_s
        deadline = time.monotonic() + timeout_s
        entries: list[BufferEntry] = []
        while len(entries) < count:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise TimeoutError(
                    f"only {len(entries)} of {count} batches arrived within {timeout_s}s (redis.get_timeout_s)"
                )
            got = self.buffer.get(count - len(entries), block_ms=remaining_ms)  # returns once any arrive
            self.buffer.ack([e.entry_id for e in got if self.ledger.is_trained(e.entry_id)])  # a lost ack
            entries += [e for e in got if not self.ledger.is_trained(e.entry_id)]
        return entries

    def prepare(
        self, entries: list[BufferEntry], *, rollout_id: int, max_staleness: int, use_critic_values: bool
    ) -> Selection:
        """The batch to train on (stale samples dropped, dynamic sampling and the overlong filter applied) and how
        many samples went; raises on bad input."""
        batch = merge_batches([e.batch for e in entries])
        if use_critic_values:  # before any selection: the hand-off holds a value for every sample
            handoff = read_handoff(self.buffer.client, stream=self.stream, rollout_id=rollout_id)
            batch = batch.with_values(values_for_batch(handoff, entry_ids=[e.entry_id for e in entries], batch=batch))
        selection = select_samples(
            batch,
            truncated=truncated_samples([e.batch.finish_reasons for e in entries]),
            config=self.config,
            role=self.role,
            weight_version=self.ledger.weight_version,
            max_staleness=max_staleness,
        )
        if selection.batch.num_samples:
            algo = self.config.algorithm
            check_trainable(
                selection.batch,
                vocab_size=self.limits.vocab_size,
                max_positions=self.limits.max_positions,
                needs_rollout_log_probs=algo.use_rollout_logprobs or algo.rollout_correction.active,
            )
        return selection

    def commit(self, rollout_id: int, entry_ids: list[str], handoff: ValueHandoff | None) -> None:
        """After the step is committed and recorded (again on a replay: the first ack or hand-off may have been
        lost): publish the critic's values, ack, drop a used hand-off."""
        client = self.buffer.client
        if self.role == "critic" and handoff is not None:
            publish_handoff(client, stream=self.stream, rollout_id=rollout_id, handoff=handoff)
        self.buffer.ack(entry_ids)
        if self.role == "actor" and self.config.algorithm.uses_critic:
            client.delete(handoff_key(self.stream, rollout_id))


def reference_model(config: TandemConfig, backend: DeepSpeedBackend) -> torch.nn.Module:
    if config.trainer.lora is None:
        return load_frozen_causal_lm(config, backend.device)
    from services.trainer.model.lora import AdapterOffReference

    return AdapterOffReference(backend.engine)


class TrainStep:
    """Every rank: one update of the role's model on a relayed batch."""

    def __init__(
        self, config: TandemConfig, *, role: str, rank: int, backend: DeepSpeedBackend, old_actor: OldActor | None
    ):
        self.config, self.role, self.rank, self.backend, self.old_actor = config, role, rank, backend, old_actor
        # the KL term's reference: the initial weights, frozen (with LoRA the model with its adapters off)
        self.ref_model = reference_model(config, backend) if role == "actor" and config.algorithm.kl_coef > 0 else None
        # on-policy distillation's teacher: frozen like the reference, on the device through an Offload, never saved
        distill = role == "actor" and config.algorithm.distillation is not None
        self.teacher = load_teacher(config, backend.device) if distill else None
        self._handoff: tuple[int, ValueHandoff] | None = None  # critic, rank 0: the last one, for replays

    def run(self, command: Train) -> dict[str, float]:
        budget, algo = self.config.trainer.micro_batch_tokens, self.config.algorithm
        if self.role == "actor":
            return actor_step(
                backend=self.backend,
                batch=command.batch,
                algo=algo,
                ref_model=self.ref_model,
                old_actor=self.old_actor,
                token_budget=budget,
                teacher=self.teacher,
            )
        metrics, (values, advantages, returns) = critic_step(
            backend=self.backend, batch=command.batch, algo=algo, token_budget=budget
        )
        if self.rank == 0:
            self._handoff = (
                command.rollout_id,
                ValueHandoff(
                    entry_ids=command.entry_ids,
                    response_lengths=command.batch.response_lengths.numpy(),
                    values=values.numpy(),
                    advantages=advantages.numpy(),
                    returns=returns.numpy(),
                ),
            )
        return metrics

    def handoff_for(self, rollout_id: int) -> ValueHandoff | None:
        """The critic's values of `rollout_id` if it trained that rollout last."""
        if self._handoff is not None and self._handoff[0] == rollout_id:
            return self._handoff[1]
        return None

"""The critic's update (clipped value loss on GAE returns) and the value hand-off to the actor.

The critic's Train computes V(s_t) for every response token with its weights *before* its update, GAE
advantages and returns from the rollout rewards, trains on the returns, and publishes values, advantages
and returns under the Redis key `<stream>:adv:<rollout_id>` (TensorData protobufs, never pickle). The
actor's Train (use_critic_values) reads the values and recomputes GAE itself, which gives the same
advantages unless it adds KL reward shaping, which only the actor (holding the reference model) can.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import cast

import numpy as np
import redis
import torch
from redis.typing import EncodableT, FieldT

from services.contracts.config import AlgorithmConfig
from services.contracts.errors import FailedPrecondition
from services.contracts.gen.tandem.v1 import common_pb2
from services.contracts.wire import array_from_proto, array_to_proto
from services.trainer import update
from services.trainer.algo.advantages import gae, token_rewards
from services.trainer.algo.losses import clipped_value_loss
from services.trainer.batching import MicroBatch, TrainBatch
from services.trainer.dist import all_reduce_sum

HANDOFF_TTL_S = 24 * 3600  # a hand-off the actor never consumed (run stopped) does not live forever


@dataclass(frozen=True)
class ValueHandoff:
    entry_ids: tuple[str, ...]
    response_lengths: np.ndarray  # int64 [n]
    values: np.ndarray  # float32 [T]
    advantages: np.ndarray  # float32 [T]
    returns: np.ndarray  # float32 [T]


def handoff_key(stream: str, rollout_id: int) -> str:
    return f"{stream}:adv:{rollout_id}"


def publish_handoff(client: redis.Redis, *, stream: str, rollout_id: int, handoff: ValueHandoff) -> None:
    fields: dict[FieldT, EncodableT] = {"entry_ids": json.dumps(list(handoff.entry_ids))}
    for name in ("response_lengths", "values", "advantages", "returns"):
        fields[name] = array_to_proto(getattr(handoff, name)).SerializeToString()
    key = handoff_key(stream, rollout_id)
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)
    pipe.hset(key, mapping=fields)
    pipe.expire(key, HANDOFF_TTL_S)
    pipe.execute()


def read_handoff(client: redis.Redis, *, stream: str, rollout_id: int) -> ValueHandoff:
    raw = cast("dict[bytes, bytes]", client.hgetall(handoff_key(stream, rollout_id)))  # a binary client
    if not raw:
        raise FailedPrecondition(
            f"no critic values for rollout {rollout_id} (key {handoff_key(stream, rollout_id)}):"
            " train the critic on this rollout first"
        )

    def arr(name: str) -> np.ndarray:
        msg = common_pb2.TensorData()
        msg.ParseFromString(raw[name.encode()])
        return array_from_proto(msg, what=f"critic {name}")

    return ValueHandoff(
        entry_ids=tuple(json.loads(raw[b"entry_ids"].decode())),
        response_lengths=arr("response_lengths"),
        values=arr("values"),
        advantages=arr("advantages"),
        returns=arr("returns"),
    )


def values_for_batch(handoff: ValueHandoff, *, entry_ids: list[str], batch: TrainBatch) -> torch.Tensor:
    """The critic's values aligned with the actor's batch; refuses a hand-off for other entries."""
    if list(handoff.entry_ids) != list(entry_ids):
        raise FailedPrecondition(
            f"the critic's values are for entries {list(handoff.entry_ids)}, the actor trains on {list(entry_ids)}"
        )
    if not np.array_equal(handoff.response_lengths, batch.response_lengths.numpy()):
        raise FailedPrecondition("the critic's values do not match the batch's response lengths")
    return torch.from_numpy(handoff.values.astype(np.float32))


def critic_step(
    *, backend: update.UpdateBackend, batch: TrainBatch, algo: AlgorithmConfig, token_budget: int
) -> tuple[dict[str, float], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Returns (metrics, (values before the update, advantages, returns)) for the full batch."""
    start = time.monotonic()
    device = backend.device
    mbs = update.lockstep_micro_batches(backend, batch, token_budget=token_budget)
    local = update.per_token_pass(batch.num_response_tokens, mbs, lambda mb: backend.values(mb)[0], device=device)
    old_values = all_reduce_sum(local).cpu()  # every rank needs all of them for the hand-off
    advantages, returns = gae(
        rewards=token_rewards(batch.rewards, batch.response_lengths, batch.loss_mask),
        values=old_values,
        response_lengths=batch.response_lengths,
        loss_mask=batch.loss_mask,
        gamma=algo.gamma,
        lambd=algo.lambd,
    )
    weights = update.TokenWeights.of(batch, algo.loss_aggregation, device)
    on_device = [x.to(device) for x in (old_values, returns, advantages)]

    def value_loss(mb: MicroBatch) -> update.MicroBatchLoss:
        values, anchor = backend.values(mb)
        old, ret, adv = (x[mb.token_index] for x in on_device)
        v_loss, clipped = clipped_value_loss(values=values, old_values=old, returns=ret, clip=algo.value_clip)
        w, tw = weights.at(mb)
        return update.MicroBatchLoss(
            loss=(w * v_loss).sum(),
            anchor=anchor,
            metrics=lambda: {
                "value_clipfrac": (tw * clipped).sum(),
                "value_mean": (tw * old).sum(),
                "return_mean": (tw * ret).sum(),
                "advantage_mean": (tw * adv).sum(),
            },
        )

    totals, step = update.optimizer_update(backend, mbs, micro_loss=value_loss)
    metrics = {
        **totals,
        "value_loss": totals["loss"],
        **update.step_metrics(batch, step, start, parameters=backend.parameters),
    }
    return metrics, (old_values, advantages, returns)

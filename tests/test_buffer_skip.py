"""A role that sits out a step (the actor during PPO's critic-only steps) releases its share of the entries."""

import uuid

import pytest

from services.buffer.stream import BufferError, RolloutBuffer
from services.contracts.sampling_spec import SamplingSpec
from services.contracts.wire import build_batch


def _batch(rollout_id):
    return build_batch(
        rollout_id=rollout_id,
        policy_version=0,
        prompts=[[1, 2]] * 2,
        responses=[[3]] * 2,
        log_probs=[[-0.5]] * 2,
        rewards=[1.0, 0.0],
        group_ids=[0, 0],
        finish_reasons=["stop"] * 2,
        sampling=SamplingSpec(),
    )


def test_skipped_entries_are_deleted_once_the_other_role_acks(redis_client):
    stream = f"test:{uuid.uuid4().hex}:rollouts"
    roles = ("actor", "critic")
    producer = RolloutBuffer(redis_client, stream, groups=roles, max_buffered_batches=2)
    critic = RolloutBuffer(redis_client, stream, groups=roles, group="critic", consumer="critic-0")
    ids = [producer.put(_batch(i), timeout_s=5) for i in range(2)]
    assert producer.backlog() == 2
    [e0, e1] = critic.read(ids, timeout_s=5)
    critic.ack([e0.entry_id, e1.entry_id])
    assert producer.backlog() == 2  # the actor never took them: still waiting for it
    assert producer.skip(ids, group="actor") == 2
    assert producer.backlog() == 0  # room for the producer again
    assert producer.skip(ids, group="actor") == 0  # a repeated call counts nothing twice
    assert not [k for k in redis_client.keys(f"{stream}*") if b"skipped" in k or b"acks" in k]


def test_skip_before_the_other_role_and_of_a_pending_entry(redis_client):
    stream = f"test:{uuid.uuid4().hex}:rollouts"
    roles = ("actor", "critic")
    producer = RolloutBuffer(redis_client, stream, groups=roles)
    actor = RolloutBuffer(redis_client, stream, groups=roles, group="actor", consumer="actor-0")
    critic = RolloutBuffer(redis_client, stream, groups=roles, group="critic", consumer="critic-0")
    first, second = producer.put(_batch(0), timeout_s=5), producer.put(_batch(1), timeout_s=5)
    actor.read([first], timeout_s=5)  # pending at the actor: skip acknowledges it
    assert producer.skip([first, second], group="actor") == 2
    assert actor.pending() == 0
    assert producer.backlog() == 2  # the critic has not acknowledged yet
    critic.ack([e.entry_id for e in critic.read([first, second], timeout_s=5)])
    assert producer.backlog() == 0
    with pytest.raises(BufferError, match="not one of the run's roles"):
        producer.skip([first], group="reference")

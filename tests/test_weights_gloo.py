"""gloo transport between real processes: bit-identical syncs reusing one group, deadlines, recovery.

The peer processes (helpers.weight_peer) take JSON commands; plans travel as protobuf bytes and
tensors are regenerated from seeds on both sides, so nothing is pickled.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers.weight_peer import Peer, make_tensors, plan_from_text, plan_to_text, specs_to_json

from services.contracts.config import ProcessGroupWeights
from services.weights import (
    TensorSpec,
    WeightPublisher,
    WeightReceiver,
    WeightSyncError,
    WeightSyncRefused,
    WeightSyncTimeout,
)
from services.weights.checksums import named_bucket_checksums, with_checksums
from services.weights.layout import layout_from_plan
from services.weights.transports.pg import ProcessGroupSender

pytestmark = pytest.mark.timeout(90)

# ~2.4 MB, bf16/fp32/int64 interleaved; 64 KB buckets: several per dtype (staging rings wrap), one
# tensor larger than a bucket (direct), a 0-dim and an empty tensor.
SPECS = (
    [TensorSpec("embed", "bfloat16", (512, 512))]
    + [
        s
        for i in range(6)
        for s in (
            TensorSpec(f"l{i}.norm", "float32", (256,)),
            TensorSpec(f"l{i}.qkv", "bfloat16", (96, 256)),
            TensorSpec(f"l{i}.mlp", "float32", (128, 256)),
            TensorSpec(f"l{i}.bias", "bfloat16", (256,)),
        )
    ]
    + [TensorSpec("step", "int64", ()), TensorSpec("unused", "float32", (0, 8))]
)


def _publisher(tmp_path: Path, *, timeout_s: float = 20.0, trainer_id: str = "actor-0") -> WeightPublisher:
    config = ProcessGroupWeights(transport="gloo", bucket_mb=0.0625, timeout_s=timeout_s)
    return WeightPublisher(config=config, run_dir=tmp_path, trainer_id=trainer_id)


def _stream(tensors: dict[str, torch.Tensor], specs=SPECS):
    for spec in specs:
        t = tensors[spec.name]
        yield spec.name, (t.t().contiguous().t() if t.dim() == 2 else t)  # non-contiguous sources too


def _sync(
    publisher: WeightPublisher,
    peer: Peer,
    *,
    version: int,
    verify: bool,
    rank: int = 1,
    peer_specs=SPECS,
    world: int = 1,
    by_bucket: bool = False,
):
    plan = publisher.prepare(SPECS, version, world, verify, verify_by_bucket=by_bucket)
    announced = plan
    if by_bucket:  # what the trainer service announces: its checksum of each bucket of the plan
        sums = named_bucket_checksums(layout_from_plan(plan), _stream(make_tensors(SPECS, seed=version)), where="t")
        announced = with_checksums(plan, sums, seconds=0.0)
    peer.send(op="receive", plan=plan_to_text(announced), rank=rank, specs=specs_to_json(peer_specs), seed=version)
    return announced, publisher.publish(plan, _stream(make_tensors(SPECS, seed=version))), peer.reply(timeout_s=60)


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.close()


def test_gloo_syncs_are_bit_identical_and_reuse_the_group(tmp_path: Path, peer: Peer):
    publisher = _publisher(tmp_path)
    plans, first_staging = [], None
    for version, verify, by_bucket in ((1, True, False), (2, False, False), (3, True, False), (4, True, True)):
        plan, sent, got = _sync(publisher, peer, version=version, verify=verify, by_bucket=by_bucket)
        plans.append(plan)
        assert got["ok"], got
        assert got["unequal"] == []  # torch.equal and byte equality, every tensor
        assert got["stats"]["bytes"] == sent.bytes == plan.total_bytes
        if by_bucket:  # the engine checked each bucket against the plan's and answers its own
            assert got["stats"]["bucket_checksums"] == [b.checksum for b in plan.buckets]
            assert sent.checksums == got["stats"]["checksums"] == {}  # no tensor was summed on its own
        elif verify:
            assert got["stats"]["checksums"] == sent.checksums and len(sent.checksums) == len(SPECS)
        else:
            assert sent.checksums == got["stats"]["checksums"] == {}
        sender = publisher._transport
        assert isinstance(sender, ProcessGroupSender)
        staging = sender._staging
        assert staging is not None and (version == 1 or staging is first_staging)  # allocated once per layout
        first_staging = staging
    assert len({(p.group_name, p.master_port) for p in plans}) == 1  # one group, built once, reused
    assert plans[0].world_size == 2 and len(plans[0].buckets) > 10
    assert {b.dtype for b in plans[0].buckets} == {"bfloat16", "float32", "int64"}
    publisher.close()


def test_gloo_receiver_never_joins(tmp_path: Path):
    publisher = _publisher(tmp_path, timeout_s=3.0)
    plan = publisher.prepare(SPECS, 7, 1, False)
    started = time.monotonic()
    with pytest.raises(
        WeightSyncTimeout,
        match=r"gloo weight sync v7 failed on the trainer: engine rank\(s\) \[1\] "
        r"did not join the sync within 3s",
    ):
        publisher.publish(plan, _stream(make_tensors(SPECS, seed=7)))
    assert time.monotonic() - started < 3.0 + 2.0
    assert publisher.prepare(SPECS, 8, 1, False).group_name != plan.group_name  # a fresh group next time
    publisher.close()


def test_gloo_mismatched_params_fail_both_sides_fast_then_recover(tmp_path: Path, peer: Peer):
    publisher = _publisher(tmp_path, timeout_s=5.0)
    wrong = [TensorSpec(s.name, s.dtype, (3,)) if s.name == "l2.mlp" else s for s in SPECS if s.name != "embed"]
    started = time.monotonic()
    with pytest.raises(
        WeightSyncRefused,
        match=r"gloo weight sync v4 failed on the trainer: engine rank 1 refused "
        r"the sync: 2 problem\(s\).*embed: missing.*"
        r"l2.mlp: have float32 \[3\]",
    ):
        _sync(publisher, peer, version=4, verify=False, peer_specs=wrong)
    assert time.monotonic() - started < 5.0  # told by the receiver, not its own deadline
    got = peer.reply(timeout_s=30)
    assert not got["ok"] and got["error"] == "ValueError" and "l2.mlp" in got["message"]
    _, _, got = _sync(publisher, peer, version=5, verify=True)  # same receiver process, new group
    assert got["ok"] and got["unequal"] == [], got
    publisher.close()


def test_gloo_receiver_dies_mid_transfer_then_a_new_one_syncs(tmp_path: Path):
    publisher = _publisher(tmp_path, timeout_s=5.0)
    doomed = Peer()
    plan = publisher.prepare(SPECS, 1, 1, False)
    doomed.send(op="receive", plan=plan_to_text(plan), rank=1, specs=specs_to_json(SPECS), seed=1)

    def dying(tensors):
        for i, item in enumerate(_stream(tensors)):
            if i == 8:
                doomed.kill()
            yield item

    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"gloo weight sync v1 failed on the trainer: .*engine rank\(s\) \[1\]"):
        publisher.publish(plan, dying(make_tensors(SPECS, seed=1)))
    assert time.monotonic() - started < 5.0 + 2.0
    fresh = Peer()
    try:
        plan2, sent, got = _sync(publisher, fresh, version=2, verify=True)
        assert plan2.group_name != plan.group_name
        assert got["ok"] and got["unequal"] == [] and got["stats"]["checksums"] == sent.checksums, got
    finally:
        fresh.close()
        publisher.close()


@pytest.mark.parametrize("failure", ["stall", "exit"])
def test_gloo_trainer_stalls_or_dies_mid_transfer(failure: str, tmp_path: Path):
    trainer = Peer()
    receiver = WeightReceiver()
    params = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in SPECS}
    try:
        answer = trainer.call(
            op="prepare",
            transport="gloo",
            bucket_mb=0.0625,
            timeout_s=3.0,
            specs=specs_to_json(SPECS),
            version=11,
            run_dir=str(tmp_path),
            trainer_id="actor-7",
        )
        plan = plan_from_text(answer["plan"])
        trainer.send(op="publish", seed=11, **({"stall_after": 10} if failure == "stall" else {"exit_after": 10}))
        started = time.monotonic()
        with pytest.raises(
            WeightSyncError,
            match=r"gloo weight sync v11 failed on the engine rank 1: .*peer: "
            r"trainer rank 0 at 127.0.0.1:\d+ \(trainer_id actor-7\)",
        ) as info:
            receiver.receive(plan, 1, params)
        assert time.monotonic() - started < 3.0 + 2.0
        assert isinstance(info.value, WeightSyncTimeout) == (failure == "stall")
    finally:
        trainer.kill()
        receiver.close()


def test_gloo_replaced_engine_rejoins_the_group_and_two_engines_sync(tmp_path: Path, peer: Peer):
    """A replica restarted between syncs makes the group rebuild (no failed sync); world size 3 works."""
    publisher = _publisher(tmp_path, timeout_s=10.0)
    first = Peer()
    plan1, _, got = _sync(publisher, first, version=1, verify=False)
    assert got["ok"], got
    first.kill()  # the replica dies between syncs...
    second = Peer()  # ...and its replacement takes rank 1
    try:
        plan2, sent, got = _sync(publisher, second, version=2, verify=True)
        assert got["ok"] and got["unequal"] == [] and got["stats"]["checksums"] == sent.checksums, got
        assert plan2.group_name == plan1.group_name  # same group, rebuilt under a new generation
        names = set()
        for version in (3, 4):  # a second replica: ranks 1 and 2
            plan = publisher.prepare(SPECS, version, 2, True)
            names.add(plan.group_name)
            for rank, engine in ((1, second), (2, peer)):
                engine.send(op="receive", plan=plan_to_text(plan), rank=rank, specs=specs_to_json(SPECS), seed=version)
            sent = publisher.publish(plan, _stream(make_tensors(SPECS, seed=version)))
            for engine in (second, peer):
                got = engine.reply(timeout_s=60)
                assert got["ok"] and got["unequal"] == [] and got["stats"]["checksums"] == sent.checksums, got
            assert plan.world_size == 3 and plan.group_name != plan1.group_name
        assert len(names) == 1
    finally:
        second.close()
        publisher.close()

"""GPU transports: cuda_ipc between two processes on one GPU, nccl between two GPUs, gloo from CUDA tensors.

Skipped without CUDA (nccl also without a second GPU). The receiver is a separate process
(helpers.weight_peer) with its params on the GPU; tensors come from seeds on both sides.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.weight_peer import Peer, make_tensors, plan_to_text, specs_to_json

from services.contracts.config import weights_config
from services.weights import TensorSpec, WeightPublisher, WeightSyncRefused, WeightSyncTimeout
from services.weights.transports.cuda_ipc import CudaIpcSender

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPECS = (
    [TensorSpec("embed", "bfloat16", (4096, 512))]
    + [
        s
        for i in range(4)
        for s in (
            TensorSpec(f"l{i}.norm", "float32", (512,)),
            TensorSpec(f"l{i}.w", "bfloat16", (512, 1024)),
            TensorSpec(f"l{i}.b", "float32", (1024,)),
        )
    ]
    + [TensorSpec("step", "int64", ())]
)


def _publisher(tmp_path: Path, transport: str, *, timeout_s: float = 30.0) -> WeightPublisher:
    config = weights_config(transport=transport, bucket_mb=1.0, timeout_s=timeout_s)
    return WeightPublisher(config=config, run_dir=tmp_path, trainer_id="actor-0")


def _cuda_tensors(version: int) -> dict[str, torch.Tensor]:
    return {n: t.cuda() for n, t in make_tensors(SPECS, seed=version).items()}


def _sync(publisher: WeightPublisher, peer: Peer, *, version: int, verify: bool = True):
    plan = publisher.prepare(SPECS, version, 1, verify)
    peer.send(op="receive", plan=plan_to_text(plan), rank=1, specs=specs_to_json(SPECS), seed=version, device="cuda")
    tensors = _cuda_tensors(version)
    sent = publisher.publish(plan, ((s.name, tensors[s.name]) for s in SPECS))
    return plan, sent, peer.reply(timeout_s=120)


def test_ipc_cuda_round_trip_reuses_buffers(tmp_path: Path):
    publisher, peer = _publisher(tmp_path, "cuda_ipc"), Peer()
    try:
        pointers = set()
        for version in (1, 2, 3):
            plan, sent, got = _sync(publisher, peer, version=version)
            assert got["ok"] and got["unequal"] == [], got
            assert got["stats"]["checksums"] == sent.checksums and len(sent.checksums) == len(SPECS)
            assert all(b.ipc.handle and b.ipc.storage_size_bytes == b.nbytes for b in plan.buckets)
            sender = publisher._transport
            assert isinstance(sender, CudaIpcSender) and sender._shared is not None
            pointers.add(sender._shared.flat.data_ptr())
        assert len(pointers) == 1  # exported once, reused while the layout holds
    finally:
        peer.close()
        publisher.close()


def test_ipc_cuda_foreign_trainer_refused_and_silent_receiver_times_out(tmp_path: Path):
    publisher = _publisher(tmp_path, "cuda_ipc", timeout_s=4.0)
    picky = Peer(env={"TANDEM_PEER_ACCEPT": "actor-9"})
    try:
        started = time.monotonic()
        with pytest.raises(
            WeightSyncRefused,
            match="cuda_ipc weight sync v1 failed on the trainer: engine rank 1 "
            "refused the sync: trainer 'actor-0' is not the accepted",
        ):
            _sync(publisher, picky, version=1)
        assert time.monotonic() - started < 4.0
        plan = publisher.prepare(SPECS, 2, 1, False)
        tensors = _cuda_tensors(2)
        started = time.monotonic()
        with pytest.raises(WeightSyncTimeout, match=r"engine rank\(s\) \[1\] did not confirm"):
            publisher.publish(plan, ((s.name, tensors[s.name]) for s in SPECS))
        assert time.monotonic() - started < 4.0 + 2.0
    finally:
        picky.kill()
        publisher.close()


def test_gloo_cuda_tensors_to_cuda_params(tmp_path: Path):
    publisher, peer = _publisher(tmp_path, "gloo"), Peer()
    try:
        for version in (1, 2):
            _, sent, got = _sync(publisher, peer, version=version)
            assert got["ok"] and got["unequal"] == [] and got["stats"]["checksums"] == sent.checksums, got
    finally:
        peer.close()
        publisher.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl needs two GPUs (one rank per GPU)")
def test_nccl_cuda_two_gpus(tmp_path: Path):
    torch.cuda.set_device(0)
    publisher, peer = _publisher(tmp_path, "nccl"), Peer(env={"CUDA_VISIBLE_DEVICES": "1"})
    try:
        plans = []
        for version in (1, 2, 3):
            plan, sent, got = _sync(publisher, peer, version=version, verify=version != 2)
            plans.append(plan)
            assert got["ok"] and got["unequal"] == [] and got["stats"]["checksums"] == sent.checksums, got
        assert len({p.group_name for p in plans}) == 1
    finally:
        peer.close()
        publisher.close()


@pytest.mark.parametrize("flat", ["recipe", True])
@pytest.mark.parametrize("keep_mapped", [False, True])
def test_ipc_flat_receiver_copies_each_bucket_once(tmp_path: Path, keep_mapped: bool, flat):
    """Params laid out like the buckets (flat_views): bit-identical every sync, with one copy per bucket from a
    plain mapping of the views ("recipe") and one copy for all buckets from the FlatParams. A kept mapping is
    dropped when the plan says the trainer frees its buffers after the sync (offload_train)."""
    publisher = _publisher(tmp_path, "cuda_ipc")
    peer = Peer(env={"TANDEM_CUDA_IPC_KEEP_MAPPED": "1" if keep_mapped else "0"})
    try:
        for version in (1, 2, 3):
            plan = publisher.prepare(SPECS, version, 1, True)
            # as the coordinator does: its copy of the trainer's plan, for the engines
            sent_plan = replace(plan, buffers_freed_after=version == 3)
            peer.send(
                op="receive",
                plan=plan_to_text(sent_plan),
                rank=1,
                specs=specs_to_json(SPECS),
                seed=version,
                device="cuda",
                flat=flat,
            )
            tensors = _cuda_tensors(version)
            sent = publisher.publish(plan, ((s.name, tensors[s.name]) for s in SPECS))
            got = peer.reply(timeout_s=120)
            assert got["ok"] and got["unequal"] == [] and got["stats"]["checksums"] == sent.checksums, got
            assert got["copies"] == (1 if flat is True else len([b for b in plan.buckets if b.nbytes]))
            assert got["kept_mappings"] == (1 if keep_mapped and version < 3 else 0)
    finally:
        peer.close()
        publisher.close()

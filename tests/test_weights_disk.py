"""The disk transport: atomic version directories of safetensors files, cleanup, waiting receivers."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.weight_peer import bits_equal, make_tensors
from safetensors.torch import load_file

from services.contracts.config import DiskWeights
from services.weights import TensorSpec, WeightPublisher, WeightReceiver, WeightSyncError, WeightSyncTimeout
from services.weights.checksums import with_checksums

SPECS = [
    TensorSpec("embed", "bfloat16", (256, 64)),
    TensorSpec("norm", "float32", (64,)),
    TensorSpec("w", "bfloat16", (64, 64)),
    TensorSpec("big", "float32", (128, 128)),
    TensorSpec("scalar", "float32", ()),
    TensorSpec("ids", "int64", (5,)),
    TensorSpec("none", "bfloat16", (0,)),
]


def _publisher(tmp_path: Path, *, timeout_s: float = 5.0) -> WeightPublisher:
    config = DiskWeights(bucket_mb=0.04, timeout_s=timeout_s)
    return WeightPublisher(config=config, run_dir=tmp_path, trainer_id="actor-0")


def _zeros() -> dict[str, torch.Tensor]:
    return {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in SPECS}


def test_disk_round_trip_atomic_and_cleaned(tmp_path: Path):
    publisher, receiver, params = _publisher(tmp_path), WeightReceiver(accepted_trainer_id="actor-0"), _zeros()
    root = tmp_path / "weights"
    for version in range(1, 5):
        plan = publisher.prepare(SPECS, version, 1, version % 2 == 1)
        assert plan.disk_path == str(root / f"v{version}") and len(plan.buckets) > 2
        tensors = make_tensors(SPECS, seed=version)
        result: dict = {}
        # the receiver starts first and waits for the directory, as with the coordinator's concurrent calls
        thread = threading.Thread(target=lambda r=result, p=plan: r.update(stats=receiver.receive(p, 1, params)))
        thread.start()
        time.sleep(0.05)
        sent = publisher.publish(plan, [(s.name, tensors[s.name]) for s in SPECS])
        thread.join(10)
        got = result["stats"]
        assert all(bits_equal(params[n], t) for n, t in tensors.items())
        assert got.bytes == sent.bytes == sum(s.nbytes for s in SPECS)
        if plan.verify:
            assert got.checksums == sent.checksums and len(sent.checksums) == len(SPECS)
        else:
            assert got.checksums == sent.checksums == {}
        # every bucket file is a plain safetensors file with the right tensors
        loaded = {}
        for i in range(len(plan.buckets)):
            loaded.update(load_file(root / f"v{version}" / f"bucket-{i:05d}.safetensors"))
        assert loaded.keys() == tensors.keys() and all(bits_equal(loaded[n], t) for n, t in tensors.items())
    assert sorted(p.name for p in root.iterdir()) == ["v3", "v4"]  # last two kept, no temporary directories


def test_disk_retried_version_replaces_the_old(tmp_path: Path):
    publisher, params = _publisher(tmp_path), _zeros()
    for seed in (1, 2):
        plan = publisher.prepare(SPECS, 7, 1, True)
        tensors = make_tensors(SPECS, seed=seed)
        publisher.publish(plan, [(s.name, tensors[s.name]) for s in SPECS])
    WeightReceiver().receive(plan, 1, params)
    assert all(bits_equal(params[n], t) for n, t in make_tensors(SPECS, seed=2).items())
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v7"]


def test_disk_receiver_times_out_clearly(tmp_path: Path):
    plan = _publisher(tmp_path, timeout_s=0.5).prepare(SPECS, 9, 1, False)
    started = time.monotonic()
    with pytest.raises(
        WeightSyncTimeout,
        match=r"disk weight sync v9 failed on the engine rank 1: .*v9.*did not "
        r"appear within 0.5s \(peer: trainer actor-0",
    ):
        WeightReceiver().receive(plan, 1, _zeros())
    assert time.monotonic() - started < 2.0


def test_disk_detects_tampered_files_when_verifying(tmp_path: Path):
    publisher = _publisher(tmp_path)
    plan = publisher.prepare(SPECS, 1, 1, True)
    tensors = make_tensors(SPECS, seed=1)
    publisher.publish(plan, [(s.name, tensors[s.name]) for s in SPECS])
    path = tmp_path / "weights" / "v1" / "bucket-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(WeightSyncError, match="1 tensor\\(s\\) differ from the trainer's checksums"):
        WeightReceiver().receive(plan, 1, _zeros())


def test_a_bucket_verified_sync_checks_each_bucket_and_names_a_tampered_one(tmp_path: Path):
    """Verifying by bucket, as the coordinator's syncs do: the trainer announces a checksum per bucket, the engine
    sums each bucket once and compares; a flipped bit names the bucket, its dtype and its tensors."""
    from services.weights import WeightChecksumMismatch
    from services.weights.checksums import named_bucket_checksums
    from services.weights.layout import layout_from_plan

    publisher = _publisher(tmp_path)
    plan = publisher.prepare(SPECS, 3, 1, True, verify_by_bucket=True)
    tensors = make_tensors(SPECS, seed=3)
    sums = named_bucket_checksums(layout_from_plan(plan), ((s.name, tensors[s.name]) for s in SPECS), where="t")
    announced = with_checksums(plan, sums, seconds=0.0)  # what the trainer service answers with
    sent = publisher.publish(plan, [(s.name, tensors[s.name]) for s in SPECS])
    params = _zeros()
    got = WeightReceiver().receive(announced, 1, params)
    assert got.bucket_checksums == tuple(sums) and got.checksums == sent.checksums == {}
    assert all(bits_equal(params[n], t) for n, t in tensors.items())
    path = tmp_path / "weights" / "v3" / "bucket-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one bit of the bucket's last tensor
    path.write_bytes(bytes(data))
    first = plan.buckets[0]
    with pytest.raises(
        WeightChecksumMismatch,
        match=rf"1 of {len(sums)} bucket\(s\) differ from the trainer's "
        rf"checksums: bucket 0 \({first.dtype}, .* MiB: {first.tensors[0].name}",
    ):
        WeightReceiver().receive(announced, 1, _zeros())


def test_receiver_compares_checksums_announced_in_the_plan(tmp_path: Path):
    """The trainer service fills TensorMeta.checksum of the plan it announces; receivers check against it."""
    publisher = _publisher(tmp_path)
    plan = publisher.prepare(SPECS, 2, 1, True)
    tensors = make_tensors(SPECS, seed=2)
    publisher.publish(plan, [(s.name, tensors[s.name]) for s in SPECS])
    (tmp_path / "weights" / "v2" / "manifest.json").write_text(
        (tmp_path / "weights" / "v2" / "manifest.json").read_text().replace('"checksums"', '"was"')
    )
    WeightReceiver().receive(plan, 1, _zeros())  # no checksums anywhere: nothing to compare
    from services.weights import tensor_checksum

    sums = {name: tensor_checksum(tensor) for name, tensor in tensors.items()}
    announced = with_checksums(plan, {**sums, plan.buckets[0].tensors[0].name: "0" * 32}, seconds=0.0)
    with pytest.raises(WeightSyncError, match=f"1 tensor\\(s\\) differ.*{announced.buckets[0].tensors[0].name}"):
        WeightReceiver().receive(announced, 1, _zeros())

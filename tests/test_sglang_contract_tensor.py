"""Contract tests of `cuda_ipc` with rollout.engine sglang: /update_weights_from_tensor.

The trainer side is the real one (SGLangTensorSender: fresh bucket buffers, torch's ForkingPickler + base64 as
SGLang's MultiprocessingSerializer expects, the go/done handshake over the trainer's store), the adapter's side too
(TensorSync). CUDA IPC cannot run here, so the buffers are on the CPU (`device="cpu"`, tests named
..._cpu_buffers): torch then serialises shared-memory handles where it would write CUDA IPC handles, the pickle is
otherwise the same. The contract server checks each payload as SGLang's SafeUnpickler would judge it, without
unpickling (its globals against the allow-list) and records the strings it holds; nobody here unpickles anything.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.sglang_contract_server import ContractServer
from helpers.sglang_contract_weights import CRASH_EXIT, inspect_pickle, payload_problem
from helpers.weight_peer import make_tensors

from services.contracts.config import CudaIpcWeights
from services.contracts.sampling_spec import SamplingSpec
from services.rollout.engines.sglang.engine import SGLangEngine
from services.rollout.engines.sglang.http import SGLangClient, SGLangUnavailable, is_loopback
from services.rollout.engines.sglang.weight_send_tensor import (
    SGLangTensorSender,
    _reduce_cuda_tensor_by_uuid,
    serialize_for_sglang,
)
from services.rollout.engines.sglang.weight_sync_tensor import TensorSync
from services.weights import TensorSpec, WeightPublisher, WeightReceiver, WeightSyncError

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

SPECS = (
    [TensorSpec("model.embed_tokens.weight", "bfloat16", (64, 32))]
    + [
        s
        for i in range(3)
        for s in (
            TensorSpec(f"model.layers.{i}.input_layernorm.weight", "float32", (32,)),
            TensorSpec(f"model.layers.{i}.mlp.up_proj.weight", "bfloat16", (48, 32)),
        )
    ]
    + [TensorSpec("unused", "float32", (0, 4))]
)


def publisher(tmp_path: Path, load_format: str) -> WeightPublisher:
    config = CudaIpcWeights(bucket_mb=0.004, timeout_s=20.0)
    sender = SGLangTensorSender(config=config, trainer_id="actor-0", load_format=load_format, device="cpu")
    return WeightPublisher(transport=sender, config=config, run_dir=tmp_path, trainer_id="actor-0")


def sync(pub: WeightPublisher, engine: SGLangEngine, *, version: int):
    tensors = make_tensors(SPECS, seed=version)
    plan = pub.prepare(SPECS, version, engine.engine_ranks)
    engine.pause("drain", timeout_s=10)
    try:
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(engine.receive_weights, plan, rank_offset=1, receiver=WeightReceiver())
            try:
                pub.publish(plan, ((s.name, tensors[s.name]) for s in SPECS))
            except BaseException:
                received.exception(timeout=60)
                raise
            return plan, received.result(timeout=60)
    finally:
        engine.resume()


def write_checkpoint(directory: Path, specs: list[TensorSpec]) -> Path:
    """A safetensors header (and zeroed data) for `specs`: what the adapter reads to check names and shapes."""
    codes = {"bfloat16": "BF16", "float32": "F32"}
    header, offset = {}, 0
    for spec in specs:
        header[spec.name] = {
            "dtype": codes[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header).encode()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return directory


@pytest.mark.parametrize(
    ("profile", "load_format"), [("0.5.17", "tensor"), ("0.5.17", "flattened_bucket"), ("0.5.23", "tensor")]
)
def test_sglang_contract_tensor_updates_cpu_buffers(tmp_path: Path, profile: str, load_format: str):
    model = write_checkpoint(tmp_path / "model", SPECS)
    server = ContractServer("--profile", profile, "--model-path", str(model))
    engine = SGLangEngine([server.url], startup_timeout_s=20)
    pub = publisher(tmp_path, load_format)
    try:
        for version in (1, 2):
            plan, got = sync(pub, engine, version=version)
            assert got.version == version == engine.weight_version
        assert plan.sglang_load_format == load_format
        with_tensors = [b for b in plan.buckets if any(m.nbytes for m in b.tensors)]
        assert all(len(b.sglang_payloads) == 1 for b in with_tensors)  # one per engine rank
        assert all(not b.sglang_payloads for b in plan.buckets if b not in with_tensors)  # "unused" has no elements
        updates = server.state()["tensor_updates"]
        assert len(updates) == 2 * len(with_tensors)
        last_sync = updates[len(with_tensors) :]
        for bucket, update in zip(with_tensors, last_sync, strict=True):
            names = [m.name for m in bucket.tensors if m.nbytes]
            assert set(names) <= set(update["strings"])  # the pickle names every tensor
            assert update["load_format"] == (None if load_format == "tensor" else load_format)
            assert update["flush_cache"] is False
        assert [u["weight_version"] for u in last_sync] == [None] * (len(with_tensors) - 1) + ["2"]
        paths = [e["path"] for e in server.log()]
        session = ["/end_weight_update"] if profile == "0.5.23" else []
        assert paths[-3 - len(session) :] == [
            "/update_weights_from_tensor",
            *session,
            "/flush_cache",
            "/continue_generation",
        ]
        assert engine.generate([[3]], SamplingSpec(max_new_tokens=1))[0].weight_version == 2
    finally:
        pub.close()
        engine.close()
        server.stop()


def test_sglang_contract_tensor_payloads_pass_the_allow_list_cpu_buffers():
    """What the trainer writes for SGLang: base64 of a protocol >= 2 pickle whose every global is in SGLang's
    SafeUnpickler allow-list, holding the names; flattened buckets carry SimpleNamespace metadata (types.*), not
    an SGLang class, so sglang need not be importable in the trainer."""
    buffer = torch.zeros(64, dtype=torch.uint8)
    for obj in (
        [("a.weight", buffer[:32].view(torch.bfloat16).view(4, 4))],
        {
            "flattened_tensor": buffer,
            "metadata": [
                SimpleNamespace(
                    name="a.weight", shape=torch.Size([4, 4]), dtype=torch.bfloat16, start_idx=0, end_idx=32, numel=32
                )
            ],
        },
    ):
        payload = serialize_for_sglang(obj, cuda_uuid=False)
        assert payload_problem(payload) is None
        globals_, strings = inspect_pickle(base64.b64decode(payload))
        assert "a.weight" in strings and all(
            m.startswith(("torch", "builtins", "types", "multiprocessing", "collections", "copyreg"))
            for m, _ in globals_
        )
    problem = payload_problem(base64.b64encode(b"\x80\x04cos\nsystem\n.").decode())
    assert problem is not None and "Blocked unsafe class loading (os.system)" in problem
    with pytest.raises(WeightSyncError, match="sends CUDA tensors only"):
        _reduce_cuda_tensor_by_uuid(buffer)


def test_sglang_contract_tensor_plans_are_checked_before_anything_reaches_sglang(tmp_path: Path):
    model = write_checkpoint(
        tmp_path / "model", [*SPECS[:2], TensorSpec(SPECS[2].name, "bfloat16", (48, 31)), *SPECS[3:]]
    )
    server = ContractServer("--profile", "0.5.17", "--model-path", str(model))
    engine = SGLangEngine([server.url], startup_timeout_s=20)
    pub = publisher(tmp_path, "tensor")
    try:
        plan = pub.prepare(SPECS, 1, 1)
        with pytest.raises(
            ValueError,
            match=r"1 tensor\(s\) of another shape: model.layers.0.mlp.up_proj.weight "
            r"\[48, 32\] \(checkpoint \[48, 31\]\)",
        ):
            engine.receive_weights(plan, rank_offset=1, receiver=WeightReceiver())
        good = write_checkpoint(tmp_path / "good", SPECS)  # as if the server had loaded this one
        engine.servers[0].info = dataclasses.replace(engine.servers[0].info, model_path=str(good))
        prepared = pub.prepare(SPECS, 2, 1)
        first = prepared.buckets[0]
        bad_first = dataclasses.replace(first, sglang_payloads=("not base64!", *first.sglang_payloads[1:]))
        broken = dataclasses.replace(prepared, buckets=(bad_first, *prepared.buckets[1:]))
        with pytest.raises(ValueError, match="bucket 0's payload for engine rank 1 is not base64"):
            engine.receive_weights(broken, rank_offset=1, receiver=WeightReceiver())
        native = dataclasses.replace(pub.prepare(SPECS, 3, 1), sglang_load_format="")
        with pytest.raises(ValueError, match="prepared this cuda_ipc sync for native engines"):
            engine.receive_weights(native, rank_offset=1, receiver=WeightReceiver())
        assert server.state()["tensor_updates"] == [] and server.proc.poll() is None
        # the other way round: a native engine's receiver refuses a plan made for SGLang
        with pytest.raises(ValueError, match="prepared this sync for SGLang engines"):
            WeightReceiver().receive(pub.prepare(SPECS, 4, 1), 1, make_tensors(SPECS, seed=0))
        remote = SimpleNamespace(url="http://10.1.2.3:30000", info=SimpleNamespace(tp_size=1, model_path=""))
        reason = TensorSync([remote], handshake=None, pool=None, flush=None, probe_s=1.0).refusal(  # type: ignore
            pub.prepare(SPECS, 5, 1), 1
        )
        assert reason is not None
        assert "needs SGLang on the trainer's host, and http://10.1.2.3:30000 is not a loopback" in reason
        assert is_loopback("http://localhost:1") and is_loopback("http://[::1]:2") and not is_loopback("http://h:3")
    finally:
        pub.close()
        engine.close()
        server.stop()


def test_sglang_contract_server_dies_where_sglang_does():
    """SGLang 0.5.17 raises in its scheduler (and the server goes away) on a flush_cache inside an update while a
    request runs, and on a tensor payload it cannot read: the adapter never sends either, and the contract server
    dies there too, so a test that did would fail loudly."""
    for body in ({"serialized_named_tensors": ["not base64!"]}, {"serialized_named_tensors": [], "flush_cache": False}):
        server = ContractServer("--profile", "0.5.17")
        try:
            with pytest.raises(SGLangUnavailable):
                SGLangClient(server.url).post("/update_weights_from_tensor", body, timeout_s=5)
            assert server.proc.wait(timeout=10) == CRASH_EXIT
        finally:
            server.stop()
    server = ContractServer("--profile", "0.5.17")
    try:
        client = SGLangClient(server.url)
        server.configure(token_delay_s=0.05)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(
                client.post,
                "/generate",
                {"input_ids": [[1]], "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}},
                timeout_s=20,
            )
            while server.state()["running"] == 0:
                time.sleep(0.02)
            payload = serialize_for_sglang([("x", torch.zeros(2))], cuda_uuid=False)
            with pytest.raises(SGLangUnavailable):
                client.post(
                    "/update_weights_from_tensor",
                    {"serialized_named_tensors": [payload], "flush_cache": True},
                    timeout_s=5,
                )
        assert server.proc.wait(timeout=10) == CRASH_EXIT
    finally:
        server.stop()

"""Contract tests of weight sync with SGLang: the trainer's sender, the adapter and a process that receives exactly
as SGLang does, over gloo.

The trainer side is this test process (WeightPublisher, transport gloo: SGLangAwareSender). The contract server
joins the group in /init_weights_update_group with a copy of SGLang's init_custom_process_group (tcp://
rendezvous, PrefixStore(group_name), torch's _new_process_group_helper) and receives in
/update_weights_from_distributed as SGLang's ModelRunner does (per tensor, or one flattened uint8 bucket), into its
own tensors; it reports blake2b checksums of what it holds, compared here with its digest of what was sent.
"""

from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers.sglang_contract_server import ContractServer, blake2b_hex
from helpers.weight_peer import make_tensors

from services.contracts.config import weights_config
from services.contracts.sampling_spec import SamplingSpec
from services.coordinator.policy import sync_pause_mode
from services.rollout.engines.sglang.engine import SGLangEngine
from services.weights import (
    TensorSpec,
    WeightPublisher,
    WeightReceiver,
    WeightSyncError,
    WeightSyncRefused,
    WeightSyncTimeout,
)

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

# bf16 / fp32 / int64 interleaved, 64 KiB buckets: staged buckets that wrap the staging rings, one tensor larger
# than a bucket (a direct bucket), a 0-dim tensor and one without elements (never announced to SGLang).
SPECS = (
    [TensorSpec("embed", "bfloat16", (256, 256))]
    + [
        s
        for i in range(4)
        for s in (
            TensorSpec(f"l{i}.norm", "float32", (64,)),
            TensorSpec(f"l{i}.qkv", "bfloat16", (96, 64)),
            TensorSpec(f"l{i}.mlp", "float32", (64, 96)),
            TensorSpec(f"l{i}.bias", "bfloat16", (64,)),
        )
    ]
    + [TensorSpec("step", "int64", ()), TensorSpec("unused", "float32", (0, 8))]
)


@pytest.fixture(autouse=True)
def loopback_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


def publisher(tmp_path: Path, *, transport: str = "gloo", timeout_s: float = 20.0) -> WeightPublisher:
    disk = {"disk_dir": str(tmp_path / "w")} if transport == "disk" else {}
    config = weights_config(transport=transport, bucket_mb=0.0625, timeout_s=timeout_s, **disk)
    return WeightPublisher(config=config, run_dir=tmp_path, trainer_id="actor-0")


def sync(
    pub: WeightPublisher,
    engine: SGLangEngine,
    *,
    version: int,
    verify: bool = False,
    receiver: WeightReceiver | None = None,
    rank_offset: int = 1,
    pause: str = "drain",
):
    """One sync as the coordinator runs it: pause, engine RPC and trainer publish concurrently, resume."""
    tensors = make_tensors(SPECS, seed=version)
    plan = pub.prepare(SPECS, version, engine.engine_ranks, verify)
    engine.pause(pause, timeout_s=10)
    try:
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(
                engine.receive_weights, plan, rank_offset=rank_offset, receiver=receiver or WeightReceiver()
            )
            try:
                sent = pub.publish(plan, ((s.name, tensors[s.name]) for s in SPECS))
            except BaseException:
                received.exception(timeout=60)  # the engine side fails too; the trainer's error is the one raised
                raise
            return plan, tensors, sent, received.result(timeout=60)
    finally:
        engine.resume()


def assert_holds(server: ContractServer, tensors: dict[str, torch.Tensor], *, empty_sent: bool = False) -> None:
    held = server.weights()
    for spec in SPECS:
        if tensors[spec.name].numel() == 0 and not empty_sent:
            assert spec.name not in held  # nothing to load, never announced
            continue
        assert held[spec.name] == {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "checksum": blake2b_hex(tensors[spec.name]),
        }, spec.name  # its own digest


def weight_calls(server: ContractServer) -> list[tuple[str, dict]]:
    return [(e["path"], e["body"]) for e in server.log() if "weight" in e["path"] or "group" in e["path"]]


@pytest.mark.parametrize("load_format", ["tensor", "flattened_bucket"])
def test_sglang_contract_nccl_group_handshake_over_gloo(tmp_path: Path, load_format: str):
    server = ContractServer("--profile", "0.5.23")
    engine = SGLangEngine([server.url], weight_load_format=load_format, startup_timeout_s=20)
    pub = publisher(tmp_path)
    try:
        for version in (1, 2):
            plan, tensors, sent, got = sync(pub, engine, version=version)
            assert_holds(server, tensors)  # bit-identical, every tensor with elements
            assert got.version == version == engine.weight_version and sent.bytes == plan.total_bytes
        calls = weight_calls(server)
        inits = [b for p, b in calls if p == "/init_weights_update_group"]
        assert inits == [
            {
                "master_address": "127.0.0.1",
                "master_port": plan.master_port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": plan.group_name,
                "backend": "gloo",
            }
        ]  # joined once, reused
        per_sync = [p for p, _ in calls[1:]]
        n = len([b for b in plan.buckets if any(t.nbytes for t in b.tensors)])
        assert (
            per_sync
            == (["/begin_weight_update"] + ["/update_weights_from_distributed"] * n + ["/end_weight_update"]) * 2
        )
        updates = [b for p, b in calls if p == "/update_weights_from_distributed"][n:]
        assert [b.get("weight_version") for b in updates] == [None] * (n - 1) + ["2"]  # set once complete
        assert [b["flush_cache"] for b in updates] == [False] * n  # a flush inside an update is an assert in SGLang
        paths = [e["path"] for e in server.log()]
        assert paths[-3:] == ["/end_weight_update", "/flush_cache", "/continue_generation"]  # the adapter's own
        assert all(b.get("load_format") == (None if load_format == "tensor" else load_format) for b in updates)
        announced = [name for b in updates for name in b["names"]]
        assert announced == [t.name for b in plan.buckets for t in b.tensors if t.nbytes]  # bucket order
        assert engine.generate([[3]], SamplingSpec(max_new_tokens=1))[0].weight_version == 2  # SGLang's "2"
    finally:
        pub.close()
        engine.close()
        server.stop()


def test_sglang_contract_two_servers_one_group_and_session_probing(tmp_path: Path):
    old, new = ContractServer("--profile", "0.5.15"), ContractServer("--profile", "0.5.23")
    engine = SGLangEngine([old.url, new.url], startup_timeout_s=20)
    pub = publisher(tmp_path)
    try:
        assert engine.engine_ranks == 2
        for version in (3, 4):
            plan, tensors, _, _ = sync(pub, engine, version=version)
            assert plan.world_size == 3
            assert_holds(old, tensors)
            assert_holds(new, tensors)
        ranks = [b["rank_offset"] for s in (old, new) for p, b in weight_calls(s) if p == "/init_weights_update_group"]
        assert ranks == [1, 2]
        old_paths = [p for p, _ in weight_calls(old)]
        assert old_paths.count("/begin_weight_update") == 1  # probed once (404 on 0.5.15), then not again
        assert "/end_weight_update" not in old_paths
        assert [p for p, _ in weight_calls(new)].count("/begin_weight_update") == 2
    finally:
        pub.close()
        engine.close()
        old.stop()
        new.stop()


def start_long_request(pool: ThreadPoolExecutor, engine: SGLangEngine, server: ContractServer):
    """A 40-token request, once the server generates it (slowly, with token_delay_s set)."""
    running = pool.submit(engine.generate, [[1]], SamplingSpec(max_new_tokens=40, ignore_eos=True))
    while server.state()["running"] == 0:
        time.sleep(0.02)
    return running


@pytest.mark.parametrize("inflight", ["keep", "recompute"])
def test_sglang_contract_an_in_flight_update_reaches_the_later_tokens(tmp_path: Path, inflight: str):
    """rollout.inflight_update with SGLang: the coordinator pauses in_place (keep) or retract (recompute), the weights
    land while the request is parked, and it goes on: its later tokens are the new weights' (their log-probs, each
    token's behaviour log-prob, say so), while SGLang reports no per-token version, so the sample keeps the version
    it began with. recompute needs the radix cache off (else retract would reuse the old weights' KV): refused."""
    with pytest.raises(ValueError, match=r"rollout\.inflight_update: recompute needs SGLang without its radix cache"):
        plain = ContractServer("--profile", "0.5.17")
        try:
            SGLangEngine([plain.url], startup_timeout_s=20, inflight_update="recompute")
        finally:
            plain.stop()
    server = ContractServer("--profile", "0.5.17", "--server-arg", "disable_radix_cache=true")
    engine = SGLangEngine([server.url], startup_timeout_s=20, inflight_update=inflight)
    pub = publisher(tmp_path)
    server.configure(token_delay_s=0.02)
    try:
        with ThreadPoolExecutor(2) as pool:
            running = start_long_request(pool, engine, server)
            time.sleep(0.1)
            sync(pub, engine, version=5, pause=sync_pause_mode(inflight))
            (sample,) = running.result(timeout=30)
        tokens = [(2 + i) % 22 for i in range(40)]
        old = [-(0.25 + 0.01 * t) for t in tokens]
        new = [-(0.25 + 0.01 * t + 0.5) for t in tokens]
        switch = next(i for i, (a, b) in enumerate(zip(sample.log_probs, old, strict=True)) if abs(a - b) > 1e-6)
        assert 0 < switch < 40 and list(sample.token_ids) == tokens
        assert list(sample.log_probs) == pytest.approx(old[:switch] + new[switch:])
        assert sample.weight_version == 0 and sample.versions == (0,) * 40  # no per-token version from SGLang
        assert [e["body"] for e in server.log() if e["path"] == "/pause_generation"] == [
            {"mode": sync_pause_mode(inflight)}
        ]
    finally:
        server.configure(token_delay_s=0.0)
        pub.close()
        engine.close()
        server.stop()


def test_sglang_contract_in_place_keeps_the_kv_cache(tmp_path: Path):
    """A request parked by pause(in_place) keeps its KV cache: no update may ask for a flush (the contract server,
    like SGLang's scheduler, fails an update whose flush finds requests in the running batch)."""
    server = ContractServer("--profile", "0.5.23")
    engine = SGLangEngine([server.url], pause_mode="in_place", startup_timeout_s=20)
    pub = publisher(tmp_path)
    server.configure(token_delay_s=0.02)
    try:
        with ThreadPoolExecutor(2) as pool:
            running = start_long_request(pool, engine, server)
            tensors = make_tensors(SPECS, seed=5)
            plan = pub.prepare(SPECS, 5, engine.engine_ranks, False)
            engine.pause("in_place", timeout_s=10)
            assert server.state()["parked"] == 1
            received = pool.submit(engine.receive_weights, plan, rank_offset=1, receiver=WeightReceiver())
            pub.publish(plan, ((s.name, tensors[s.name]) for s in SPECS))
            received.result(timeout=30)
            engine.resume()
            (sample,) = running.result(timeout=30)
        assert_holds(server, tensors)
        assert all(b["flush_cache"] is False for p, b in weight_calls(server) if "update_weights" in p)
        assert "/flush_cache" not in [e["path"] for e in server.log()]  # in_place: the parked KV cache stays
        assert sample.finish_reason == "length" and len(sample.token_ids) == 40
        assert sample.weight_version == 0  # began under version 0; SGLang reports the new one at the end
    finally:
        server.configure(token_delay_s=0.0)
        pub.close()
        engine.close()
        server.stop()


def test_sglang_contract_a_failed_join_fails_both_sides_at_once(tmp_path: Path):
    server = ContractServer("--profile", "0.5.23")
    engine = SGLangEngine([server.url], startup_timeout_s=20)
    pub = publisher(tmp_path, timeout_s=30.0)
    server.configure(
        fail={
            "/init_weights_update_group": "Failed to initialize custom process group: NCCL error "
            "in: unhandled system error"
        }
    )
    try:
        start = time.monotonic()
        with pytest.raises(WeightSyncRefused, match=r"SGLang engine rank 1 gave up: .*unhandled system error"):
            sync(pub, engine, version=1)
        assert time.monotonic() - start < 10  # not the 30 s deadline
        server.configure(fail={})
        plan, tensors, _, _ = sync(pub, engine, version=2)  # recovers: a fresh group under a new name
        assert_holds(server, tensors)
        names = [b["group_name"] for p, b in weight_calls(server) if p == "/init_weights_update_group"]
        assert len(names) == 2 and names[0] != names[1] == plan.group_name
    finally:
        pub.close()
        engine.close()
        server.stop()


def test_sglang_contract_a_server_that_stops_answering_mid_sync(tmp_path: Path):
    server = ContractServer("--profile", "0.5.23", "--pg-timeout-s", "5")
    engine = SGLangEngine([server.url], startup_timeout_s=20)
    pub = publisher(tmp_path, timeout_s=3.0)
    server.configure(hang=["/update_weights_from_distributed"])
    try:
        start = time.monotonic()
        with pytest.raises((WeightSyncTimeout, WeightSyncRefused)):
            sync(pub, engine, version=1)
        assert time.monotonic() - start < 8  # both sides within the 3 s deadline (+ teardown)
        tensors = make_tensors(SPECS, seed=1)
        plan = pub.prepare(SPECS, 1, engine.engine_ranks, False)
        with ThreadPoolExecutor(1) as pool:  # the adapter's side alone: its HTTP deadline holds
            received = pool.submit(engine.receive_weights, plan, rank_offset=1, receiver=WeightReceiver())
            with pytest.raises(WeightSyncError):
                pub.publish(plan, ((s.name, tensors[s.name]) for s in SPECS))
            with pytest.raises(WeightSyncError, match=r"update_weights_from_distributed: no answer within|gave up"):
                received.result(timeout=20)
    finally:
        server.configure(hang=[])
        pub.close()
        engine.close()
        server.stop()


def test_sglang_contract_refusals_reach_the_trainer(tmp_path: Path):
    server = ContractServer("--profile", "0.5.23")
    engine = SGLangEngine([server.url], startup_timeout_s=20)
    pub = publisher(tmp_path)
    try:
        start = time.monotonic()
        with pytest.raises(WeightSyncRefused, match="check_weight_update_equal is not supported"):
            sync(pub, engine, version=1, verify=True)
        with pytest.raises(WeightSyncRefused, match="'actor-0' is not the accepted trainer 'other'"):
            sync(pub, engine, version=2, receiver=WeightReceiver(accepted_trainer_id="other"))
        assert time.monotonic() - start < 10
        # a plan that names cuda_ipc but carries no SGLang payloads
        plan = dataclasses.replace(pub.prepare(SPECS, 3, 1, False), transport="cuda_ipc")
        with pytest.raises(ValueError, match="prepared this cuda_ipc sync for native engines"):
            engine.receive_weights(plan, rank_offset=1, receiver=WeightReceiver())
        assert weight_calls(server) == []  # nothing reached SGLang
    finally:
        pub.close()
        engine.close()
        server.stop()


def test_sglang_contract_disk_transport_is_update_weights_from_disk(tmp_path: Path):
    server = ContractServer("--profile", "0.5.15")
    engine = SGLangEngine([server.url], startup_timeout_s=20)
    pub = publisher(tmp_path, transport="disk")
    try:
        plan, tensors, _, got = sync(pub, engine, version=6)
        assert_holds(server, tensors, empty_sent=True)  # SGLang reads whole safetensors files
        ((path, body),) = weight_calls(server)
        assert path == "/update_weights_from_disk"
        assert body == {
            "model_path": plan.disk_path,
            "weight_version": "6",
            "flush_cache": False,
            "abort_all_requests": False,
        }
        assert [e["path"] for e in server.log()][-3:] == [
            "/update_weights_from_disk",
            "/flush_cache",
            "/continue_generation",
        ]
        assert json.loads((Path(plan.disk_path) / "manifest.json").read_text())["version"] == 6
        assert got.version == 6 and engine.generate([[1]], SamplingSpec(max_new_tokens=1))[0].weight_version == 6
    finally:
        pub.close()
        engine.close()
        server.stop()


@pytest.mark.gpu
@pytest.mark.parametrize("load_format", ["tensor", "flattened_bucket"])
def test_sglang_contract_nccl_handshake_on_two_gpus(tmp_path: Path, load_format: str):
    """The same handshake over NCCL: the trainer on cuda:0, the receiver (SGLang's join and receive) on cuda:1.
    NCCL refuses two ranks of one communicator on one GPU, so this needs two; it has not run here yet."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (NCCL refuses two ranks on one GPU)")
    torch.cuda.set_device(0)
    server = ContractServer("--profile", "0.5.23", "--device", "cuda:1")
    engine = SGLangEngine([server.url], weight_load_format=load_format, startup_timeout_s=20)
    pub = publisher(tmp_path, transport="nccl")
    try:
        for version in (1, 2):
            _, tensors, _, got = sync(pub, engine, version=version)
            assert_holds(server, tensors)
            assert got.version == version
        inits = [b for p, b in weight_calls(server) if p == "/init_weights_update_group"]
        assert len(inits) == 1 and inits[0]["backend"] == "nccl"
    finally:
        pub.close()
        engine.close()
        server.stop()

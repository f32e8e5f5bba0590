"""The trainer as a real gRPC server process: 2 ranks under torchrun against 1 rank, kill -9 and resume.

Each server is started the way `tandem run` starts it (`python -m services.cli trainer CONFIG`); with
trainer.num_ranks: 2 that re-runs itself under torchrun, rank 0 serving gRPC and relaying to rank 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch
from conftest_trainer import TrainerHarness, make_batch, tiny_model_dir, trainer_config  # noqa: F401

from services.buffer.stream import RolloutBuffer, connect, stream_key
from services.contracts.config import TandemConfig
from services.contracts.config_loading import config_from_dict, dump_config
from services.contracts.gen.tandem.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.contracts.trainer_calls import TrainRequest
from services.rpc.grpc_util import open_channel, wait_healthy
from services.rpc.ports import free_port

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[1]


class TrainerProcess:
    def __init__(self, config: TandemConfig, *, run_dir: Path, name: str):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.config = config
        config_file = run_dir / f"{name}.yaml"
        config_file.write_text(dump_config(config))
        self.log_path = run_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.cli",
                    "trainer",
                    str(config_file),
                    "--run-dir",
                    str(run_dir),
                    "--role",
                    "actor",
                ],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.target = config.services.trainer.target
        wait_healthy(
            self.target,
            timeout_s=180,
            should_abort=lambda: (
                None
                if self.proc.poll() is None
                else f"trainer exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
            ),
        )
        self.channel = open_channel(self.target)
        self.stub = trainer_pb2_grpc.TrainerStub(self.channel)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        """SIGTERM to the service process (as the supervisor does), SIGKILL to its whole process group."""
        self.channel.close()
        if self.proc.poll() is None:
            if sig == signal.SIGKILL:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # leave no rank behind
            self.proc.wait()
            raise

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False


def _config(
    model_dir: Path,
    run_dir: Path,
    redis_url: str,
    *,
    run_name: str,
    port: int,
    algorithm: dict | None = None,
    **trainer,
) -> TandemConfig:
    base = trainer_config(
        model_dir=model_dir,
        run_dir=run_dir,
        redis_url=redis_url,
        run_name=run_name,
        trainer={"micro_batch_tokens": 40, "lr": 3e-3, **trainer},
        algorithm=algorithm,
    )
    data = base.model_dump(mode="json")
    data["services"]["trainer"]["port"] = port
    data["weights"].update(transport="gloo", timeout_s=60.0)
    return config_from_dict(data, source="test")


def _producer(config: TandemConfig) -> RolloutBuffer:
    assert config.redis.url is not None
    return RolloutBuffer(
        connect(config.redis.url),
        stream_key(config.redis.stream_prefix, config.run_name),
        groups=("actor",),
        max_buffered_batches=64,
    )


def _sync_to_engine(stub, model_dir: Path, *, version: int, by_bucket: bool = False) -> dict[str, torch.Tensor]:
    """PrepareWeightSync + PublishWeights over gRPC into a fresh HF model: gloo transport, the receiving
    engine rank in this process, verified per tensor or (by_bucket) per bucket. Returns the received params."""
    from transformers import AutoModelForCausalLM

    from services.weights import WeightReceiver

    params = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    plan = stub.PrepareWeightSync(
        trainer_pb2.PrepareWeightSyncRequest(
            version=version, engine_world_size=1, verify=True, verify_by_bucket=by_bucket
        ),
        timeout=60,
    )
    receiver = WeightReceiver()
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(stats=receiver.receive(plan, 1, params)))
    thread.start()
    stub.PublishWeights(trainer_pb2.PublishWeightsRequest(version=version), timeout=60)
    thread.join(60)
    receiver.close()
    if by_bucket:  # the engine compared every bucket with the trainer's and answers its own
        assert got["stats"].bucket_checksums == tuple(b.checksum for b in plan.buckets) and plan.checksum_s > 0
    else:
        assert got["stats"].checksums == {m.name: m.checksum for b in plan.buckets for m in b.tensors}
    return {n: p.detach() for n, p in params.items()}


def test_two_ranks_zero3_under_torchrun_over_grpc_match_one_rank(tiny_model_dir, tmp_path, redis_server):  # noqa: F811
    torch.set_num_threads(1)
    batches = [make_batch(rollout_id=i, seed=10 + i, groups=4, model_dir=tiny_model_dir) for i in range(3)]
    one = _config(tiny_model_dir, tmp_path / "one", redis_server.url, run_name="one", port=free_port(), zero_stage=3)
    reference = TrainerHarness(one, run_dir=tmp_path / "one")
    try:
        expected = [
            reference.service.train(TrainRequest(rollout_id=i, entry_ids=(reference.put(b),)))
            for i, b in enumerate(batches)
        ]
        expected_weights = {n: t.clone() for n, t in reference.service.iter_named_weights()}
    finally:
        reference.close()

    two = _config(
        tiny_model_dir, tmp_path / "two", redis_server.url, run_name="two", port=free_port(), zero_stage=3, num_ranks=2
    )
    server = TrainerProcess(two, run_dir=tmp_path / "two", name="trainer")
    try:
        state = server.stub.GetState(common_pb2.Empty(), timeout=10)
        assert state.world_size == 2 and state.zero_stage == 3
        producer = _producer(two)
        for i, b in enumerate(batches):
            got = server.stub.Train(
                trainer_pb2.TrainRequest(rollout_id=i, entry_ids=[producer.put(b)], max_staleness=-1), timeout=120
            )
            for key in ("loss", "pg_loss", "grad_norm", "entropy", "ppo_ratio_mean", "pg_clipfrac", "tokens"):
                assert got.metrics[key] == pytest.approx(expected[i].metrics[key], rel=1e-4, abs=1e-6), key
        weights = _sync_to_engine(server.stub, tiny_model_dir, version=1, by_bucket=True)  # relayed to rank 1
        assert weights.keys() == expected_weights.keys()
        # Adam's normalisation magnifies float-order differences on near-zero gradients: bound them in
        # absolute terms, well below what training moved (lr 3e-3 x 3 steps)
        for name, t in expected_weights.items():
            torch.testing.assert_close(weights[name], t, rtol=1e-3, atol=1e-4)
        saved = server.stub.Save(trainer_pb2.SaveRequest(rollout_id=2), timeout=60)
        shards = sorted(p.name for p in (Path(saved.path) / "ds").iterdir())
        assert sum("optim_states" in s for s in shards) == 2, shards  # one ZeRO shard per rank
        assert "TANDEM_READY trainer" in server.log()
        rc = server.stop()
        assert rc == 0, server.log()[-3000:]
        assert not server.group_alive()  # torchrun and both ranks are gone
    finally:
        server.stop(signal.SIGKILL)


def test_keep_old_actor_under_zero3_on_two_ranks(tiny_model_dir, tmp_path, redis_server):  # noqa: F811
    """Both ranks snapshot the published weights (a gather: a collective under ZeRO-3) and score with the old
    actor in lockstep; a batch scored by the snapshot of v1 gives what the policy gave while it was v1."""
    torch.set_num_threads(1)
    config = _config(
        tiny_model_dir,
        tmp_path,
        redis_server.url,
        run_name="old-actor",
        port=free_port(),
        zero_stage=3,
        num_ranks=2,
        algorithm={"use_rollout_logprobs": False, "keep_old_actor": True, "use_tis": True},
    )
    server = TrainerProcess(config, run_dir=tmp_path, name="trainer")
    try:
        producer = _producer(config)

        def train(rollout_id: int, batch) -> dict[str, float]:
            request = trainer_pb2.TrainRequest(rollout_id=rollout_id, entry_ids=[producer.put(batch)], max_staleness=-1)
            return dict(server.stub.Train(request, timeout=120).metrics)

        train(0, make_batch(rollout_id=0, seed=20, groups=4, model_dir=tiny_model_dir))
        prepare = trainer_pb2.PrepareWeightSyncRequest(version=1, transport="disk", engine_world_size=1)
        server.stub.PrepareWeightSync(prepare, timeout=60)
        server.stub.PublishWeights(trainer_pb2.PublishWeightsRequest(version=1), timeout=60)
        of_v1 = make_batch(rollout_id=1, seed=21, groups=4, model_dir=tiny_model_dir, sample_versions=[1] * 16)
        current = train(1, of_v1)  # the policy is still v1: scored by itself
        snapshot = train(2, of_v1)  # one update later: scored by the v1 snapshot
        assert snapshot["old_actor_fallback_frac"] == 0.0 and snapshot["rollout_logprob_abs_diff"] > 0
        for key in ("rollout_logprob_abs_diff", "tis_weight_mean"):
            assert snapshot[key] == pytest.approx(current[key], rel=1e-5), key
        assert server.stop() == 0, server.log()[-3000:]
    finally:
        server.stop(signal.SIGKILL)


def test_kill_9_then_restart_resumes_exactly(tiny_model_dir, tmp_path, redis_server):  # noqa: F811
    batches = [make_batch(rollout_id=i, seed=20 + i, model_dir=tiny_model_dir) for i in range(3)]
    cfg = _config(
        tiny_model_dir, tmp_path, redis_server.url, run_name="crash", port=free_port(), zero_stage=1, warmup_steps=3
    )
    producer = _producer(cfg)
    server = TrainerProcess(cfg, run_dir=tmp_path, name="first")
    try:
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Train(trainer_pb2.TrainRequest(rollout_id=0), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty batch" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Train(trainer_pb2.TrainRequest(rollout_id=0, entry_ids=["1-0"]), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        for i in range(2):
            server.stub.Train(trainer_pb2.TrainRequest(rollout_id=i, entry_ids=[producer.put(batches[i])]), timeout=60)
        server.stub.Save(trainer_pb2.SaveRequest(rollout_id=1, extra_state={"coordinator": "{}"}), timeout=60)
        expected = server.stub.Train(
            trainer_pb2.TrainRequest(rollout_id=2, entry_ids=[producer.put(batches[2])]), timeout=60
        )
    finally:
        server.stop(signal.SIGKILL)

    server = TrainerProcess(cfg, run_dir=tmp_path, name="second")
    try:
        loaded = server.stub.Load(trainer_pb2.LoadRequest(), timeout=60)
        assert loaded.loaded and loaded.rollout_id == 1 and loaded.step == 2
        retry = server.stub.Train(trainer_pb2.TrainRequest(rollout_id=1, entry_ids=["ignored-0"]), timeout=60)
        assert retry.replayed and retry.step == 2
        again = server.stub.Train(
            trainer_pb2.TrainRequest(rollout_id=2, entry_ids=[producer.put(batches[2])]), timeout=60
        )
        assert not again.replayed and again.step == expected.step == 3
        for key in ("loss", "grad_norm", "lr", "entropy"):
            assert again.metrics[key] == expected.metrics[key], key
        assert producer.client.xlen(producer.stream) == 0  # every entry acknowledged and deleted
    finally:
        assert server.stop() == 0


def test_lora_two_ranks_zero3_over_grpc_match_one_rank(tiny_model_dir, tmp_path, redis_server):  # noqa: F811
    """trainer.lora under ZeRO-3 on 2 ranks: the base weights and the adapters are partitioned, so the merged weight
    sync and the adapter export gather across ranks; the steps match one rank's, the engine receives W + s·B·A
    (peft's own merge of the exported adapter), and the KL reference is the model with its adapters off."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    lora = {"zero_stage": 3, "lora": {"rank": 4}}
    algorithm = {"kl_coef": 0.05}
    batches = [make_batch(rollout_id=i, seed=40 + i, groups=4, model_dir=tiny_model_dir) for i in range(2)]
    one = _config(
        tiny_model_dir,
        tmp_path / "one",
        redis_server.url,
        run_name="lora-one",
        port=free_port(),
        algorithm=algorithm,
        **lora,
    )
    reference = TrainerHarness(one, run_dir=tmp_path / "one")
    try:
        expected = [
            reference.service.train(TrainRequest(rollout_id=i, entry_ids=(reference.put(b),)))
            for i, b in enumerate(batches)
        ]
    finally:
        reference.close()
    two = _config(
        tiny_model_dir,
        tmp_path / "two",
        redis_server.url,
        run_name="lora-two",
        port=free_port(),
        algorithm=algorithm,
        num_ranks=2,
        **lora,
    )
    server = TrainerProcess(two, run_dir=tmp_path / "two", name="trainer")
    try:
        producer = _producer(two)
        for i, b in enumerate(batches):
            got = server.stub.Train(
                trainer_pb2.TrainRequest(rollout_id=i, entry_ids=[producer.put(b)], max_staleness=-1), timeout=120
            )
            for key in ("loss", "pg_loss", "kl", "grad_norm", "entropy", "ppo_ratio_mean"):
                assert got.metrics[key] == pytest.approx(expected[i].metrics[key], rel=1e-4, abs=1e-6), key
        weights = _sync_to_engine(server.stub, tiny_model_dir, version=1)
        saved = server.stub.Save(trainer_pb2.SaveRequest(rollout_id=1, export_hf=True), timeout=60)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, str(Path(saved.hf_path) / "adapter")).merge_and_unload()
        exported = AutoModelForCausalLM.from_pretrained(saved.hf_path, dtype=torch.float32)
        assert list(weights) == [n for n, _ in merged.named_parameters()]
        for (name, p), (_, q) in zip(merged.named_parameters(), exported.named_parameters(), strict=True):
            torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=1e-6)
            assert torch.equal(weights[name], q.detach()), name
        assert server.stop() == 0, server.log()[-3000:]
    finally:
        server.stop(signal.SIGKILL)

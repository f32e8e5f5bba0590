"""Weight sync between a real trainer process and a real rollout process over gloo, sequenced by the
coordinator's state machine: bit-identical tensors, and the engine generates with the new version."""

import subprocess
import sys

import pytest
from tandem_runs import EXAMPLE, REPO

from services.buffer.stream import RolloutBuffer, connect
from services.contracts.config_loading import load_config, write_resolved_config
from services.contracts.rollout_calls import GenerateRequest, GenerateResult, PromptInput
from services.contracts.trainer_calls import TrainRequest
from services.coordinator.clients import make_clients
from services.coordinator.pool import RolloutPool
from services.coordinator.sync import WeightSync, WeightSyncFailed
from services.launcher.supervisor import resolve_for_local_run

pytestmark = pytest.mark.slow


@pytest.fixture
def services(tmp_path, redis_server):
    config = load_config(EXAMPLE, ["weights.check_weight_update_equal=true", "weights.timeout_s=20"])
    config = resolve_for_local_run(config, redis_url=redis_server.url)
    config = config.model_copy(update={"run_name": f"sync-{tmp_path.name}"})
    write_resolved_config(config, tmp_path)
    procs = []
    for args in (["trainer", "--role", "actor"], ["rollout", "--replica", "0"]):
        with open(tmp_path / f"{args[0]}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "services.cli",
                        args[0],
                        str(tmp_path / "config.yaml"),
                        "--run-dir",
                        str(tmp_path),
                        *args[1:],
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                )
            )
    trainer, _, rollouts = make_clients(config)
    for client in (trainer, *rollouts):
        client.wait_healthy(120)
    pool = RolloutPool(rollouts)
    yield config, trainer, pool, procs
    pool.close()
    trainer.close()
    for p in procs:
        p.terminate()
        p.wait(timeout=30)


def _generate(pool: RolloutPool, *, rollout_id: int, stream: str) -> GenerateResult:
    prompts = tuple(PromptInput(text="3 5 =", label="5", group_id=i) for i in range(4))
    return pool.replicas[0].generate(
        GenerateRequest(rollout_id=rollout_id, prompts=prompts, n_samples_per_prompt=2, stream=stream)
    )


def test_trained_weights_arrive_bit_identical_and_samples_carry_the_version(services, redis_server):
    config, trainer, pool, _ = services
    sync = WeightSync(trainer=trainer, pool=pool, config=config.weights)
    first = sync.run(version=0)
    assert first.verified_tensors > 0 and first.bytes > 0

    # train one step on a real batch so the weights really change, then sync version 1 and check every tensor
    reply = _generate(pool, rollout_id=0, stream="")
    trained = trainer.train(TrainRequest(rollout_id=0, entry_ids=(reply.entry_id,)))
    assert trained.samples_trained == 8
    second = sync.run(version=1)
    assert second.verified_tensors == first.verified_tensors  # every tensor's checksum matched the trainer's
    state = pool.replicas[0].get_state()
    assert state.weight_version == 1

    stream = f"test:{config.run_name}:probe"
    reply = _generate(pool, rollout_id=1, stream=stream)
    assert reply.weight_version == 1
    consumer = RolloutBuffer(connect(redis_server.url), stream, groups=("actor",), group="actor")
    [entry] = consumer.read([reply.entry_id], timeout_s=10)
    assert entry.batch.sample_versions.tolist() == [1] * 8
    assert entry.policy_version == 1


def test_sync_against_a_dead_engine_fails_within_the_deadline(services):
    config, trainer, pool, procs = services
    procs[1].kill()
    procs[1].wait()
    sync = WeightSync(trainer=trainer, pool=pool, config=config.weights)
    with pytest.raises(WeightSyncFailed, match="phase prepare"):
        sync.run(version=0)

"""The rollout gRPC server as its own process (`python -m services.cli rollout ...`) against a real
redis-server: Generate lands a decodable batch, Evaluate, bad input gives clear statuses and the server
keeps serving, traces cross into the Redis entry, and start-up failures exit non-zero with one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml

from services.buffer.stream import RolloutBuffer, connect
from services.contracts.files import read_json_rows
from services.contracts.gen.tandem.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.modelinit.init_model import init_model
from services.rollout.tokenizer import load_tokenizer
from services.rpc.grpc_util import open_channel, wait_healthy

REPO_ROOT = Path(__file__).resolve().parents[1]
STREAM = "tandem:srv-test:rollouts"


def write_config(path: Path, *, model: Path, redis_url: str, **rollout) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "run_name": "srv-test",
                "model": {"path": str(model)},
                "data": {"train_path": "unused.jsonl"},
                "rollout": {
                    "device": "cpu",
                    "n_samples_per_prompt": 4,
                    "reward": "digit_task",
                    "sampling": {"max_new_tokens": 3, "seed": 1},
                    **rollout,
                },
                "redis": {"url": redis_url},
                "tracing": {"exporter": "file"},
                "loop": {"step_timeout_s": 30},
            }
        )
    )
    return path


def start_rollout(config: Path, run_dir: Path, *extra: str, stderr=subprocess.PIPE) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "rollout",
            str(config),
            "--replica",
            "0",
            "--run-dir",
            str(run_dir),
            *extra,
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("m") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, redis_server):
    tmp = tmp_path_factory.mktemp("srv")
    # a file, not a pipe: a full pipe would block the server's logging; closed when the fixture ends
    log = open(tmp / "stderr.log", "w")  # noqa: SIM115
    proc = start_rollout(
        write_config(tmp / "c.yaml", model=model_dir, redis_url=redis_server.url), tmp / "run", stderr=log
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the server prints TANDEM_READY once its port is bound
    if not line.startswith("TANDEM_READY rollout "):
        proc.kill()
        pytest.fail(f"rollout server did not start: {line!r} {(tmp / 'stderr.log').read_text()[-3000:]}")
    target = f"127.0.0.1:{int(line.split()[-1])}"
    wait_healthy(target, timeout_s=30)
    channel = open_channel(target)
    yield {"stub": rollout_pb2_grpc.RolloutStub(channel), "target": target, "proc": proc, "run_dir": tmp / "run"}
    channel.close()
    proc.terminate()
    assert proc.wait(timeout=30) == 0  # SIGTERM is a graceful stop
    log.close()


def prompt(text: str, label: str, group_id: int) -> common_pb2.Prompt:
    return common_pb2.Prompt(text=text, label=label, group_id=group_id)


def read_entry(url: str, entry_id: str):
    buf = RolloutBuffer(connect(url), STREAM, groups=("actor",), group="actor", consumer="actor-0")
    entry = buf.read([entry_id], timeout_s=10)[0]
    buf.ack([entry_id])
    return entry


def test_generate_lands_a_decodable_batch_in_redis(server, redis_server, model_dir: Path):
    prompts = [prompt("3 7 =", "7", 40), prompt("9 2 =", "9", 41), prompt("0 0 =", "0", 42)]
    reply = server["stub"].Generate(rollout_pb2.GenerateRequest(rollout_id=3, prompts=prompts), timeout=60)
    assert reply.entry_id and reply.num_samples == 12 and reply.producer == "rollout-0"
    assert reply.weight_version == 0 and reply.generate_time_s > 0 and reply.put_time_s > 0
    assert {"reward_mean", "reward_std", "response_len_mean", "finish_stop_frac"} <= set(reply.metrics)
    entry = read_entry(redis_server.url, reply.entry_id)
    batch, tok = entry.batch, load_tokenizer(model_dir)
    assert entry.rollout_id == 3 and batch.num_samples == 12
    assert batch.group_ids.tolist() == [40] * 4 + [41] * 4 + [42] * 4
    assert list(batch.labels) == ["7"] * 4 + ["9"] * 4 + ["0"] * 4
    assert reply.num_response_tokens == batch.num_response_tokens == len(batch.rollout_log_probs)
    for i, (p_sl, r_sl, _) in enumerate(batch.sample_slices()):
        assert tok.decode(batch.tokens[p_sl].tolist(), skip_special_tokens=True) == prompts[i // 4].text
        response = tok.decode(batch.tokens[r_sl].tolist(), skip_special_tokens=True)
        assert isinstance(response, str)
        assert batch.rewards[i] == float(response.split() == [prompts[i // 4].label])
    assert reply.metrics["reward_mean"] == pytest.approx(float(batch.rewards.mean()))
    assert entry.trace_context.get("traceparent")  # the rl.sample span, for the trainer to link to


def test_evaluate(server):
    prompts = [prompt(f"{a} {b} =", str(max(a, b)), a * 10 + b) for a in range(3) for b in range(3)]
    greedy = rollout_pb2.EvaluateRequest(
        name="digits",
        prompts=prompts,
        n_samples_per_prompt=1,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=2),
    )
    reply = server["stub"].Evaluate(greedy, timeout=60)
    assert reply.metrics["digits/num_prompts"] == 9
    assert reply.metrics["digits/pass@1"] == pytest.approx(reply.metrics["digits/reward_mean"])
    sampled = rollout_pb2.EvaluateRequest(
        name="s",
        prompts=prompts,
        n_samples_per_prompt=4,
        reward="exact_match",
        sampling=common_pb2.SamplingParams(temperature=1.0, seed=5),
    )
    m = server["stub"].Evaluate(sampled, timeout=60).metrics
    assert m["s/pass@1"] <= m["s/pass@2"] <= m["s/pass@4"] and m["s/num_samples"] == 36


@pytest.mark.parametrize(
    "request_,code,fragment",
    [
        (rollout_pb2.GenerateRequest(rollout_id=1), grpc.StatusCode.INVALID_ARGUMENT, "no prompts given"),
        (
            rollout_pb2.GenerateRequest(rollout_id=1, prompts=[prompt("1 " * 300, "1", 0)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt 0 has 301 tokens; the model's context holds 128",
        ),
        (
            rollout_pb2.GenerateRequest(rollout_id=1, prompts=[prompt("1 2 =", "2", 0)], reward="nope_mod_zz:f"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "module 'nope_mod_zz' not found",
        ),
        (
            rollout_pb2.GenerateRequest(
                rollout_id=1,
                prompts=[prompt("1 2 =", "2", 0)],
                sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.5),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p",
        ),
        (
            rollout_pb2.GenerateRequest(
                rollout_id=1,
                prompts=[prompt("1 2 =", "2", 0)],
                sampling=common_pb2.SamplingParams(temperature=1.0, stop=["=", ""]),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.stop [1] is empty",
        ),
        (
            rollout_pb2.GenerateRequest(
                rollout_id=1,
                prompts=[prompt("1 2 =", "2", 0), prompt("3 7 =", "7", 1)],
                reward="tests/helpers/bad_rewards.py:raises_on_seven",
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "bad_rewards.py:raises_on_seven raised ZeroDivisionError on sample 4",
        ),
        (
            rollout_pb2.GenerateRequest(
                rollout_id=1, prompts=[prompt("1 2 =", "2", 0)], reward="tests/helpers/bad_rewards.py:numeric_text"
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "bad_rewards.py:numeric_text returned the str '1.0' for sample 0; expected a number",
        ),
        (rollout_pb2.EvaluateRequest(name="e"), grpc.StatusCode.INVALID_ARGUMENT, "no prompts given"),
        (rollout_pb2.MemoryRequest(tags=["gpu_magic"]), grpc.StatusCode.INVALID_ARGUMENT, "unknown memory tag"),
        (rollout_pb2.PauseRequest(mode="sideways"), grpc.StatusCode.INVALID_ARGUMENT, "unknown pause mode"),
    ],
    ids=[
        "empty",
        "too-long",
        "bad-reward",
        "bad-sampling",
        "empty-stop-string",
        "reward-raises",
        "reward-text",
        "eval-empty",
        "bad-tag",
        "bad-pause",
    ],
)
def test_bad_input_gives_a_clear_status_and_the_server_keeps_serving(server, request_, code, fragment: str):
    stub = server["stub"]
    method = {
        rollout_pb2.GenerateRequest: stub.Generate,
        rollout_pb2.EvaluateRequest: stub.Evaluate,
        rollout_pb2.MemoryRequest: stub.ReleaseMemory,
        rollout_pb2.PauseRequest: stub.Pause,
    }[type(request_)]
    with pytest.raises(grpc.RpcError) as info:
        method(request_, timeout=30)
    assert info.value.code() == code and fragment in info.value.details()
    wait_healthy(server["target"], timeout_s=5)
    state = stub.GetState(common_pb2.Empty(), timeout=10)
    assert not state.paused and not state.memory_released


def test_pause_holds_generate_and_a_gone_caller_leaves_no_batch(server, redis_server, redis_client):
    stub = server["stub"]
    before = redis_client.xlen(STREAM)
    stub.Pause(rollout_pb2.PauseRequest(mode="drain"), timeout=10)
    assert stub.GetState(common_pb2.Empty(), timeout=10).paused
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(rollout_pb2.GenerateRequest(rollout_id=50, prompts=[prompt("1 2 =", "2", 0)]), timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stub.Resume(common_pb2.Empty(), timeout=10)
    reply = stub.Generate(rollout_pb2.GenerateRequest(rollout_id=51, prompts=[prompt("1 2 =", "2", 0)]), timeout=30)
    deadline = time.monotonic() + 20  # the abandoned call runs after Resume, sees its caller gone, writes nothing
    while stub.GetState(common_pb2.Empty(), timeout=10).in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert redis_client.xlen(STREAM) == before + 1
    assert read_entry(redis_server.url, reply.entry_id).rollout_id == 51
    state = stub.GetState(common_pb2.Empty(), timeout=10)
    assert state.engine == "native" and state.producer == "rollout-0" and state.in_flight == 0


def test_generate_with_released_memory_is_a_failed_precondition(server):
    stub = server["stub"]
    stub.ReleaseMemory(rollout_pb2.MemoryRequest(tags=["kv_cache"]), timeout=10)
    assert stub.GetState(common_pb2.Empty(), timeout=10).memory_released
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(rollout_pb2.GenerateRequest(rollout_id=60, prompts=[prompt("1 2 =", "2", 0)]), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "ResumeMemory" in info.value.details()
    stub.ResumeMemory(rollout_pb2.MemoryRequest(tags=["kv_cache"]), timeout=10)
    reply = stub.Generate(rollout_pb2.GenerateRequest(rollout_id=60, prompts=[prompt("1 2 =", "2", 0)]), timeout=30)
    assert reply.num_samples == 4 and not stub.GetState(common_pb2.Empty(), timeout=10).memory_released


def test_traces_link_sample_and_reward_spans(server):
    stub = server["stub"]
    stub.Generate(rollout_pb2.GenerateRequest(rollout_id=77, prompts=[prompt("5 5 =", "5", 1)]), timeout=30)
    path = server["run_dir"] / "traces.jsonl"
    deadline = time.monotonic() + 10
    spans: list[dict] = []
    while time.monotonic() < deadline:
        spans = read_json_rows(path) if path.exists() else []  # the server may be appending a span as we read
        if any(s["name"] == "rl.sample" and s["attributes"].get("rl.rollout_id") == 77 for s in spans):
            break
        time.sleep(0.1)
    sample = next(s for s in spans if s["name"] == "rl.sample" and s["attributes"].get("rl.rollout_id") == 77)
    reward = next(s for s in spans if s["name"] == "rl.reward" and s["attributes"].get("rl.rollout_id") == 77)
    assert reward["parent_span_id"] == sample["span_id"] and reward["trace_id"] == sample["trace_id"]
    assert sample["attributes"]["rl.tokens"] > 0 and sample["attributes"]["rl.weight_version"] == 0


def _failed_start(tmp_path: Path, config: Path, *extra: str) -> tuple[int, str]:
    proc = start_rollout(config, tmp_path / "run", *extra)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err.strip()


def test_missing_model_directory_fails_start_with_one_line(tmp_path: Path, redis_server):
    config = write_config(tmp_path / "c.yaml", model=tmp_path / "no-such-model", redis_url=redis_server.url)
    code, err = _failed_start(tmp_path, config)
    assert code == 2 and len(err.splitlines()) == 1
    assert "model.path" in err and "does not exist" in err and "tandem init-model" in err


def test_unknown_reward_and_bad_replica_fail_start(tmp_path: Path, model_dir: Path, redis_server):
    config = write_config(tmp_path / "c.yaml", model=model_dir, redis_url=redis_server.url, reward="nowhere_zz:f")
    code, err = _failed_start(tmp_path, config)
    assert code == 2 and "rollout.reward" in err and "module 'nowhere_zz' not found" in err
    ok = write_config(tmp_path / "ok.yaml", model=model_dir, redis_url=redis_server.url)
    code, err = _failed_start(tmp_path, ok, "--replica", "3")  # the last --replica wins
    assert code == 2 and "--replica 3 is out of range" in err

"""What a user sees across a run's life: the final checkpoint and HF export, a rerun of a finished run, a
resume after a crash that logs no step twice, finding the control API of a local run, and inputs checked
before any service starts. Real `tandem run`s (every service a process, a real redis-server)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tandem_runs import (
    EXAMPLE,
    REPO,
    checkpoints,
    children_of,
    coordinator_target,
    metrics,
    start_run,
    supervisor_log,
    wait_status,
)

from services.contracts.gen.tandem.v1 import common_pb2


def step_ids(run_dir: Path) -> list[int]:
    return [r["rollout_id"] for r in metrics(run_dir) if "perf/step_time_s" in r]


def _wait(predicate, *, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def tandem(*args: str, cwd: Path = REPO, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout_s
    )


@pytest.mark.slow
def test_a_run_crashes_resumes_finishes_and_a_rerun_says_it_is_done(tmp_path):
    """One run's whole life: ctl finds it and asks for a checkpoint, it crashes two steps later (kill -9 of
    every process), resumes from that checkpoint without logging a step twice, ends with a final checkpoint and HF
    export, and a rerun of the finished run says so without starting anything."""
    run_dir = tmp_path / "runs" / "mine"
    run_dir.mkdir(parents=True)
    # save_interval null: no periodic or epoch-end checkpoint, so ctl's is the only one before the crash
    proc = start_run(run_dir, "loop.num_rollout=100000", "loop.save_interval=null", "loop.eval_interval=null")
    try:
        target = coordinator_target(run_dir)
        wait_status(target, lambda s: s.state == "running", what="running")
        assert f"coordinator control API: {target}" in supervisor_log(run_dir)
        by_dir = tandem("ctl", "--run-dir", str(run_dir), "status")
        assert by_dir.returncode == 0, by_dir.stderr
        assert json.loads(by_dir.stdout)["run_dir"] == str(run_dir.resolve())
        found = tandem("ctl", "status", cwd=tmp_path)  # no --addr, no --run-dir: ./runs/mine is running
        assert found.returncode == 0, found.stderr
        assert json.loads(found.stdout)["run_dir"] == str(run_dir.resolve())
        asked = tandem("ctl", "--run-dir", str(run_dir), "save")  # the only checkpoint before the crash
        assert asked.returncode == 0, asked.stderr
        _wait(lambda: checkpoints(run_dir), what="the checkpoint `ctl save` asked for")
        at = int(checkpoints(run_dir)[0].name.split("_")[1])
        _wait(lambda: (step_ids(run_dir) or [-1])[-1] >= at + 2, what="two steps logged after the checkpoint")
    finally:
        for pid in [proc.pid, *children_of(proc.pid)]:  # a crash: nobody gets to save or clean up
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    crashed = step_ids(run_dir)
    saved = int(checkpoints(run_dir)[-1].name.split("_")[1])
    assert crashed[-1] > saved, (crashed, saved)  # steps after the checkpoint were logged, then lost

    num_rollout = crashed[-1] + 3
    proc = start_run(run_dir, f"loop.num_rollout={num_rollout}", "loop.save_interval=null", "loop.eval_interval=null")
    assert proc.wait(timeout=300) == 0, supervisor_log(run_dir)
    assert step_ids(run_dir) == list(range(num_rollout))
    assert "dropped" in (run_dir / "logs" / "coordinator.log").read_text()
    final = checkpoints(run_dir)[-1]
    assert final.name == f"rollout_{num_rollout - 1:08d}"  # not on save_interval: the final one
    assert (final / "hf" / "config.json").is_file() and list((final / "hf").glob("*.safetensors"))
    assert f"last checkpoint: {final} (Hugging Face model: {final / 'hf'})" in supervisor_log(run_dir)
    assert not (run_dir / "run.json").exists()  # the marker ctl discovers lives only while the run does

    before = (run_dir / "metrics.jsonl").read_bytes()
    again = tandem("run", str(EXAMPLE), "--run-dir", str(run_dir), "--set", f"loop.num_rollout={num_rollout}")
    assert again.returncode == 0, again.stderr
    assert f"this run already finished: {num_rollout} of {num_rollout} rollouts trained" in again.stderr
    assert "raise loop.num_rollout" in again.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == before
    nothing = tandem("ctl", "--timeout", "3", "status", cwd=tmp_path)  # nothing runs: the default address
    assert nothing.returncode == 1
    assert "127.0.0.1:50051" in nothing.stderr and "--run-dir" in nothing.stderr


def test_ctl_discovery_ignores_dead_runs_and_refuses_to_guess_between_two(tmp_path):
    from services.contracts.config import ConfigError
    from services.coordinator.ctl import find_coordinator

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name, pid, port in (("old", dead.pid, 41001), ("live", os.getpid(), 41002)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps({"pid": pid, "coordinator": f"127.0.0.1:{port}"}))
        (tmp_path / name / "config.yaml").write_text(
            EXAMPLE.read_text().replace(
                "run_name: digit_max", f"run_name: {name}\nservices:\n  coordinator: {{port: {port}}}"
            )
        )
    target = find_coordinator(addr=None, run_dir=None, token=None, tls_ca=None, runs_root=tmp_path)
    assert target.addr == "127.0.0.1:41002"
    (tmp_path / "old" / "run.json").write_text(json.dumps({"pid": os.getppid()}))  # a second live run
    with pytest.raises(ConfigError, match=r"2 runs are running .*--run-dir"):
        find_coordinator(addr=None, run_dir=None, token=None, tls_ca=None, runs_root=tmp_path)
    assert find_coordinator(addr="h:9", run_dir=None, token="t", tls_ca=None, runs_root=tmp_path).addr == "h:9"
    with pytest.raises(ConfigError, match="not a run directory"):
        find_coordinator(addr=None, run_dir=tmp_path, token=None, tls_ca=None)


def test_ctl_help_describes_every_action():
    out = tandem("ctl", "--help")
    assert out.returncode == 0
    for action in ("status", "save", "eval", "pause", "resume", "stop", "watch"):
        assert f"\n  {action} " in out.stdout, action
    assert "--run-dir" in out.stdout


# ---- inputs checked before any service starts ---------------------------------------------------------


def _config(tmp_path: Path, **replace: str) -> Path:
    """examples/digit_max.yaml copied next to the test's files (its relative paths made absolute first)."""
    text = EXAMPLE.read_text()
    for key, value in {
        "path: models/tiny": f"path: {REPO / 'examples' / 'models' / 'tiny'}",
        "train_path: digit_max/train.jsonl": f"train_path: {REPO / 'examples/digit_max/train.jsonl'}",
        "eval_path: digit_max/eval.jsonl": f"eval_path: {REPO / 'examples/digit_max/eval.jsonl'}",
        **replace,
    }.items():
        assert key in text, key
        text = text.replace(key, value)
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_a_missing_data_file_fails_in_seconds_naming_the_key(tmp_path):
    config = _config(tmp_path, **{"train_path: digit_max/train.jsonl": "train_path: nowhere/train.jsonl"})
    start = time.monotonic()
    out = tandem("run", str(config), "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 2, out.stderr
    assert f"data.train_path: data file {tmp_path / 'nowhere' / 'train.jsonl'} does not exist" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "r" / "logs").exists()  # no service was started
    assert time.monotonic() - start < 60  # (generous: a loaded CI box; it takes ~3 s)


def test_bad_eval_data_and_a_missing_reward_plugin_name_their_keys(tmp_path):
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"prompt": "1 2 =", "label": "2"}\n{"question": "no prompt key"}\n')
    config = _config(tmp_path, **{"eval_path: digit_max/eval.jsonl": f"eval_path: {bad}"})
    out = tandem("run", str(config), "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 2 and f"data.eval_path: {bad}:2: expected an object with key 'prompt'" in out.stderr
    config = _config(tmp_path, **{"reward: digit_task": "reward: plugins/score.py:score"})
    out = tandem("run", str(config), "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 2
    assert f"rollout.reward: reward '{tmp_path / 'plugins' / 'score.py'}:score': file" in out.stderr


def test_a_reward_plugin_path_is_relative_to_the_yaml_and_a_set_path_to_the_shell(tmp_path, monkeypatch):
    from services.contracts.config_loading import load_config
    from services.launcher.preflight import check_run_inputs

    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "score.py").write_text("def score(response, label):\n    return float(response == label)\n")
    config = load_config(_config(tmp_path, **{"reward: digit_task": "reward: plugins/score.py:score"}))
    assert config.rollout.reward == f"{tmp_path / 'plugins' / 'score.py'}:score"
    assert check_run_inputs(config) == []

    elsewhere = tmp_path / "shell"
    (elsewhere / "data").mkdir(parents=True)
    lines = (f'{{"prompt": "{i} 1 =", "label": "{i}"}}\n' for i in range(40))
    (elsewhere / "data" / "t.jsonl").write_text("".join(lines))
    monkeypatch.chdir(elsewhere)
    config = load_config(
        _config(tmp_path), ["data.train_path=data/t.jsonl", "rollout.reward=../plugins/score.py:score"]
    )
    assert config.data.train_path == str(elsewhere / "data" / "t.jsonl")
    assert config.rollout.reward == f"{tmp_path / 'plugins' / 'score.py'}:score"
    assert config.model.path == str(REPO / "examples" / "models" / "tiny")  # from the YAML: untouched
    assert check_run_inputs(config) == []


def test_a_mistyped_model_path_is_an_error_and_init_model_builds_only_when_asked(tmp_path):
    from services.contracts.config_loading import load_config
    from services.launcher.preflight import check_model

    (tmp_path / "models").mkdir()
    typo = tmp_path / "models" / "tinny"
    config = _config(tmp_path, **{"path: models/tiny": f"path: {typo}"})
    subprocess.run(
        [sys.executable, "-m", "services.cli", "init-model", str(tmp_path / "models" / "tiny")],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    out = tandem("run", str(config), "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 2, out.stderr
    assert f"model.path: {typo} holds no model (did you mean {tmp_path / 'models' / 'tiny'}?)" in out.stderr
    assert "--init-model" in out.stderr and not typo.exists()

    fresh = tmp_path / "models" / "new"
    check_model(load_config(config).with_model_path(str(fresh)), init_model=True)
    assert (fresh / "config.json").is_file() and (fresh / "tokenizer.json").is_file()


def test_data_the_tokenizer_cannot_encode_gives_a_warning(tmp_path):
    from services.contracts.config_loading import load_config
    from services.launcher.preflight import check_run_inputs

    data = tmp_path / "words.jsonl"
    data.write_text(
        "".join(f'{{"prompt": "{i} 2 =", "label": "{i}"}}\n' for i in range(36))
        + '{"prompt": "what is 3 + 4 ?", "label": "seven"}\n'
    )
    config = load_config(_config(tmp_path, **{"train_path: digit_max/train.jsonl": f"train_path: {data}"}))
    warnings = check_run_inputs(config)
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("data.train_path: 1 of 37 prompts hold text the tokenizer of")
    assert "'what is 3 + 4 ?'" in warnings[0] and "<unk>" in warnings[0]
    assert warnings[1].startswith("data.train_path: 1 of 37 labels") and "'seven'" in warnings[1]


def test_jsonl_metrics_rewind_drops_the_steps_trained_again(tmp_path):
    from services.telemetry.trackers import JsonlTracker

    tracker = JsonlTracker(tmp_path / "metrics.jsonl")
    tracker.log(-1, {"eval/reward_mean": 0.1})
    for step in range(5):
        tracker.log(step, {"rollout/reward_mean": step / 10})
    tracker.log(4, {"eval/reward_mean": 0.5})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"rollout_id": 5, "rollout/rew')  # torn by a crash
    tracker.rewind(next_step=3)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [-1, 0, 1, 2]
    tracker.log(3, {"rollout/reward_mean": 0.3})
    assert [json.loads(x)["rollout_id"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1] == 3
    tracker.rewind(next_step=0)  # starting over: the old pre-training eval goes too
    assert (tmp_path / "metrics.jsonl").read_text() == ""


@pytest.mark.slow
def test_the_coordinator_itself_does_not_retrain_a_finished_run(tmp_path, redis_server):
    """Without `tandem run` (compose, k8s) the coordinator makes the same check after loading the checkpoint:
    a real trainer and rollout process, the coordinator in-process, run twice over one run directory."""
    from reliability_kit import Services

    from services.coordinator.builder import build_coordinator
    from services.coordinator.loop import Coordinator

    s = Services(tmp_path, redis_server.url, ["loop.num_rollout=2", "loop.eval_interval=null"])
    try:
        first = Coordinator(build_coordinator(s.config, run_dir=tmp_path))
        first.run()
        assert first.status == "finished" and step_ids(tmp_path) == [0, 1]
        before = (tmp_path / "metrics.jsonl").read_bytes()
        again = Coordinator(build_coordinator(s.config, run_dir=tmp_path))
        again.run()
        assert again.status == "finished"
        assert (tmp_path / "metrics.jsonl").read_bytes() == before
        said = [e.message for e in again.events.watch(include_history=True)]
        assert any(m.startswith("this run already finished: 2 of 2 rollouts trained") for m in said), said
        assert s.trainer.stub.GetState(common_pb2.Empty(), timeout=30).step == 2  # no third Train
    finally:
        s.close()

"""A run that learns from the reward service alone: examples/judge (digit-max scored by a judge model on the
reward service, a separate process `tandem run` starts; the rule reward only checks the evals), with the reward
service killed (kill -9) while it scores a batch: the supervisor starts it again, the rollout asks again within
reward.max_wait_s, the run goes on and its books are exact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from reliability_kit import assert_every_sample_trained_once, replacement_pid, service_pid, wait_for, wait_running
from tandem_runs import REPO, assert_above, assert_below, metrics, start_run, stop_run, supervisor_log

pytestmark = [pytest.mark.slow, pytest.mark.reliability, pytest.mark.timeout(900)]

JUDGE_CONFIG = REPO / "examples" / "judge.yaml"
STEPS = 20


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("judge") / "judge"
    subprocess.run(
        [sys.executable, str(REPO / "examples" / "judge" / "warm_start.py"), "--out", str(out)],
        check=True,
        capture_output=True,
        cwd=REPO,
        timeout=600,
    )
    return out


def test_the_policy_learns_from_the_judge_service_through_a_kill_of_it(tmp_path, judge_model, monkeypatch):
    hold = tmp_path / "hold"
    monkeypatch.setenv("TANDEM_TEST_HOLD", str(hold))  # the reward service inherits it (tests/helpers/held_verdict.py)
    run_dir = tmp_path / "run"
    proc = start_run(
        run_dir,
        f"loop.num_rollout={STEPS}",
        f"reward.models.correct.path={judge_model}",
        f"reward.models.correct.parser={REPO}/tests/helpers/held_verdict.py:verdict",
        "reward.max_wait_s=400",
        "services.max_restarts=1",
        config=JUDGE_CONFIG,
    )
    try:
        wait_running(run_dir, rollout_id=3)
        old = service_pid(proc.pid, "reward")
        hold.touch()
        wait_for(lambda: (tmp_path / "hold.in_call").exists(), what="a Score call in flight", timeout_s=120)
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: replacement_pid(proc.pid, "reward", old=old), what="the restarted reward service")
        hold.unlink()
        assert proc.wait(timeout=600) == 0, supervisor_log(run_dir)
    finally:
        stop_run(proc)
    log = supervisor_log(run_dir)
    assert "reward exited with -9; restarting it" in log and "reward restarted" in log, log
    assert (run_dir / "logs" / "reward.log").read_text().count("TANDEM_READY reward") == 2
    assert_every_sample_trained_once(run_dir, STEPS)  # the batch in flight was scored again, not lost or doubled
    rows = metrics(run_dir)
    evals = [r for r in rows if "eval/reward_mean" in r]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["rollout_id"] for r in evals] == [-1, 9, 19] and len(steps) == STEPS
    # the evals are rule-checked (rollout.eval_reward: digit_task); training saw only the judge's verdicts
    untrained, trained = evals[0]["eval/reward_mean"], evals[-1]["eval/reward_mean"]
    assert_below("untrained greedy eval", untrained, 0.2, evals)
    assert_above("trained - untrained greedy eval", trained - untrained, 0.2, evals)
    for r in steps:
        assert r["reward/correct/mean"] == pytest.approx(r["rollout/reward_mean"])
        assert 0.0 <= r["reward/correct/parse_failure_frac"] <= 0.05 and r["reward/correct/queue_s"] >= 0.0
    # the batch held through the kill waited for the restarted service
    assert max(r["reward/correct/call_s"] for r in steps) > 1.0

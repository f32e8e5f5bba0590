"""`tandem run` itself under faults: killed with kill -9, its coordinator flooded with WatchEvents streams, its
fixed ports already taken by another run. Real processes and a real redis-server throughout."""

from __future__ import annotations

import os
import signal

import pytest

from reliability_kit import redis_pid, rollout_pid, service_pid, wait_for, wait_running
from tandem_runs import alive, children_of, start_run, stop_run, supervisor_log

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.timeout(300)]

COMMON = ("loop.eval_interval=null", "loop.save_interval=100", "loop.step_timeout_s=60")


def test_kill_9_of_tandem_run_takes_redis_server_and_every_service_with_it(tmp_path):
    run_dir, everything = tmp_path / "run", set()
    proc = start_run(run_dir, "loop.num_rollout=400", *COMMON)
    try:
        wait_running(run_dir, rollout_id=1)
        named = {"redis-server": redis_pid(proc.pid), "trainer": service_pid(proc.pid, "trainer"),
                 "rollout": rollout_pid(proc.pid, 0), "coordinator": service_pid(proc.pid, "coordinator")}
        everything = set(children_of(proc.pid))
        assert set(named.values()) <= everything
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_for(lambda: not any(alive(pid) for pid in everything), what="the children of the killed supervisor",
                 timeout_s=120, every_s=0.2)
    finally:
        stop_run(proc)
        for pid in filter(alive, everything):   # some only when the test failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in supervisor_log(run_dir)

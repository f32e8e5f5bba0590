"""A service process whose handler thread is stuck in a call still exits once its shutdown budget is spent, and
its log names the stuck thread (services/rpc/shutdown.py). A real child process, a real blocked thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import logging, sys, threading
    from services.rpc.shutdown import arm_exit_watchdog
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    threading.Thread(target=threading.Event().wait, name="handler-stuck-in-recv").start()   # never returns
    arm_exit_watchdog(7, name="trainer", after_s=0.5)
    sys.exit(7)
""")


def test_a_process_with_a_stuck_thread_exits_when_the_budget_is_spent_and_names_the_thread():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7
    assert "trainer did not exit within 0.5s: thread 'handler-stuck-in-recv' still runs" in done.stderr
    assert "in wait" in done.stderr          # its stack


def test_a_process_with_nothing_stuck_exits_at_once_with_its_code():
    child = CHILD.replace('threading.Thread(target=threading.Event().wait, name="handler-stuck-in-recv").start()', "")
    child = child.replace("after_s=0.5", "after_s=30")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=20)
    assert done.returncode == 7 and "did not exit" not in done.stderr

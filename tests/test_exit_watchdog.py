"""A service process whose handler thread is stuck in a call still exits once its shutdown budget is spent, and
its log names the stuck thread (services/rpc/shutdown.py). A real child process, a real blocked thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from stopping import sigterm_to_another_thread

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
    assert "in wait" in done.stderr  # its stack


def test_a_process_with_nothing_stuck_exits_at_once_with_its_code():
    child = CHILD.replace('threading.Thread(target=threading.Event().wait, name="handler-stuck-in-recv").start()', "")
    child = child.replace("after_s=0.5", "after_s=30")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=20)
    assert done.returncode == 7 and "did not exit" not in done.stderr


# Threads that start threads all the time: glibc blocks every signal around `clone`, so a SIGTERM may land on any
# of them. The test makes that certain with tgkill to a thread other than the main one.
HEARS = textwrap.dedent("""
    import sys, threading
    from services.rpc.shutdown import StopSignals, exit_now
    def on_signal(signum, count):
        print("heard", count, flush=True)
        if count > 1:
            exit_now(3)
    stop = StopSignals(on_signal=on_signal)
    def churn():
        while True:
            t = threading.Thread(target=lambda: None)
            t.start()
            t.join()
    threading.Thread(target=churn, daemon=True, name="churn").start()
    print("ready", flush=True)
    if len(sys.argv) > 1:
        threading.Event().wait()   # the main thread asleep in a lock for good
    print("stopping", stop.wait().name, stop.count, flush=True)
""")


def _child(*args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HEARS, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_sigterm_taken_by_another_thread_still_stops_the_main_thread():
    proc = _child()
    sigterm_to_another_thread(proc.pid)
    out, _ = proc.communicate(timeout=30)
    assert (proc.returncode, out) == (0, "heard 1\nstopping SIGTERM 1\n")


def test_each_stop_signal_reaches_its_callback_while_the_main_thread_sleeps_in_a_lock():
    proc = _child("asleep")
    sigterm_to_another_thread(proc.pid)
    assert proc.stdout is not None and proc.stdout.readline() == "heard 1\n"  # then a second, not one merged
    sigterm_to_another_thread(proc.pid)
    out, _ = proc.communicate(timeout=30)
    assert (proc.returncode, out) == (3, "heard 2\n")

"""The run's progress bar and its printed lines (services/launcher/progress.py), driven with real rich consoles
writing to a buffer instead of the terminal."""

from __future__ import annotations

import io
import threading

from rich.console import Console

from services.contracts.gen.tandem.v1 import coordinator_pb2
from services.launcher.progress import ProgressView


def _step(rollout_id: int) -> coordinator_pb2.StepEvent:
    return coordinator_pb2.StepEvent(kind="step", rollout_id=rollout_id, metrics={"rollout/reward_mean": 0.5})


def _bar(out: io.StringIO) -> str:
    return out.getvalue().rsplit("\r", 1)[-1]


def test_a_length_known_before_the_bar_starts_shows_n_of_total():
    """The WatchEvents thread may learn the run's length before the main thread starts the bar (it once showed 80/?
    to the end of the run)."""
    out = io.StringIO()
    view = ProgressView(enabled=True, console=Console(file=out, force_terminal=True, width=120))
    asked = threading.Thread(target=view.set_total, args=(80,), kwargs={"start": 0})
    asked.start()
    asked.join()
    with view:
        for i in range(80):
            view.on_event(_step(i))
        assert view.progress is not None
        view.progress.refresh()
    assert "80/80" in out.getvalue() and "/?" not in out.getvalue()


def test_a_length_learned_after_the_bar_starts_replaces_the_question_mark():
    out = io.StringIO()
    view = ProgressView(enabled=True, console=Console(file=out, force_terminal=True, width=120))
    with view:
        assert view.progress is not None
        view.progress.refresh()
        assert "0/?" in _bar(out)
        view.set_total(0, start=0)  # the coordinator does not know it yet: still unknown, not 0
        view.progress.refresh()
        assert "0/?" in _bar(out)
        view.set_total(20, start=5)  # a resumed run starts where it stopped
        view.progress.refresh()
        assert "5/20" in _bar(out)


def test_eval_lines_do_not_wrap_when_stdout_is_not_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False)  # a pipe or a file: rich assumes 80 columns
    assert not console.is_terminal and console.width == 80
    metrics = {f"eval/{k}": 0.123456 for k in ("reward_mean", "pass@1", "pass@4", "pass@8", "response_len_mean")}
    with ProgressView(enabled=True, console=console) as view:
        view.on_event(coordinator_pb2.StepEvent(kind="eval", rollout_id=79, metrics=metrics))
        view.on_event(coordinator_pb2.StepEvent(kind="state", message="[a message with brackets] " + "x" * 90))
    lines = out.getvalue().splitlines()
    evals = [line for line in lines if line.startswith("eval after rollout 79:")]
    assert evals == [
        "eval after rollout 79: eval/pass@1 0.123  eval/pass@4 0.123  eval/pass@8 0.123  "
        "eval/response_len_mean 0.123  eval/reward_mean 0.123"
    ]
    assert "[a message with brackets] " + "x" * 90 in lines


def test_without_the_bar_each_step_is_a_log_line_of_n_of_total(caplog):
    view = ProgressView(enabled=False)
    with caplog.at_level("INFO", logger="tandem.run"), view:
        view.on_event(_step(0))
        view.set_total(80, start=0)
        view.on_event(_step(79))
    assert [r.getMessage().split("  ")[0] for r in caplog.records] == ["step 1/?", "step 80/80"]

"""bench/gpu_plan.py, the GPU plan of issue 39, driven here with stages of small real commands (no GPU): pending
stages run in order while their limits fit the budget, finished ones and those missing a package are passed over,
each result lands in $OUT at once (three files), a fallback stops at its first success, `--absorb` records the
results and appends them to RESULTS.md once; and every real stage's arguments parse with its script's own parser."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gpu_plan
from gpu_plan import PY, Stage
from gpu_suite import summary_lines


def table_cmd(rows: int, code: int = 0) -> tuple[str, ...]:
    """A command printing a markdown table and exiting with `code`."""
    body = "; ".join(["print('| a | b |')", "print('|---|---|')", *[f"print('| {i} | x |')" for i in range(rows)]])
    return (PY, "-c", f"import sys; {body}; sys.exit({code})")


@pytest.fixture
def plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A committed plan file in tmp_path that says stage `done` finished, and the stages below."""
    plan_file = tmp_path / "gpu_plan.json"
    done = {"status": "ok", "date": "2026-12-05", "card": "H100", "attempts": 1, "seconds": 5, "finished_at": "t0"}
    plan_file.write_text(json.dumps({"done": done}))
    monkeypatch.setattr(gpu_plan, "PLAN_FILE", plan_file)
    monkeypatch.setattr(gpu_plan, "card_name", lambda: "Fake card (no GPU in this test)")
    stages = [
        Stage("first", "goal 1", (table_cmd(2),), 60, keep=("first_*.json",)),
        Stage("done", "goal 0", (table_cmd(1),), 60),
        Stage("too_long", "goal 2", (table_cmd(1),), 10_000),
        Stage("needs_pkg", "goal 3", (table_cmd(1),), 60, needs=("no_such_package_tandem",)),
        Stage("fails", "goal 4", (table_cmd(1, code=3), table_cmd(5)), 60),
        Stage("fallback", "goal 5", (table_cmd(1, code=1), table_cmd(3), table_cmd(4, code=7)), 60, fallback=True),
    ]
    monkeypatch.setattr(gpu_plan, "stages", lambda work: stages)
    return plan_file


def run(tmp_path: Path, **kwargs) -> int:
    def no_servers() -> None:
        raise AssertionError("no stage here needs the SGLang servers")

    (tmp_path / "work").mkdir(exist_ok=True)
    (tmp_path / "work" / "first_result.json").write_text('{"tokens_per_s": 1}')
    args = dict(out=tmp_path / "out", work=tmp_path / "work", budget_s=500.0, only=None)
    return gpu_plan.run_plan(**{**args, **kwargs}, summarize=summary_lines, start_servers=no_servers)


def test_the_plan_runs_what_is_pending_and_fits_in_order_and_writes_each_result(plan, tmp_path):
    assert run(tmp_path) == 1  # one stage failed
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["plan_logs.txt", "plan_report.md", "plan_results.json"]
    records = json.loads((out / "plan_results.json").read_text())
    assert list(records) == ["first", "fails", "fallback"]  # done, too_long, needs_pkg passed over
    first, fails, fallback = records["first"], records["fails"], records["fallback"]
    assert first["status"] == "ok" and first["card"] == "Fake card (no GPU in this test)"
    assert first["summary"].splitlines()[-3:] == ["|---|---|", "| 0 | x |", "| 1 | x |"]
    assert first["kept"] == {"first_result.json": '{"tokens_per_s": 1}'}
    assert fails["status"] == "exit 3" and len(fails["commands"]) == 1  # stops at its first failure
    assert fallback["status"] == "ok" and len(fallback["commands"]) == 2  # stops at its first success
    assert fallback["summary"].count("| x |") == 1 + 3  # both commands' tables: one log
    assert [r["attempts"] for r in records.values()] == [1, 1, 1]
    report = (out / "plan_report.md").read_text()
    assert report.index("### `first` — ok") < report.index("### `fails` — exit 3")
    assert "===== fails: exit 3" in (out / "plan_logs.txt").read_text()


def test_a_stage_starts_only_if_its_limit_fits_what_is_left(plan, tmp_path):
    run(tmp_path, budget_s=59.0)  # every stage's limit is 60 s or more
    assert not (tmp_path / "out" / "plan_results.json").exists()
    run(tmp_path, only=["fallback"])
    assert list(json.loads((tmp_path / "out" / "plan_results.json").read_text())) == ["fallback"]


def test_absorb_records_the_results_once_and_appends_them_to_results_md(plan, tmp_path, monkeypatch, capsys):
    run(tmp_path)
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Benchmark results\n")
    monkeypatch.setattr(gpu_plan, "KEPT_DIR", tmp_path / "kept")
    assert gpu_plan.absorb(tmp_path / "out", plan_file=plan, results_md=results_md) == 0
    state = json.loads(plan.read_text())
    assert sorted(state) == ["done", "fails", "fallback", "first"]
    assert state["fails"]["status"] == "exit 3" and state["fails"]["attempts"] == 1
    assert (tmp_path / "kept" / "first" / "first_result.json").read_text() == '{"tokens_per_s": 1}'
    text = results_md.read_text()
    assert text.count("## GPU plan (issue 39)") == 1 and "Fake card (no GPU in this test)" in text
    assert "| 1 | x |" in text
    assert gpu_plan.absorb(tmp_path / "out", plan_file=plan, results_md=results_md) == 0
    assert "nothing new" in capsys.readouterr().out and results_md.read_text() == text
    # the next call: finished stages skipped, the failed one tried again and then left for a person
    assert run(tmp_path) == 1
    assert list(json.loads((tmp_path / "out" / "plan_results.json").read_text())) == ["fails"]
    gpu_plan.absorb(tmp_path / "out", plan_file=plan, results_md=results_md)
    assert json.loads(plan.read_text())["fails"]["attempts"] == 2
    assert gpu_plan.pending_reason(Stage("fails", "", (), 1), json.loads(plan.read_text())["fails"]) is not None


def test_absorb_names_a_missing_or_broken_results_file(tmp_path, capsys):
    assert gpu_plan.absorb(tmp_path) == 1
    assert "plan_results.json does not exist" in capsys.readouterr().err
    (tmp_path / "plan_results.json").write_text("{not json")
    assert gpu_plan.absorb(tmp_path) == 1
    assert "is not valid JSON" in capsys.readouterr().err


def test_every_real_stage_names_a_script_whose_parser_takes_its_arguments(tmp_path):
    commands = [cmd for stage in gpu_plan.stages(tmp_path) for cmd in stage.commands]
    assert len(commands) >= 19
    bad = (PY, "bench/bench_train_step.py", "--presets", "no_such_preset")
    problems = gpu_plan.argument_problems([*commands, bad, (PY, "bench/no_such_script.py")])
    assert problems[:-2] == [None] * len(commands)
    assert "invalid choice: 'no_such_preset'" in str(problems[-2])
    assert problems[-1] == "no such script: bench/no_such_script.py"


def test_inflight_report_puts_the_ratios_side_by_side_with_and_without_the_checkpoint_saves():
    """gpu_inflight's table (the in-flight goal's figure): tokens over summed step time, and the same without the
    save that ends every run; summaries written before save_s existed read as no save."""
    import gpu_inflight

    def summary(name: str, step_s: float, save_s: float | None) -> dict:
        found = {"name": name, "steps": 6, "step_s": step_s, "tokens": 1000.0, "tokens_per_s": 1000.0 / step_s}
        found |= {"engine_busy_s": None, "sync_ms": None, "stale_dropped": 0.0, "inflight_token_frac": 0.0}
        return found | {"curve": [[512.0, 0.0]]} | ({} if save_s is None else {"save_s": save_s})

    table = gpu_inflight.report([summary("one_step_off", 20.0, 10.0), summary("stream_keep", 15.0, 10.0)])
    assert "| x one_step_off | 1.00 | 1.33 |" in table
    assert "| tokens/s without the checkpoint saves | 100 | 200 |" in table
    assert "| x one_step_off, without the saves | 1.00 | 2.00 |" in table
    old = gpu_inflight.report([summary("one_step_off", 20.0, None), summary("stream_keep", 15.0, None)])
    assert "| x one_step_off, without the saves | 1.00 | 1.33 |" in old

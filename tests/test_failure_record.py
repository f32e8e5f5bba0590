"""The failure record every failed run ends with: which error becomes which record (service, kind, exit code, hint),
and how it is written, read back and shown."""

from __future__ import annotations

from pathlib import Path

import grpc

from services.contracts.config import ConfigError
from services.contracts.exits import ExitCode
from services.contracts.failure import FailureRecord, clear_failure, read_failure, write_failure
from services.coordinator.call_errors import ServiceCallError, TrainerStateLost, failure_record


def test_a_service_answer_keeps_its_service_call_status_and_hint_and_is_permanent_by_status():
    exc = ServiceCallError(
        "trainer Save failed: RESOURCE_EXHAUSTED: NoSpaceLeft: no space left on /c",
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        service="trainer",
        call="Save",
        details="NoSpaceLeft: no space left on /c",
        hint="free space on /c",
    )
    assert failure_record(exc, kept="/c/rollout_1") == FailureRecord(
        service="trainer",
        kind="RESOURCE_EXHAUSTED",
        what="no space left on /c",
        exit_code=ExitCode.PERMANENT,
        call="Save",
        kept="/c/rollout_1",
        hint="free space on /c",
    )
    transient = ServiceCallError("x", code=grpc.StatusCode.UNAVAILABLE, service="rollout-1", call="Generate(3)")
    record = failure_record(transient, kept="")
    assert (record.exit_code, record.kind, record.advice.startswith("the service went away")) == (
        ExitCode.FAILED,
        "UNAVAILABLE",
        True,
    )
    lost = failure_record(TrainerStateLost("lost", service="trainer", call="Train(4)"), kept="")
    assert (lost.service, lost.kind, lost.exit_code) == ("trainer", "UNKNOWN", ExitCode.FAILED)


def test_the_coordinators_own_errors_bad_input_at_start_or_a_bug():
    bad = failure_record(ValueError("d.jsonl:3: not valid JSON"), kept="", starting=True)
    assert (bad.service, bad.kind, bad.what, bad.exit_code) == (
        "coordinator",
        "BAD_INPUT",
        "d.jsonl:3: not valid JSON",
        ExitCode.PERMANENT,
    )
    assert (
        failure_record(ConfigError("tracing.trackers: wandb could not start"), kept="").exit_code == ExitCode.PERMANENT
    )
    bug = failure_record(KeyError("x"), kept="/c/r")
    assert (bug.kind, bug.what, bug.exit_code) == ("UNEXPECTED", "KeyError: 'x'", ExitCode.FAILED)
    assert "not an error Tandem expected" in bug.advice


def test_written_atomically_read_back_and_cleared(tmp_path: Path):
    record = FailureRecord(service="rollout-0", kind="INVALID_ARGUMENT", what="w", exit_code=3, call="Generate(0)")
    write_failure(tmp_path, record)
    assert read_failure(tmp_path) == record and [p.name for p in tmp_path.iterdir()] == ["failure.json"]
    clear_failure(tmp_path)
    assert read_failure(tmp_path) is None
    (tmp_path / "failure.json").write_text("{not json")
    assert read_failure(tmp_path) is None  # a torn or foreign file is no record


def test_rendered_block_says_what_where_kept_what_to_do_and_the_exit_code(tmp_path: Path):
    record = FailureRecord(
        service="trainer",
        kind="RESOURCE_EXHAUSTED",
        what="no space",
        exit_code=3,
        call="Save",
        kept="/c/rollout_2",
        hint="free space on /c",
    )
    assert record.render(command="tandem run", run_dir=tmp_path).splitlines() == [
        "tandem run failed: trainer answered Save with RESOURCE_EXHAUSTED",
        "  what went wrong: no space",
        "  kept:            /c/rollout_2",
        "  what to do:      free space on /c; then run the same command again: it resumes from /c/rollout_2",
        f"  full traceback:  {tmp_path / 'logs' / 'trainer.log'}",
        "  exit code 3: a restart would only repeat it, so nothing was restarted",
    ]
    died = FailureRecord(service="rollout-0", kind="EXITED", what="rollout-0 exited with -9", exit_code=1)
    assert died.render(command="tandem run", run_dir=tmp_path).splitlines()[4:] == [
        f"  log:             {tmp_path / 'logs' / 'rollout-0.log'}",
        "  exit code 1: a failure a restart may fix",
    ]

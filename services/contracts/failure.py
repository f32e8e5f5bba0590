"""How a failed run ends: one record of what went wrong, written by the coordinator, rendered by whoever shows it.

The coordinator writes RUN_DIR/failure.json when its run fails (`write_failure`); `tandem run` reads it when the
coordinator exits and prints `render()` as its last lines, and `tandem coordinator` run alone prints the same to
stderr. Every expected error takes this one path, whichever service reported it: the block says what went wrong,
which service said so, what was kept (the last good checkpoint, or none), what to do and the exit code. The full
traceback stays in the service's log file (RUN_DIR/logs/<service>.log), never on the terminal.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from services.contracts.exits import ExitCode
from services.contracts.files import write_atomic

FAILURE_FILE = "failure.json"

# What to do about an error, by the status a service answered with (or the coordinator's own kind of error); an
# error that knows better (a reward, a full disk) carries its own hint, which goes first.
ADVICE = {
    "INVALID_ARGUMENT": "fix the input it names (the task data, the reward function or the config)",
    "RESOURCE_EXHAUSTED": "free what ran out (disk space where it says) or raise the limit it names",
    "FAILED_PRECONDITION": "the service was not in a state to do it; its log says why",
    "DEADLINE_EXCEEDED": "a call took longer than its deadline (the key it names); the service's log shows what hung",
    "UNAVAILABLE": "the service went away or could not be reached; its log says why (services.max_restarts > 0 "
    "restarts a dead service)",
    "PERMISSION_DENIED": "check the path or the identity it names",
    "UNAUTHENTICATED": "every service and client needs the same services.auth_token",
    "NOT_FOUND": "check the path or the entry it names",
    "BAD_INPUT": "fix the input it names",
    "EXITED": "its log says why it exited",
}
UNEXPECTED = "this is not an error Tandem expected (a bug): the traceback is in the log; please report it"

_EXIT_MEANING = {
    ExitCode.FAILED: "a failure a restart may fix",
    ExitCode.BAD_INPUT: "bad input found before the run",
    ExitCode.PERMANENT: "a restart would only repeat it, so nothing was restarted",
    ExitCode.INTERRUPTED: "interrupted",
}


@dataclass(frozen=True)
class FailureRecord:
    service: str  # the process that reported it, as named in RUN_DIR/logs/<service>.log
    kind: str  # the gRPC status name, or BAD_INPUT / EXITED / UNEXPECTED for the coordinator's own
    what: str  # the error, as the service said it
    exit_code: int
    call: str = ""  # the call that failed (Generate(3), Save), when a service answered one
    kept: str = ""  # the last good checkpoint ("" = none)
    hint: str = ""  # what to do, from the error itself; else ADVICE by kind

    @property
    def advice(self) -> str:
        return self.hint or ADVICE.get(self.kind, UNEXPECTED)

    def render(self, *, command: str, run_dir: Path | None) -> str:
        """The block a command ends with: a headline and one line each for what, kept, what to do, logs, exit."""
        answered = f" answered {self.call} with {self.kind}" if self.call else f" failed ({self.kind})"
        logs = run_dir / "logs" if run_dir is not None else Path("logs")
        again = (
            f"then run the same command again: it resumes from {self.kept}"
            if self.kept
            else "then run the same command again: with no checkpoint it starts from the beginning"
        )
        meaning = _EXIT_MEANING.get(ExitCode(self.exit_code), "") if self.exit_code in _EXIT_MEANING else ""
        lines = [
            f"{command} failed: {self.service}{answered}",
            f"  what went wrong: {self.what}",
            f"  kept:            {self.kept or 'no checkpoint (none was written yet)'}",
            f"  what to do:      {self.advice}; {again}",
            f"  {'log:' if self.kind == 'EXITED' else 'full traceback:':<16} {logs / (self.service + '.log')}",
            f"  exit code {self.exit_code}" + (f": {meaning}" if meaning else ""),
        ]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FailureRecord:
        data = json.loads(text)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def write_failure(run_dir: Path, record: FailureRecord) -> Path:
    """Atomically: a reader never sees half a record."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_atomic(run_dir / FAILURE_FILE, record.to_json())


def read_failure(run_dir: Path) -> FailureRecord | None:
    try:
        return FailureRecord.from_json((run_dir / FAILURE_FILE).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None


def clear_failure(run_dir: Path) -> None:
    """Before a coordinator starts: a record left by an earlier one must not be shown for this one."""
    (run_dir / FAILURE_FILE).unlink(missing_ok=True)

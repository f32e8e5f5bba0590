"""Files one process writes and another reads: whole or not at all, never half.

Every run file another process reads (RUN_DIR/config.yaml, run.json, failure.json, a checkpoint's
COMPLETE.json and tandem_state.json, the W&B state, a trainer's per-role config) is replaced atomically
(`write_atomic`): the bytes go to a temporary file in the same directory, are fsynced, and the file is renamed
over the old one, then the directory is fsynced. A reader sees the old file or the new one, and after a crash
(power, kill -9) the name points at a complete file. Writing in place instead (`Path.write_text`) truncates
first, so a reader that comes between the truncate and the write sees an empty file: `tandem ctl`, a restarted
service, a test.

Logs of rows (metrics.jsonl) are appended instead (`append_line`): one `write` of one whole line on an
O_APPEND descriptor. Its readers count a line only once its newline is there (`complete_lines`), so a line
being written, or torn by a crash, is never read as a row.

Pure stdlib: every service and the CLI import this.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from services.contracts.untyped import JsonObject, JsonValue

_NEW_FILE_MODE = 0o666  # what open() asks for; the process umask applies, as with Path.write_text
PRIVATE_FILE_MODE = 0o600  # a file that holds secrets (a token, passwords)


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, mode: int = _NEW_FILE_MODE) -> Path:
    """Replaces `path` with `data` in one step (see the module docstring). `mode`: the new file's permission
    bits before the umask (0o600 for a file that holds secrets: it never exists readable by others)."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            write_all(fd, raw)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_json_atomic(path: str | os.PathLike[str], data: JsonValue, *, mode: int = _NEW_FILE_MODE) -> Path:
    return write_atomic(path, json.dumps(data), mode=mode)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Makes a rename (or a new name) in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_line(path: str | os.PathLike[str], line: str) -> None:
    """Appends one line (a newline is added) with a single write on an O_APPEND descriptor: however long the
    line, no other append lands inside it, and a reader sees a prefix of it at worst (see `complete_lines`)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, _NEW_FILE_MODE)
    try:
        write_all(fd, (line.rstrip("\n") + "\n").encode())
    finally:
        os.close(fd)


def complete_lines(raw: bytes) -> list[str]:
    """The lines of an appended file that are whole: a last line without its newline is still being written
    (or was torn by a crash) and is left out."""
    end = raw.rfind(b"\n")
    return raw[: end + 1].decode(errors="replace").splitlines() if end >= 0 else []


def read_json_rows(path: str | os.PathLike[str]) -> list[JsonObject]:
    """The JSON objects of an appended JSON-lines file, one per complete line; lines that are not a JSON object
    (torn by a crash before the run resumed) are skipped."""
    rows = []
    for line in complete_lines(Path(path).read_bytes()):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def write_all(fd: int, raw: bytes) -> None:
    """All of `raw` to `fd`."""
    view = memoryview(raw)
    while view:  # a regular file takes it in one go; the loop only guards a short write
        view = view[os.write(fd, view) :]

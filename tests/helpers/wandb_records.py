"""Reads back what an offline W&B run wrote (RUN_DIR/wandb/offline-run-*/run-<id>.wandb): wandb ships no reader
of its own. The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
records, each a 7-byte header (CRC32, length, type: full / first / middle / last) and a piece of one serialized
`wandb_internal_pb2.Record`."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_BLOCK = 32 * 1024
_HEADER = struct.Struct("<IHB")
_FULL, _LAST = 1, 4


@dataclass(frozen=True)
class OfflineRun:
    directory: Path
    run_id: str
    branch: tuple[str, float] | None  # resume_from: (run id, the _step it was rewound to)
    rows: tuple[dict[str, object], ...]  # history rows, values decoded from JSON, in logged order
    finished: bool  # its exit record is there (wandb-core writes the file after finish())

    @property
    def steps(self) -> list[int]:
        return [int(row["_step"]) for row in self.rows]  # type: ignore[call-overload]


def _records(path: Path) -> Iterator[object]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending = 7, b""
    while pos + _HEADER.size <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER.size:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = _HEADER.unpack_from(data, pos)
        pending += data[pos + _HEADER.size : pos + _HEADER.size + length]
        pos += _HEADER.size + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_runs(run_dir: Path) -> list[OfflineRun]:
    """Every offline run under RUN_DIR/wandb, oldest first."""
    out = []
    for directory in sorted((run_dir / "wandb").glob("offline-run-*")):
        [log] = directory.glob("*.wandb")
        run_id, branch, rows, finished = "", None, [], False
        for record in _records(log):
            kind = record.WhichOneof("record_type")  # type: ignore[attr-defined]
            if kind == "run":
                run = record.run  # type: ignore[attr-defined]
                run_id = run.run_id
                if run.HasField("branch_point"):
                    branch = (run.branch_point.run, run.branch_point.value)
            elif kind == "exit":
                finished = True
            elif kind == "history":
                items = record.history.item  # type: ignore[attr-defined]
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
        out.append(OfflineRun(directory=directory, run_id=run_id, branch=branch, rows=tuple(rows), finished=finished))
    return out


def finished_runs(run_dir: Path, *, count: int, timeout_s: float = 30.0) -> list[OfflineRun]:
    """The `count` offline runs once wandb-core has written each to the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = offline_runs(run_dir)
        if (len(runs) == count and all(r.finished for r in runs)) or time.monotonic() > deadline:
            return runs
        time.sleep(0.1)

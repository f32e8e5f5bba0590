"""Checkpoint layout, completeness, retention, and the trainer's JSON client state (incl. RNG).

    <root>/<role>/rollout_<id:08d>/
        ds/                     DeepSpeed shards (every rank writes its own)
        hf/                     HF-format export (safetensors + config + tokenizer files), optional
        tandem_state.json       the trainer's state: step, weight version, recorded Train results, ...
        rng_rank<r>.json        each rank's RNG state
        COMPLETE.json           written last, atomically: a directory without it is ignored (half-written)

A checkpoint is written under `.rollout_<id>.partial/` and renamed to its name once complete, so a crash or a
full disk never leaves a `rollout_<id>` that is not whole, nor removes a good one. On a full disk the partial
directory is removed again and the save fails with `NoSpaceLeft`, naming the path; the last good checkpoint
stays. The trainer reads only JSON it wrote itself; DeepSpeed's own shards are loaded by DeepSpeed.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import random
import re
import shutil
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.contracts.checkpoints import (
    COMPLETE,
    is_complete,
    list_checkpoints,
)

_STAGED_RE = re.compile(r"^\.rollout_(\d+)\.(partial|old)$")   # a save that was cut short, or its predecessor
_FULL = (errno.ENOSPC, errno.EDQUOT)


class NoSpaceLeft(OSError):
    """The filesystem of the checkpoint directory is full (or over quota); maps to RESOURCE_EXHAUSTED."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)


def staging_dir(directory: Path) -> Path:
    return directory.with_name(f".{directory.name}.partial")


def publish(staging: Path, directory: Path) -> None:
    """Gives a finished staging directory its name, replacing an older checkpoint of the same name."""
    previous = directory.with_name(f".{directory.name}.old")
    if directory.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(directory, previous)
    os.replace(staging, directory)
    shutil.rmtree(previous, ignore_errors=True)
    _fsync_dir(directory.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def out_of_space(exc: BaseException, path: Path, *, probe_bytes: int = 1 << 20) -> bool:
    """Whether a failed write into `path` failed because its filesystem is full. torch.save's C++ writer loses
    the errno ("[enforce fail at inline_container.cc] ... unexpected pos"), so when the exception does not say
    ENOSPC, writing `probe_bytes` there decides (before the partial files are removed)."""
    if any(isinstance(e, OSError) and e.errno in _FULL for e in _chain(exc)):
        return True
    existing = next((p for p in (path, *path.parents) if p.is_dir()), None)
    if existing is None:
        return False
    probe = existing / f".space-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(probe_bytes))
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return err.errno in _FULL
    finally:
        probe.unlink(missing_ok=True)
    return False


def release_frames(exc: BaseException) -> None:
    """Drops the locals of every frame in the exception's chain: after a failed torch.save they hold its writer,
    whose file keeps the disk space of the partial checkpoint taken (deleted but open) until they go."""
    for e in _chain(exc):
        traceback.clear_frames(e.__traceback__)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def mark_complete(directory: Path, info: dict[str, Any]) -> None:
    write_json_atomic(directory / COMPLETE, info)


def apply_retention(root: Path, *, keep: int, current: Path) -> list[Path]:
    """Keeps the newest `keep` complete checkpoints; removes older ones and any incomplete or staged leftovers
    (never `current`). Returns what was removed."""
    entries = list_checkpoints(root)
    complete = [p for _, p in entries if is_complete(p)]
    keep_set = set(complete[-keep:]) | {current}
    removed = [p for _, p in entries if p not in keep_set]
    removed += [p for p in root.iterdir() if p.is_dir() and _STAGED_RE.match(p.name)]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def copy_tokenizer_files(model_dir: Path, out_dir: Path) -> None:
    """What serving needs beside the weights: tokenizer files and any other small non-weight file."""
    skip_suffixes = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
    for f in Path(model_dir).iterdir():
        if f.is_file() and not f.name.endswith(skip_suffixes) and f.name not in ("config.json",
                                                                                 "generation_config.json"):
            shutil.copy2(f, out_dir / f.name)


# ---- RNG --------------------------------------------------------------------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    out: dict[str, Any] = {
        "python": [version, list(state), gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])

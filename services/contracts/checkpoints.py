"""Where checkpoints live and which one is the latest complete one: the one definition every service reads.

    <base>/<role>/rollout_<id:08d>/ ... COMPLETE.json (written last)

<base> is trainer.checkpoint_dir or RUN_DIR/checkpoints. The trainer writes checkpoints
(services.trainer.checkpointing); `tandem run`'s preflight, its supervisor and the trainer find them here. Pure
pathlib and JSON: no torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from services.contracts.untyped import JsonValue

if TYPE_CHECKING:
    from services.contracts.config import TandemConfig

COMPLETE = "COMPLETE.json"
STATE = "tandem_state.json"
DIR_RE = re.compile(r"^rollout_(\d+)$")


def checkpoint_root(*, base: Path, role: str) -> Path:
    return base / role


def default_base(*, checkpoint_dir: str | None, run_dir: Path) -> Path:
    """trainer.checkpoint_dir, or RUN_DIR/checkpoints."""
    return Path(checkpoint_dir) if checkpoint_dir else run_dir / "checkpoints"


def checkpoint_dir(root: Path, rollout_id: int) -> Path:
    return root / f"rollout_{rollout_id:08d}"


def read_json(path: Path) -> JsonValue:
    with open(path) as f:
        return json.load(f)


def is_complete(directory: Path) -> bool:
    return (directory / COMPLETE).is_file()


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(rollout id, directory) of every checkpoint-shaped directory under root, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := DIR_RE.match(p.name))]
    return sorted(found)


def latest_complete(root: Path) -> Path | None:
    complete = [p for _, p in list_checkpoints(root) if is_complete(p)]
    return complete[-1] if complete else None


def resolve_load_dir(path: str, *, default_root: Path, role: str) -> Path | None:
    """Empty path: the latest complete checkpoint under the default root (None when there is none).
    A path may name one checkpoint directory, a role directory, or a root holding role directories."""
    if not path:
        return latest_complete(default_root)
    p = Path(path)
    if is_complete(p):
        return p
    if DIR_RE.match(p.name) and p.is_dir():
        raise FileNotFoundError(
            f"checkpoint {p} is incomplete (no {COMPLETE}: it was being written when the trainer stopped)"
        )
    for candidate in (p / role, p):
        found = latest_complete(candidate)
        if found is not None:
            return found
    raise FileNotFoundError(f"no complete checkpoint at {p}")


def latest_checkpoint(config: TandemConfig, *, run_dir: Path, role: str = "actor") -> Path | None:
    """The latest complete checkpoint of a run's `role` (None when there is none)."""
    base = default_base(checkpoint_dir=config.trainer.checkpoint_dir, run_dir=run_dir)
    return latest_complete(checkpoint_root(base=base, role=role))

"""Save and Load: the checkpoint files (layout, completeness, retention, RNG) and the `Checkpointer` using them.

    <root>/<role>/rollout_<id:08d>/
        ds/                     DeepSpeed shards (every rank writes its own); with trainer.lora the adapters
                                and their optimizer state only (the frozen base is model.path's)
        hf/                     HF-format export (safetensors + config + tokenizer files), optional;
                                with trainer.lora the merged weights, and hf/adapter/ the adapter (peft format)
        tandem_state.json       the trainer's state: step, weight version, recorded Train results, ...
        rng_rank<r>.json        each rank's RNG state
        COMPLETE.json           written last, atomically: a directory without it is ignored (half-written)

The layout and the lookup of the latest complete checkpoint are services.contracts.checkpoints. A checkpoint is
written under `.rollout_<id>.partial/` and renamed to its name once complete, so a crash or a full disk never
leaves a `rollout_<id>` that is not whole, nor removes a good one. On a full disk the partial directory is removed
again and the save fails with `NoSpaceLeft`, naming the path; the last good checkpoint stays. The trainer reads
only JSON it wrote itself; DeepSpeed's own shards are loaded by DeepSpeed.
"""

from __future__ import annotations

import base64
import errno
import logging
import os
import random
import re
import shutil
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from services.contracts import checkpoints
from services.contracts.checkpoints import COMPLETE, is_complete, list_checkpoints
from services.contracts.config import TandemConfig
from services.contracts.errors import FailedPrecondition
from services.contracts.files import fsync_dir, write_json_atomic
from services.contracts.untyped import JsonObject
from services.trainer.commands import Load, Save
from services.trainer.dist import DistInfo, barrier
from services.trainer.model.lora import adapter_state as lora_adapter_state
from services.trainer.model.lora import describe as describe_lora
from services.trainer.model.lora import save_adapter

if TYPE_CHECKING:
    from services.trainer.algo.old_actor import OldActor
    from services.trainer.ledger import TrainLedger
    from services.trainer.model.backend import DeepSpeedBackend
    from services.trainer.publishing import WeightPublishing

log = logging.getLogger(__name__)

_STAGED_RE = re.compile(r"^\.rollout_(\d+)\.(partial|old)$")  # a save that was cut short, or its predecessor
_FULL = (errno.ENOSPC, errno.EDQUOT)
ADAPTER_DIR = "adapter"  # under hf/: the LoRA adapter in peft's format


class NoSpaceLeft(OSError):
    """The filesystem of the checkpoint directory is full (or over quota); maps to RESOURCE_EXHAUSTED."""

    def __init__(self, message: str, *, hint: str = ""):
        super().__init__(errno.ENOSPC, message)
        self.hint = hint  # what to do: the caller's failure record shows it (grpc_util.map_errors)

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
    fsync_dir(directory.parent)


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


def mark_complete(directory: Path, info: JsonObject) -> None:
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
        if (
            f.is_file()
            and not f.name.endswith(skip_suffixes)
            and f.name not in ("config.json", "generation_config.json")
        ):
            shutil.copy2(f, out_dir / f.name)


# ---- RNG --------------------------------------------------------------------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> JsonObject:
    version, state, gauss = random.getstate()
    np_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state(legacy=True))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    out: JsonObject = {
        "python": [version, list(state), gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: JsonObject) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


# ---- the trainer's Save and Load ---------------------------------------------------------------------


@dataclass(frozen=True)
class FoundCheckpoint:
    """A checkpoint a Load reads: its directory and its state (tandem_state.json)."""

    directory: Path
    state: JsonObject

    @property
    def rollout_id(self) -> int:
        """The rollout the Save named."""
        return int(self.state["checkpoint_rollout_id"])

    @property
    def extra_state(self) -> dict[str, str]:
        return dict(self.state.get("extra_state", {}))


class Checkpointer:
    """One role's checkpoints. Rank 0 decides where (`save_dir`, `find`) and restores the ledger; every rank
    writes and reads its own part (`write`, `read`: the Save and Load commands)."""

    def __init__(
        self,
        config: TandemConfig,
        *,
        role: str,
        run_dir: Path,
        dist: DistInfo,
        backend: DeepSpeedBackend,
        ledger: TrainLedger,
        old_actor: OldActor | None,
        weights: WeightPublishing,
    ):
        self.config, self.role, self.run_dir, self.dist = config, role, run_dir, dist
        self.backend, self.ledger, self.old_actor, self.weights = backend, ledger, old_actor, weights
        self.base = checkpoints.default_base(checkpoint_dir=config.trainer.checkpoint_dir, run_dir=run_dir)

    @property
    def rank(self) -> int:
        return self.dist.rank

    # ---- rank 0 -------------------------------------------------------------------------------------

    def own_path(self, path: str) -> Path:
        """Save/Load paths from a caller stay under the checkpoint directory or the run directory: a Load
        unpickles DeepSpeed's optimizer files, so it must never read a directory someone else prepared."""
        try:
            resolved = Path(path).resolve()
        except (OSError, ValueError) as exc:  # NUL bytes, names too long
            raise ValueError(f"checkpoint path {path[:200]!r} is not a usable path: {exc}") from None
        roots = [self.base.resolve(), self.run_dir.resolve()]
        if not any(resolved.is_relative_to(root) for root in roots):
            raise ValueError(
                f"checkpoint path {path[:200]!r} is outside trainer.checkpoint_dir ({roots[0]}) and "
                f"the run directory ({roots[1]})"
            )
        return resolved

    def save_dir(self, rollout_id: int, path: str = "") -> Path:
        root = checkpoints.checkpoint_root(base=self.own_path(path) if path else self.base, role=self.role)
        return checkpoints.checkpoint_dir(root, rollout_id)

    @staticmethod
    def holds_step(directory: Path, step: int) -> bool:
        """A complete checkpoint of this step is there already (a retried Save)."""
        return is_complete(directory) and checkpoints.read_json(directory / COMPLETE)["step"] == step

    def find(self, path: str = "") -> FoundCheckpoint | None:
        """The checkpoint a Load of `path` reads and its state (None: nothing to load); refuses one of another
        role, or ZeRO shards of another world size."""
        default_root = checkpoints.checkpoint_root(base=self.base, role=self.role)
        directory = checkpoints.resolve_load_dir(
            str(self.own_path(path)) if path else "", role=self.role, default_root=default_root
        )
        if directory is None:
            return None
        state = checkpoints.read_json(directory / checkpoints.STATE)
        if state.get("role") != self.role:
            raise FailedPrecondition(f"checkpoint {directory} belongs to role {state.get('role')}, not {self.role}")
        saved, current = state.get("lora"), describe_lora(self.config.trainer.lora)
        if saved != current:
            raise FailedPrecondition(
                f"checkpoint {directory} was trained with trainer.lora {saved}; this trainer "
                f"has {current}: its shards do not fit"
            )
        saved_stage, stage = state.get("zero_stage"), self.config.trainer.zero_stage
        if saved_stage is not None and saved_stage != stage and 0 in (saved_stage, stage):
            raise FailedPrecondition(
                f"checkpoint {directory} was written at trainer.zero_stage {saved_stage}; this "
                f"trainer runs at {stage}: stage 0 keeps the flat AdamW's state, stages 1-3 "
                f"DeepSpeed's shards, so resume at trainer.zero_stage {saved_stage}"
            )
        if state["world_size"] != self.dist.world_size and self.config.trainer.zero_stage > 0:
            raise FailedPrecondition(
                f"checkpoint {directory} was saved by {state['world_size']} ranks; ZeRO "
                f"shards cannot be loaded by {self.dist.world_size}"
            )
        return FoundCheckpoint(directory=directory, state=state)

    def client_state(self, extra_state: dict[str, str], *, checkpoint_rollout_id: int) -> JsonObject:
        """The ledger's `rollout_id` is the last rollout this trainer trained; `checkpoint_rollout_id` the one the
        Save named (they differ for the actor during critic-only steps)."""
        return {
            "format": 1,
            "role": self.role,
            **self.ledger.state_dict(),
            "checkpoint_rollout_id": checkpoint_rollout_id,
            "world_size": self.dist.world_size,
            "zero_stage": self.config.trainer.zero_stage,
            "lora": describe_lora(self.config.trainer.lora),
            "extra_state": dict(extra_state),
        }

    def restore(self, found: FoundCheckpoint) -> None:
        """After every rank read the checkpoint: the ledger it holds; a prepared weight sync is void."""
        self.ledger.load_state_dict(found.state)
        self.weights.forget_plan()

    # ---- every rank ---------------------------------------------------------------------------------

    def write(self, command: Save) -> None:
        directory = Path(command.directory)
        staging = staging_dir(directory)  # renamed to `directory` once complete
        try:
            self._write(staging, command)
        except Exception as exc:
            if self.rank == 0:
                full = out_of_space(exc, staging)
                release_frames(exc)  # else the partial files' space stays taken while the error lives
                shutil.rmtree(staging, ignore_errors=True)
                if full:
                    raise self._no_space(directory) from exc
            raise
        if self.rank == 0:
            publish(staging, directory)
            removed = apply_retention(
                directory.parent, keep=self.config.trainer.keep_last_checkpoints, current=directory
            )
            log.info("saved %s (removed %d old checkpoints)", directory, len(removed))

    def _write(self, staging: Path, command: Save) -> None:
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a save of this rollout id that was cut short
            staging.mkdir(parents=True)
        barrier()
        state = (
            self.client_state(command.extra_state, checkpoint_rollout_id=command.rollout_id) if self.rank == 0 else {}
        )
        self.backend.save_checkpoint(staging, client_state=state)
        write_json_atomic(staging / f"rng_rank{self.rank}.json", rng_state())
        if command.export_hf:
            self._export_hf(staging / "hf")
        barrier()  # every rank's shards are on disk before the marker says so
        if self.rank == 0:
            write_json_atomic(staging / checkpoints.STATE, state)
            mark_complete(
                staging,
                {
                    "rollout_id": command.rollout_id,
                    "step": state["step"],
                    "world_size": self.dist.world_size,
                    "time": time.time(),
                },
            )

    def _no_space(self, directory: Path) -> NoSpaceLeft:
        last = checkpoints.latest_complete(directory.parent)
        free = shutil.disk_usage(next(p for p in directory.parents if p.exists())).free
        return NoSpaceLeft(
            f"no space left on {directory.parent}: checkpoint {directory.name} was not written "
            f"({free} bytes free after removing its partial files); the last good checkpoint "
            f"{last or '(none)'} is kept",
            hint=f"free space on {directory.parent} (or point trainer.checkpoint_dir at a larger "
            "disk; trainer.keep_last_checkpoints bounds how many are kept)",
        )

    def _export_hf(self, out: Path) -> None:
        """HF-format safetensors of the current weights (collective under ZeRO-3; rank 0 writes). With LoRA they
        are the merged weights, and out/adapter holds the adapter in peft's format."""
        from safetensors.torch import save_file

        state = dict(self.weights.iter_named_weights())
        adapter = (
            lora_adapter_state(self.backend.module, zero3=self.backend.zero_stage == 3)
            if self.config.trainer.lora is not None
            else None
        )
        if self.rank != 0:
            return
        if adapter is not None:
            save_adapter(self.backend.module, out / ADAPTER_DIR, adapter, base_path=self.config.model.path)
        out.mkdir(parents=True, exist_ok=True)
        hf_state = (
            state
            if self.role == "actor"
            else {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
        )
        self.backend.hf_model.save_pretrained(out, state_dict=hf_state, safe_serialization=True)
        if self.role == "critic":  # the value head beside the HF backbone
            head = {k: v.contiguous() for k, v in state.items() if k.startswith("value_head.")}
            save_file(head, str(out / "value_head.safetensors"))
        copy_tokenizer_files(Path(self.config.model.tokenizer_path or self.config.model.path), out)

    def read(self, command: Load) -> None:
        directory = Path(command.directory)
        self.backend.load_checkpoint(directory)
        if self.old_actor is not None:
            self.old_actor.clear()
        rng = directory / f"rng_rank{self.rank}.json"
        if rng.is_file():
            set_rng_state(checkpoints.read_json(rng))

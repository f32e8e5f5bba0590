"""The coordinator's data source: prompts from a JSONL file, shuffled per epoch, with a resumable cursor.

Rollout services keep no cursor; the coordinator hands them the prompts of each step, so the cursor
saved with a checkpoint fully determines which prompts come next after a resume.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from services.contracts.config import DataConfig
from services.contracts.sampling import prompt_max_new_tokens


@dataclass(frozen=True)
class PromptRecord:
    text: str
    label: str
    metadata: dict[str, str] = field(default_factory=dict)
    line: int = field(default=0, compare=False)   # its line in the data file (1-based; 0 = not from a file)


@dataclass(frozen=True)
class DataCursor:
    epoch: int = 0
    offset: int = 0          # position inside this epoch's permutation
    consumed: int = 0        # prompts handed out since the start of the run (gives unique group ids)

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "consumed": self.consumed}

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> DataCursor:
        return cls(epoch=int(data["epoch"]), offset=int(data["offset"]), consumed=int(data["consumed"]))


@dataclass(frozen=True)
class PromptBatch:
    prompts: tuple[PromptRecord, ...]
    group_ids: tuple[int, ...]
    epoch_end: bool          # the last batch of an epoch (save point)
    cursor_after: DataCursor


def load_prompts(path: str, *, prompt_key: str, label_key: str, limit: int | None = None) -> list[PromptRecord]:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    records = []
    with file.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            line = _decode_line(raw, path=path, line_no=line_no)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON: {exc}") from None
            if not isinstance(row, dict) or prompt_key not in row:
                raise ValueError(f"{path}:{line_no}: expected an object with key {prompt_key!r}")
            meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in row.items()
                    if k not in (prompt_key, label_key)}
            prompt_max_new_tokens(meta, where=f"{path}:{line_no}")   # a bad response budget is named with its line
            records.append(PromptRecord(text=str(row[prompt_key]), label=str(row.get(label_key, "")), metadata=meta,
                                        line=line_no))
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise ValueError(f"data file {path} holds no prompts")
    return records


def _decode_line(raw: bytes, *, path: str, line_no: int) -> str:
    """UTF-8, whatever the locale; a bad byte is named with its file, line and column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}:{line_no}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                         "task files must be UTF-8 JSON lines") from None


def load_eval_prompts(config: DataConfig) -> list[PromptRecord]:
    """The eval set: data.eval_path (else the training set), at most data.eval_max_prompts of it."""
    return load_prompts(config.eval_path or config.train_path, prompt_key=config.prompt_key,
                        label_key=config.label_key, limit=config.eval_max_prompts)


class DataSource:
    def __init__(self, records: list[PromptRecord], *, batch_size: int, shuffle: bool, seed: int, num_epochs: int):
        if batch_size > len(records):
            raise ValueError(f"rollout.rollout_batch_size ({batch_size}) is larger than the dataset "
                             f"({len(records)} prompts)")
        self.records = records
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.num_epochs = num_epochs
        self.cursor = DataCursor()

    @classmethod
    def from_config(cls, config: DataConfig, *, batch_size: int) -> DataSource:
        records = load_prompts(config.train_path, prompt_key=config.prompt_key, label_key=config.label_key)
        return cls(records, batch_size=batch_size, shuffle=config.shuffle, seed=config.seed,
                   num_epochs=config.num_epochs)

    @property
    def size(self) -> int:
        return len(self.records)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.records))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    def record_at(self, epoch: int, offset: int) -> PromptRecord:
        """The prompt at `offset` of epoch `epoch`'s order (a group drawn before a restart, generated again)."""
        return self.records[int(self._order(epoch)[offset])]

    def next_batch(self) -> PromptBatch:
        cur = self.cursor
        epoch, offset = cur.epoch, cur.offset
        if offset + self.batch_size > len(self.records):
            epoch, offset = epoch + 1, 0
        order = self._order(epoch)[offset:offset + self.batch_size]
        end = offset + self.batch_size
        epoch_end = end + self.batch_size > len(self.records)
        self.cursor = DataCursor(epoch=epoch, offset=end, consumed=cur.consumed + self.batch_size)
        return PromptBatch(prompts=tuple(self.records[i] for i in order),
                           group_ids=tuple(range(cur.consumed, cur.consumed + self.batch_size)),
                           epoch_end=epoch_end, cursor_after=self.cursor)

"""The coordinator's data source: prompts from a task file, shuffled per epoch, with a resumable cursor.

Rollout services keep no cursor; the coordinator hands them the prompts of each step, so the cursor
saved with a checkpoint fully determines which prompts come next after a resume.

A prompt is text (sent as it is, tokenized with the tokenizer's special tokens) or a chat: a list of
{role, content} messages that the rollout renders with the chat template (docs/own-task.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from services.contracts.chat_messages import ChatMessage
from services.contracts.config import DataConfig
from services.contracts.rollout_calls import PromptInput
from services.contracts.sampling_spec import prompt_max_new_tokens
from services.contracts.untyped import JsonObject, JsonValue
from services.coordinator.datafiles import DataFile, data_file, read_rows


@dataclass(frozen=True)
class PromptRecord:
    text: str  # a text prompt ("" for a chat)
    label: str
    metadata: dict[str, str] = field(default_factory=dict)
    # its line (JSONL, 1-based) or row (parquet, HF dataset; 0-based) in the data file; 0 = not from a file
    line: int = field(default=0, compare=False)
    messages: tuple[ChatMessage, ...] = ()  # a chat prompt, the system prompt included

    def to_input(self, group_id: int) -> PromptInput:
        """The prompt as a Generate or an Evaluate sends it, as group `group_id`."""
        return PromptInput(
            text=self.text, label=self.label, group_id=group_id, metadata=dict(self.metadata), messages=self.messages
        )


@dataclass(frozen=True)
class DataCursor:
    epoch: int = 0
    offset: int = 0  # position inside this epoch's permutation
    consumed: int = 0  # prompts handed out since the start of the run (gives unique group ids)

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "consumed": self.consumed}

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> DataCursor:
        return cls(epoch=int(data["epoch"]), offset=int(data["offset"]), consumed=int(data["consumed"]))


@dataclass(frozen=True)
class PromptBatch:
    prompts: tuple[PromptRecord, ...]
    group_ids: tuple[int, ...]
    epoch_end: bool  # the last batch of an epoch (save point)
    cursor_after: DataCursor


_MISSING = object()
_to_json = json.JSONEncoder(default=str).encode  # one encoder for every row (json.dumps builds one per call)


def load_prompts(path: str, config: DataConfig, *, limit: int | None = None) -> list[PromptRecord]:
    """Every row of the file at `path` as a PromptRecord (data.prompt_key, label_key, chat_template, system_prompt
    of `config`); ValueError naming the file and line / row of the first bad one."""
    file = data_file(path)
    reader = _RowReader(config, file)
    records = []
    for position, row in read_rows(file):
        records.append(reader.record(row, position))
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise ValueError(f"data file {path} holds no prompts")
    return records


def lookup(row: JsonObject, key: str) -> JsonValue:
    """row[key], else the dotted path through nested objects (reward_model.ground_truth); _MISSING if absent."""
    if key in row:
        return row[key]
    node: JsonValue = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


@dataclass(frozen=True)
class _RowReader:
    config: DataConfig
    file: DataFile

    def record(self, row: JsonValue, position: int) -> PromptRecord:
        where, key = self.file.where(position), self.config.prompt_key
        prompt = lookup(row, key) if isinstance(row, dict) else _MISSING
        if prompt is _MISSING:
            keys = f" (its keys: {', '.join(map(str, row))})" if isinstance(row, dict) else ""
            raise ValueError(f"{where}: expected an object with key {key!r}{keys}")
        text, messages = self._prompt(prompt, where)
        skip = (key, self.config.label_key)
        metadata = {k: v if isinstance(v, str) else _to_json(v) for k, v in row.items() if k not in skip}
        prompt_max_new_tokens(metadata, where=where)  # a bad response budget is named with its line
        return PromptRecord(
            text=text,
            label=_label(lookup(row, self.config.label_key)),
            metadata=metadata,
            line=position,
            messages=messages,
        )

    def _prompt(self, value: JsonValue, where: str) -> tuple[str, tuple[ChatMessage, ...]]:
        config = self.config
        if isinstance(value, str):
            if not config.text_prompts_are_chats:
                return value, ()
            return "", self._with_system((ChatMessage("user", value),))
        if value is None:  # a table's column holds every key; this row has no value there
            raise ValueError(f"{where}: the prompt ({config.prompt_key}) is null")
        if not isinstance(value, list | tuple):
            raise ValueError(
                f"{where}: the prompt ({config.prompt_key}) is {type(value).__name__} {value!r:.60}; "
                "expected text or a list of chat messages {role, content}"
            )
        if config.chat_template == "none":
            raise ValueError(
                f"{where}: the prompt is a list of chat messages, and data.chat_template is none; set it "
                "to auto (the tokenizer's template) or a template file"
            )
        return "", self._with_system(_messages(value, where))

    def _with_system(self, messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
        """data.system_prompt goes first, unless the chat has a system message of its own (the row's wins)."""
        system = self.config.system_prompt
        if system is None or messages[0].role == "system":
            return messages
        return (ChatMessage("system", system), *messages)


def _messages(value: list[JsonValue] | tuple[JsonValue, ...], where: str) -> tuple[ChatMessage, ...]:
    if not value:
        raise ValueError(f"{where}: the prompt is an empty list of chat messages")
    out = []
    for i, message in enumerate(value):
        if (
            isinstance(message, dict)
            and len(message) == 2
            and isinstance(role := message.get("role"), str)
            and isinstance(content := message.get("content"), str)
        ):
            out.append(ChatMessage(role=role, content=content))  # the usual message, checked at the least cost
            continue
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(f"{where}: message {i} of the prompt is not {{role, content}} text: {message!r:.120}")
        extra = sorted(k for k, v in message.items() if k not in ("role", "content") and v is not None)
        if extra:
            raise ValueError(
                f"{where}: message {i} of the prompt has {', '.join(extra)}; a prompt's messages are "
                "role and content text"
            )
        out.append(ChatMessage(role=message["role"], content=message["content"]))
    return tuple(out)


def _label(value: JsonValue) -> str:
    if value is _MISSING or value is None:
        return ""
    if isinstance(value, list | dict):  # verl writes ground_truth lists at times: kept as JSON, not a repr
        return _to_json(value)
    return str(value)


def load_eval_prompts(config: DataConfig) -> list[PromptRecord]:
    """The eval set: data.eval_path (else the training set), at most data.eval_max_prompts of it."""
    return load_prompts(config.eval_path or config.train_path, config, limit=config.eval_max_prompts)


class DataSource:
    def __init__(self, records: list[PromptRecord], *, batch_size: int, shuffle: bool, seed: int, num_epochs: int):
        if batch_size > len(records):
            raise ValueError(
                f"rollout.rollout_batch_size ({batch_size}) is larger than the dataset ({len(records)} prompts)"
            )
        self.records = records
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.num_epochs = num_epochs
        self.cursor = DataCursor()

    @classmethod
    def from_config(cls, config: DataConfig, *, batch_size: int) -> DataSource:
        records = load_prompts(config.train_path, config)
        return cls(
            records, batch_size=batch_size, shuffle=config.shuffle, seed=config.seed, num_epochs=config.num_epochs
        )

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
        order = self._order(epoch)[offset : offset + self.batch_size]
        end = offset + self.batch_size
        epoch_end = end + self.batch_size > len(self.records)
        self.cursor = DataCursor(epoch=epoch, offset=end, consumed=cur.consumed + self.batch_size)
        return PromptBatch(
            prompts=tuple(self.records[i] for i in order),
            group_ids=tuple(range(cur.consumed, cur.consumed + self.batch_size)),
            epoch_end=epoch_end,
            cursor_after=self.cursor,
        )

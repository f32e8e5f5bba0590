"""Rows of a task file, whatever its format: JSON Lines, parquet, or a directory written by
`datasets.Dataset.save_to_disk`. The format is found from the path (a directory, the suffix, else the first bytes);
one that is none of these is named in one line. A row's position is its line in a JSONL file (1-based, as editors
count) or its row index in a table (0-based, as `dataset[i]` and `df.iloc[i]` count)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.contracts.untyped import JsonValue

Format = Literal["jsonl", "parquet", "hf_dataset"]
JSONL: Format = "jsonl"
PARQUET: Format = "parquet"
HF_DATASET: Format = "hf_dataset"
_SUFFIXES: dict[str, Format] = {".jsonl": JSONL, ".json": JSONL, ".ndjson": JSONL, ".parquet": PARQUET, ".pq": PARQUET}
_PARQUET_MAGIC = b"PAR1"
TABLE_BATCH = 8192  # rows converted to Python at a time (parquet and HF datasets)
SUPPORTED = "JSON Lines (.jsonl), parquet (.parquet) or a directory written by datasets' save_to_disk"


@dataclass(frozen=True)
class DataFile:
    path: str
    format: Format

    @property
    def unit(self) -> str:
        return "line" if self.format == JSONL else "row"

    def where(self, position: int) -> str:
        """How messages name a row: `file:12` for a JSONL line (as today), `file: row 12` for a table row."""
        return f"{self.path}:{position}" if self.format == JSONL else f"{self.path}: row {position}"


def data_file(path: str) -> DataFile:
    """The file at `path` and its format; FileNotFoundError or ValueError (one line) when it is unusable."""
    file = Path(path)
    if file.is_dir():
        return DataFile(path, _dataset_directory(file))
    if not file.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    with file.open("rb") as f:
        head = f.read(4096)
    fmt = _SUFFIXES.get(file.suffix.lower())
    if head.startswith(_PARQUET_MAGIC):
        if fmt == JSONL:
            raise ValueError(f"{path} is a parquet file (it starts with PAR1), not JSON Lines; name it .parquet")
        return DataFile(path, PARQUET)
    if fmt == PARQUET:
        raise ValueError(f"{path} is not a parquet file (it does not start with PAR1)")
    first = head.lstrip()[:1]
    if first == b"[":
        raise ValueError(
            f"{path} holds one JSON array; Tandem reads JSON Lines, one object per line (convert it "
            "with `jq -c '.[]' FILE`), or use parquet"
        )
    if fmt == JSONL or first in (b"{", b""):
        return DataFile(path, JSONL)
    raise ValueError(
        f"{path}: unsupported format ({file.suffix or 'no suffix'}, and it is not JSON Lines); use {SUPPORTED}"
    )


def _dataset_directory(path: Path) -> Format:
    if (path / "dataset_dict.json").is_file():
        splits = _json_field(path / "dataset_dict.json", "splits") or []
        example = f" (e.g. {path / splits[0]})" if splits else ""
        raise ValueError(
            f"{path} is a DatasetDict with splits {', '.join(map(str, splits)) or '?'}: point the path "
            f"at one split's directory{example}"
        )
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return HF_DATASET
    raise ValueError(
        f"{path} is a directory but not a saved Hugging Face dataset (no state.json and "
        f"dataset_info.json); use {SUPPORTED}"
    )


def _json_field(path: Path, key: str) -> JsonValue:
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def read_rows(file: DataFile) -> Iterator[tuple[int, JsonValue]]:
    """(position, row) for every row; a blank JSONL line is skipped. ValueError naming the line of bad JSON."""
    match file.format:
        case "jsonl":
            yield from _jsonl_rows(file.path)
        case "parquet":
            yield from _parquet_rows(file.path)
        case "hf_dataset":
            yield from _hf_dataset_rows(file.path)


def _jsonl_rows(path: str) -> Iterator[tuple[int, JsonValue]]:
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            line = _decode_line(raw, path=path, line_no=line_no)
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON: {exc}") from None


def _decode_line(raw: bytes, *, path: str, line_no: int) -> str:
    """UTF-8, whatever the locale; a bad byte is named with its file, line and column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}:{line_no}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
            "task files must be UTF-8 JSON lines"
        ) from None


def _parquet_rows(path: str) -> Iterator[tuple[int, JsonValue]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
        batches = table.iter_batches(batch_size=TABLE_BATCH)
        position = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield position, row
                position += 1
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable parquet file: {exc}") from None


def _hf_dataset_rows(path: str) -> Iterator[tuple[int, JsonValue]]:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{path} is a saved Hugging Face dataset; reading it needs the datasets package: "
            "pip install 'tandem-rl[datasets]'"
        ) from None
    dataset = datasets.load_from_disk(path)
    position = 0
    for batch in dataset.iter(batch_size=TABLE_BATCH):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns), strict=True):
            yield position, dict(zip(columns, values, strict=True))
            position += 1

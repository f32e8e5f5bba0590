"""The tokenizer of a run, as the rollout service and `tandem run`'s preflight both use it: a light module (no torch,
no engine), so checking a data file before the run does not pay for importing the rollout service."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load_tokenizer(path: str | Path) -> Any:
    """PreTrainedTokenizerFast when the directory has a tokenizer.json: it decodes exactly what the file
    says (AutoTokenizer swaps in a ByteLevel decoder for `qwen2` directories under transformers 5.x)."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    # only here: importing AutoTokenizer imports torch (transformers' configuration_utils), seconds on a GPU host
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def prompt_token_ids(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Prompt texts as the engine gets them (with the tokenizer's BOS): the rollout service and preflight both. A
    fast tokenizer's Rust backend directly: the Python wrapper around it costs 4x as much per prompt."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        return [encoding.ids for encoding in backend.encode_batch(list(texts), add_special_tokens=True)]
    # verbose=False: no "longer than the maximum" warning per prompt; the engine and preflight check the context
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=True, verbose=False)["input_ids"]]


class Texts:
    """A tokenizer shared by a service's gRPC threads: a fast tokenizer reconfigures its Rust backend on every
    call, so concurrent calls would collide ("Already borrowed"); they are serialised here."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as the engine gets it (with the tokenizer's BOS)."""
        with self._lock:
            return prompt_token_ids(self.tokenizer, [text])[0]

    def encode_text(self, text: str) -> list[int]:
        """Text inside a sequence (an observation): no special tokens."""
        with self._lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        with self._lock:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

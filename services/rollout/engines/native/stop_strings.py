"""Stop strings in the native engine: a sample ends at the token whose text completes one of them.

As SGLang does it (Req.check_finished, 0.5.x): after a token, the text of the sample's last few generated tokens is
decoded (special tokens kept) and searched for each stop string; the token that completes a string ends the sample,
is kept whole (also when the string ends inside it) and the finish reason is stop. The tokens stay exactly as
generated: the trainer sees them, with their log-probs, and the response text holds the stop string.

Cheap where it matters: nothing runs unless the request names stop strings; a token can only complete a string if
its own text holds the string's last character (or a partial UTF-8 byte, or when a string ends in whitespace, any
token), so only rows whose new token is such a candidate are decoded, and only their last `window` tokens. The
candidate table is built once per set of strings from the text of every vocabulary entry (under a second for 152k
entries). The static decode path scans every few tokens and cuts a row back to the token that completed a string.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import torch

_KEEP_TABLES = 4  # candidate tables cached per engine (one per distinct set of stop strings)


class Detokenizer(Protocol):
    """What the matcher needs of a tokenizer (services.rollout.tokenizer.Texts implements it)."""

    def decode_raw(self, sequences: Sequence[Sequence[int]]) -> list[str]:
        """Each token sequence as text, special tokens included."""

    @property
    def vocab_size(self) -> int:
        """Token ids [0, vocab_size) have text."""


class StopStrings:
    """The stop strings of one request over one engine's vocabulary (see the module docstring)."""

    def __init__(self, stop: Sequence[str], *, detokenizer: Detokenizer, candidates: torch.Tensor):
        self.stop = tuple(stop)
        self.detokenizer = detokenizer
        self.candidates = candidates  # bool [vocab] on the engine's device
        # a token holds >= 1 byte of text, so the tokens spanning a string are at most its byte length
        self.window = max(len(s.encode("utf-8")) for s in self.stop) + 1

    def scan(self, tokens: torch.Tensor, lengths: torch.Tensor, start: int, end: int) -> dict[int, int]:
        """Generated positions [start, end) of every row of `tokens` [n, steps] (those before the row's length), in
        order: {row: the position of the token that completes a stop string first}. One host sync when no row's
        token there is a candidate."""
        positions = torch.arange(start, end, device=tokens.device)
        cand = self.candidates[tokens[:, start:end]] & (positions[None, :] < lengths[:, None])
        if not bool(cand.any()):
            return {}
        hits = [(row, start + offset) for row, offset in cand.nonzero().tolist()]  # row-major: positions ascending
        first: dict[int, int] = {}
        for row, p in self._completing(tokens, hits):
            first.setdefault(row, p)
        return first

    def completed(self, tokens: torch.Tensor, lengths: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Rows (bool [n]) among `live` whose last token (at lengths - 1, rows at their own positions: continuous
        batching) completes a stop string."""
        last = (lengths - 1).clamp(min=0)
        cand = live & (lengths > 0) & self.candidates[tokens.gather(1, last.unsqueeze(-1)).squeeze(-1)]
        ended = torch.zeros_like(live)
        if not bool(cand.any()):
            return ended
        rows = cand.nonzero().flatten().tolist()
        hits = list(zip(rows, last[rows].tolist(), strict=True))
        matched = [row for row, _ in self._completing(tokens, hits)]
        if matched:
            ended[torch.tensor(matched, dtype=torch.long, device=ended.device)] = True
        return ended

    def _completing(self, tokens: torch.Tensor, hits: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The (row, position) of `hits` whose text, the last `window` tokens up to that position, holds a string."""
        hit_rows = sorted({row for row, _ in hits})
        lo = max(0, min(p for _, p in hits) + 1 - self.window)
        hi = max(p for _, p in hits) + 1
        index = torch.tensor(hit_rows, dtype=torch.long, device=tokens.device)
        fetched = dict(zip(hit_rows, tokens[index, lo:hi].cpu().tolist(), strict=True))
        windows = [fetched[row][max(lo, p + 1 - self.window) - lo : p + 1 - lo] for row, p in hits]
        texts = self.detokenizer.decode_raw(windows)
        return [hit for hit, text in zip(hits, texts, strict=True) if any(s in text for s in self.stop)]


class StopStringTables:
    """One engine's candidate tables, built when a set of stop strings is first asked for and kept (a few)."""

    def __init__(self, detokenizer: Detokenizer, *, vocab_size: int, device: torch.device):
        self.detokenizer = detokenizer
        self.vocab_size = vocab_size  # the model's: it may hold ids past the tokenizer's last (never text)
        self.device = device
        self._texts: list[str] | None = None  # every vocabulary entry's text, computed once
        self._tables: OrderedDict[tuple[str, ...], torch.Tensor] = OrderedDict()

    def for_request(self, stop: Sequence[str]) -> StopStrings:
        key = tuple(stop)
        table = self._tables.pop(key, None)
        if table is None:
            table = self._candidates(key)
            while len(self._tables) >= _KEEP_TABLES:
                self._tables.popitem(last=False)
        self._tables[key] = table
        return StopStrings(key, detokenizer=self.detokenizer, candidates=table)

    def _candidates(self, stop: tuple[str, ...]) -> torch.Tensor:
        table = torch.zeros(self.vocab_size, dtype=torch.bool)
        known = min(self.vocab_size, self.detokenizer.vocab_size)
        if any(s[-1].isspace() for s in stop):  # decoders may drop a token's leading space when it stands alone
            table[:known] = True
            return table.to(self.device)
        if self._texts is None:
            self._texts = self.detokenizer.decode_raw([[i] for i in range(known)])
        last = {s[-1] for s in stop} | {"\ufffd"}
        table[:known] = torch.tensor([any(c in text for c in last) for text in self._texts], dtype=torch.bool)
        return table.to(self.device)

"""The tokenizer of a run, as the rollout service and `tandem run`'s preflight both use it: a light module (no torch,
no engine), so checking a data file before the run does not pay for importing the rollout service."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from services.contracts.chat_messages import ChatMessage
from services.contracts.untyped import JsonValue
from services.rollout.chat_template import ChatTemplate, ChatTemplateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """PreTrainedTokenizerFast when the directory has a tokenizer.json: it decodes exactly what the file
    says (AutoTokenizer swaps in a ByteLevel decoder for `qwen2` directories under transformers 5.x)."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    # only here: importing AutoTokenizer imports torch (transformers' configuration_utils), seconds on a GPU host
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def end_of_generation_ids(model_dir: str | Path, tokenizer: PreTrainedTokenizerBase | None) -> tuple[int, ...]:
    """Every id that ends a sample: generation_config.json's eos_token_id (an id or a list: Qwen2.5-Instruct ends on
    <|im_end|> and <|endoftext|>, Llama-3.2-Instruct on three ids), config.json's, and the tokenizer's eos. Files the
    directory lacks (a tokenizer-only directory, a model that lives on the SGLang host) add nothing."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        try:
            value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        except (OSError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path} is not a readable JSON object: {exc}") from None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    return tuple(sorted(ids))


class PromptLike(Protocol):
    """A prompt as the data file gives it (PromptRecord) or a request carries it (PromptInput)."""

    @property
    def text(self) -> str: ...

    @property
    def messages(self) -> Sequence[ChatMessage]: ...


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], *, special_tokens: bool) -> list[list[int]]:
    """Token ids of texts, with the tokenizer's special tokens (its BOS) or without. A fast tokenizer's Rust backend
    directly: the Python wrapper around it costs 4x as much per prompt."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        return [encoding.ids for encoding in backend.encode_batch(list(texts), add_special_tokens=special_tokens)]
    # verbose=False: no "longer than the maximum" warning per prompt; the engine and preflight check the context
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=special_tokens, verbose=False)["input_ids"]]


def prompt_texts(chat: ChatTemplate, prompts: Sequence[PromptLike]) -> list[str]:
    """Each prompt as the model reads it: its text, or a chat rendered with the template. ChatTemplateError.index
    names the prompt a template failed on."""
    chats = [i for i, p in enumerate(prompts) if p.messages]
    texts = [p.text for p in prompts]
    try:
        rendered = chat.render([prompts[i].messages for i in chats])
    except ChatTemplateError as exc:
        raise ChatTemplateError(str(exc), index=None if exc.index is None else chats[exc.index]) from None
    for i, text in zip(chats, rendered, strict=True):
        texts[i] = text
    return texts


def encode_prompt_texts(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], chats: Sequence[bool]
) -> list[list[int]]:
    """Token ids of prompt texts: a text prompt's with the tokenizer's special tokens, a rendered chat's without
    them (chat_template.py says why)."""
    ids: list[list[int]] = [[] for _ in texts]
    for special in (True, False):
        group = [i for i, chat in enumerate(chats) if chat != special]
        for i, encoded in zip(
            group, encode_texts(tokenizer, [texts[i] for i in group], special_tokens=special), strict=True
        ):
            ids[i] = encoded
    return ids


def model_inputs(
    tokenizer: PreTrainedTokenizerBase, chat: ChatTemplate, prompts: Sequence[PromptLike]
) -> tuple[list[str], list[list[int]]]:
    """Each prompt as the model reads it, as text and token ids; the rollout service and preflight both."""
    texts = prompt_texts(chat, prompts)
    return texts, encode_prompt_texts(tokenizer, texts, [bool(p.messages) for p in prompts])


# Normalizers that leave ASCII text as it is (so its bytes bound the token count; length_bounds)
_ASCII_PRESERVING = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "StripAccents", "BertNormalizer"}


def length_bounds(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], chats: Sequence[bool]) -> list[int | None]:
    """An upper bound of each prompt's token count, where one is cheap to know (None where not): a token covers at
    least one byte of the normalized text, so its UTF-8 length bounds the count, plus a prefix space or `▁` a
    pre-tokenizer may add and the special tokens a text prompt gets. Known where the tokenizer has no normalizer,
    or one that leaves ASCII text as it is and the text is ASCII. Counting bytes costs ~0.1 µs a prompt; encoding
    one, ~100 µs."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return [None] * len(texts)
    normalizer = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else None
    kinds = {n.get("type") for n in normalizer.get("normalizers", [normalizer])} if normalizer else set()
    ascii_only = bool(kinds)
    if kinds - _ASCII_PRESERVING:
        return [None] * len(texts)
    specials = len(encode_texts(tokenizer, [""], special_tokens=True)[0])
    return [
        None if ascii_only and not text.isascii() else len(text.encode()) + 4 + (0 if chat else specials)
        for text, chat in zip(texts, chats, strict=True)
    ]


class Texts:
    """A tokenizer shared by a service's gRPC threads: a fast tokenizer reconfigures its Rust backend on every
    call, so concurrent calls would collide ("Already borrowed"); they are serialised here."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat: ChatTemplate):
        self.tokenizer = tokenizer
        self.chat = chat
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def observation_role(self) -> str:
        return self.chat.observation_role

    def model_inputs(self, prompts: Sequence[PromptLike]) -> tuple[list[str], list[list[int]]]:
        with self._lock:
            return model_inputs(self.tokenizer, self.chat, prompts)

    def encode_text(self, text: str) -> list[int]:
        """Text inside a sequence (an observation): no special tokens."""
        with self._lock:
            return encode_texts(self.tokenizer, [text], special_tokens=False)[0]

    def chat_prompt_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        """A chat rendered as a prompt (a multi-turn episode's, with its reset observation as the last message)."""
        with self._lock:
            [text] = self.chat.render([messages])
            return encode_texts(self.tokenizer, [text], special_tokens=False)[0]

    def observation_ids(self, message: ChatMessage, *, turn: Sequence[int], turn_ended: bool) -> list[int]:
        """An observation after the policy turn `turn` as a message of the chat (ChatTemplate.observation_text);
        `turn_ended`: the turn's last token ended it (EOS or a stop token) rather than a length limit."""
        with self._lock:
            end = self._decode(turn[-1:], skip_special_tokens=False) if turn_ended else ""
            text = self.chat.observation_text(message, turn_end=end)
            return encode_texts(self.tokenizer, [text], special_tokens=False)[0]

    def chat_ids(self, messages: Sequence[Mapping[str, JsonValue]], *, tools: JsonValue = None) -> list[int]:
        """OpenAI-style messages (tool calls, tool results) as a prompt, with the template's `tools` argument."""
        with self._lock:
            text = self.chat.render_messages(messages, tools=tools)
            return encode_texts(self.tokenizer, [text], special_tokens=False)[0]

    def continuation_ids(
        self, messages: Sequence[Mapping[str, JsonValue]], *, turn: Sequence[int], turn_ended: bool, tools: JsonValue
    ) -> list[int]:
        """`messages` after the policy turn `turn`, up to the next assistant header (ChatTemplate.continuation_text);
        only these tokens are encoded, the turn's own are kept as generated."""
        with self._lock:
            end = self._decode(turn[-1:], skip_special_tokens=False) if turn_ended else ""
            text = self.chat.continuation_text(messages, turn_end=end, tools=tools)
            return encode_texts(self.tokenizer, [text], special_tokens=False)[0]

    def encode_prompt_text(self, text: str) -> list[int]:
        """A text prompt as the data path encodes it (with the tokenizer's BOS)."""
        with self._lock:
            return encode_texts(self.tokenizer, [text], special_tokens=True)[0]

    def decode(self, token_ids: Sequence[int]) -> str:
        with self._lock:
            return self._decode(token_ids, skip_special_tokens=True)

    def _decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if not isinstance(text, str):  # transformers types decode's answer as str | list[str]: one sequence, one str
            raise TypeError(f"the tokenizer decoded one sequence into {type(text).__name__}")
        return text

    def decode_raw(self, sequences: Sequence[Sequence[int]]) -> list[str]:
        """Each sequence as text with its special tokens (what stop strings are matched against, as SGLang does)."""
        seqs = [list(s) for s in sequences]
        backend = (
            getattr(self.tokenizer, "backend_tokenizer", None) if getattr(self.tokenizer, "is_fast", False) else None
        )
        with self._lock:
            if backend is not None:
                return list(backend.decode_batch(seqs, skip_special_tokens=False))
            return [self._decode(s, skip_special_tokens=False) for s in seqs]


def tokenizer_mismatch(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> str | None:
    """Why the teacher cannot score the student's token ids (it would read them as other text), or None: the
    vocabularies (token -> id, added tokens included) must be equal. Chat templates and which token plays EOS may
    differ: the teacher only scores the student's ids, it never renders or generates."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        differ = sorted(tok for tok in s_vocab.keys() | t_vocab.keys() if s_vocab.get(tok) != t_vocab.get(tok))
        shown = ", ".join(f"{tok!r}: {s_vocab.get(tok)} vs {t_vocab.get(tok)}" for tok in differ[:3])
        return (
            f"its vocabulary differs from the student's ({len(s_vocab)} vs {len(t_vocab)} tokens, {len(differ)} "
            f"mapped differently; student id vs teacher id: {shown})"
        )
    return None

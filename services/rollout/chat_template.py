"""The chat template of a run (data.chat_template): chat prompts rendered to text, and a multi-turn episode's
observations rendered as turns of the conversation.

Rendering is the tokenizer's own `apply_chat_template` (transformers' Jinja sandbox, torch-free), with
add_generation_prompt=True and data.chat_template_kwargs. The text it gives is encoded without the tokenizer's
special tokens: a template that wants a BOS writes it (Llama 3's `<|begin_of_text|>`), so the tokenizer must not
add a second one (HF's own `apply_chat_template(tokenize=True)` encodes the same way).

An observation after a policy turn is the text the template puts after an assistant message's content when that
message is followed by the observation's message and the next generation prompt: the end of the assistant turn
(`<|im_end|>\\n`), the observation's turn, the next assistant header. It is rendered around placeholder messages,
never around the episode's real history, and only its own tokens are encoded: the tokens of earlier turns are the
ones the engine generated or was fed, never re-encoded from text (re-encoding a conversation splits text
differently from how it was sampled: prime-rl #1334, verl #2618). When the turn already ended with the template's
end-of-turn token (the model emitted `<|im_end|>`), that token is not added again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from services.contracts.chat_messages import ChatMessage
from services.contracts.config import TandemConfig
from services.contracts.untyped import JsonValue

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_USER_PLACEHOLDER = "Tandem placeholder question"
_TURN_PLACEHOLDER = "Tandem placeholder answer"


class ChatTemplateError(ValueError):
    """The template is missing, unreadable, or fails on a conversation. `index`: which conversation of a batch."""

    def __init__(self, message: str, *, index: int | None = None):
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class ChatTemplate:
    tokenizer: PreTrainedTokenizerBase = field(repr=False)
    source: str  # how messages name the template
    template: str | None = None  # data.chat_template's file text; None = the tokenizer's own
    kwargs: Mapping[str, JsonValue] = field(default_factory=dict)  # data.chat_template_kwargs
    observation_role: str = "user"
    mode: str = "auto"  # data.chat_template, for messages

    @classmethod
    def from_config(cls, tokenizer: PreTrainedTokenizerBase, config: TandemConfig) -> ChatTemplate:
        data = config.data
        file = data.chat_template_file
        kwargs, role = dict(data.chat_template_kwargs), config.rollout.observation_role
        if file is None:
            where = config.model.tokenizer_path or config.model.path
            return cls(
                tokenizer,
                source=f"the chat template of the tokenizer at {where}",
                kwargs=kwargs,
                observation_role=role,
                mode=data.chat_template,
            )
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"data.chat_template: cannot read {file}: {exc}") from None
        return cls(
            tokenizer,
            source=f"the chat template {file} (data.chat_template)",
            template=text,
            kwargs=kwargs,
            observation_role=role,
        )

    @property
    def available(self) -> bool:
        return self.template is not None or bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, conversations: Sequence[Sequence[ChatMessage]]) -> list[str]:
        """Each conversation as the model reads it, ending with the generation prompt of the assistant's turn."""
        if not conversations:
            return []
        try:
            return self._apply([[m.as_dict() for m in c] for c in conversations])
        except ChatTemplateError:
            raise
        except Exception:
            for i, conversation in enumerate(conversations):
                try:
                    self._apply([[m.as_dict() for m in conversation]])
                except Exception as exc:  # noqa: BLE001 - named with the conversation below
                    raise ChatTemplateError(f"{self.source} failed: {type(exc).__name__}: {exc}", index=i) from None
            raise

    def observation_text(self, message: ChatMessage, *, turn_end: str = "") -> str:
        """The text after a policy turn that shows `message` and opens the next assistant turn. `turn_end`: the text
        of the turn's last token when that token ended it (an EOS or a stop token), "" when it was cut."""
        return self._tail(
            [message.as_dict()],
            turn_end=turn_end,
            tools=None,
            what=f"an observation as a {message.role!r} message",
            hint=" (set rollout.observation_role, or return {'role': ..., 'content': ...} from the environment)",
        )

    def continuation_text(
        self, messages: Sequence[Mapping[str, JsonValue]], *, turn_end: str = "", tools: JsonValue = None
    ) -> str:
        """The text after a policy turn that shows `messages` (OpenAI-style dicts: tool results, a user's reply) and
        opens the next assistant turn; `tools` as the chat template's `tools` argument. `turn_end` as in
        observation_text."""
        roles = ", ".join(repr(m.get("role")) for m in messages)
        return self._tail(messages, turn_end=turn_end, tools=tools, what=f"{roles} message(s) after a turn", hint="")

    def _tail(
        self, messages: Sequence[Mapping[str, JsonValue]], *, turn_end: str, tools: JsonValue, what: str, hint: str
    ) -> str:
        """Rendered around placeholder messages; only the text after the placeholder answer is kept."""
        base: list[Mapping[str, JsonValue]] = [
            {"role": "user", "content": _USER_PLACEHOLDER},
            {"role": "assistant", "content": _TURN_PLACEHOLDER},
        ]
        try:
            [rendered] = self._apply([[*base, *messages]], tools=tools)
        except ChatTemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 - the template refused the role, typically
            raise ChatTemplateError(f"{self.source} cannot render {what}: {type(exc).__name__}: {exc}{hint}") from None
        at = rendered.find(_TURN_PLACEHOLDER)
        if at < 0:
            raise ChatTemplateError(
                f"{self.source} does not show an assistant message's content as it is, so "
                "observations cannot be added after a turn"
            )
        tail = rendered[at + len(_TURN_PLACEHOLDER) :]
        return tail[len(turn_end) :] if turn_end and tail.startswith(turn_end) else tail

    def render_messages(self, messages: Sequence[Mapping[str, JsonValue]], *, tools: JsonValue = None) -> str:
        """One conversation of OpenAI-style dicts (tool calls, tool results) as the model reads it, with `tools`."""
        try:
            [rendered] = self._apply([list(messages)], tools=tools)
        except ChatTemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 - named for the caller
            raise ChatTemplateError(f"{self.source} failed: {type(exc).__name__}: {exc}", index=0) from None
        return rendered

    def _apply(
        self, conversations: Sequence[Sequence[Mapping[str, JsonValue]]], *, tools: JsonValue = None
    ) -> list[str]:
        if not self.available:
            tokenizer = self.source.removeprefix("the chat template of ")
            raise ChatTemplateError(
                f"data.chat_template is {self.mode}, and {tokenizer} has no chat template; set "
                "data.chat_template to a Jinja template file, or give text prompts"
            )
        extra = {"tools": tools} if tools else {}
        out = self.tokenizer.apply_chat_template(
            [[dict(m) for m in c] for c in conversations],
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=True,
            **self.kwargs,
            **extra,
        )
        return list(out)

"""What the rollout service checks in a request before any work, and its prompts as the model reads them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.contracts.rollout_calls import PromptInput
from services.rollout.chat_template import ChatTemplateError
from services.rollout.engines.interface import Engine
from services.rollout.tokenizer import Texts


@dataclass(frozen=True)
class ModelInputs:
    """Prompts as the model reads them: token ids, and text (a chat's as the template rendered it)."""

    ids: list[list[int]]
    texts: list[str]


def check_request_size(what: str, prompts: int, n: int | None, default: int, *, limit: int) -> None:
    """Refuses a request before any work: its samples are allocated at once, so a huge one is an outage."""
    total = prompts * (n or default)
    if total > limit:
        raise ValueError(
            f"{what}: {prompts} prompts x {n or default} samples = {total} samples, more than "
            f"rollout.max_request_samples ({limit})"
        )


def check_group_ids(what: str, prompts: Sequence[PromptInput]) -> None:
    """Each prompt of one request is its own group: the trainer's group baseline is per group id."""
    group_ids = [p.group_id for p in prompts]
    if len(set(group_ids)) != len(group_ids):
        dup = next(g for g in group_ids if group_ids.count(g) > 1)
        raise ValueError(f"{what}: several prompts share group_id {dup}; each prompt needs its own group id")


def model_inputs(texts: Texts, prompts: Sequence[PromptInput]) -> ModelInputs:
    """Token ids as given; a chat rendered with the chat template; text with the tokenizer's special tokens. The
    text a reward sees: the prompt's text, a chat's rendering, or the given ids decoded."""
    for i, p in enumerate(prompts):
        if not (p.token_ids or p.messages or p.text):
            raise ValueError(f"prompt {i} (group_id {p.group_id}) is empty: give text, messages or token_ids")
    to_encode = [i for i, p in enumerate(prompts) if not p.token_ids]
    try:
        encoded_texts, encoded_ids = texts.model_inputs([prompts[i] for i in to_encode])
    except ChatTemplateError as exc:
        which = f"prompt {to_encode[exc.index]}: " if exc.index is not None else ""
        raise ValueError(f"{which}{exc}") from None
    ids = [[int(x) for x in p.token_ids] for p in prompts]
    shown = [p.text or (texts.decode(p.token_ids) if p.token_ids else "") for p in prompts]
    for i, text, encoded in zip(to_encode, encoded_texts, encoded_ids, strict=True):
        ids[i], shown[i] = encoded, text
    return ModelInputs(ids=ids, texts=shown)


def validated_inputs(texts: Texts, engine: Engine, prompts: Sequence[PromptInput]) -> ModelInputs:
    """The prompts as the model reads them, each one the engine can generate from (ValueError naming the first that
    it cannot)."""
    inputs = model_inputs(texts, prompts)
    engine.validate_prompts(inputs.ids)
    return inputs

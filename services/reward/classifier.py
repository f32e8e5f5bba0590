"""`type: classifier`: a Hugging Face sequence classifier (AutoModelForSequenceClassification).

Each sample is rendered as a chat (prompt messages, then the response as the assistant's turn) with the model's own
tokenizer's chat template, tokenized as transformers' text-classification pipeline tokenizes a text, cut from the
left to `max_length`, and scored in batches of at most `max_batch_tokens` padded tokens (samples sorted by length, so
a batch pads little). The score is the raw logit `score_index`; `sub_scores` names the head's logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.contracts.reward_calls import RewardSample, ScoreResult, SubScores
from services.contracts.reward_config import ClassifierModelConfig
from services.reward.models import chat_of

if TYPE_CHECKING:
    import torch

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


@dataclass(frozen=True)
class Batch:
    """Sample indices whose padded length times count fits the token budget."""

    indices: tuple[int, ...]
    width: int


def token_batches(lengths: Sequence[int], max_batch_tokens: int) -> list[Batch]:
    """Indices grouped by ascending length so that len(batch) * its longest <= max_batch_tokens (one sample alone
    when it is longer than the budget)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[Batch] = []
    current: list[int] = []
    for i in order:
        width = lengths[i]  # ascending: the newest is the longest
        if current and (len(current) + 1) * width > max_batch_tokens:
            batches.append(Batch(tuple(current), lengths[current[-1]]))
            current = []
        current.append(i)
    if current:
        batches.append(Batch(tuple(current), lengths[current[-1]]))
    return batches


class ClassifierModel:
    type = "classifier"

    def __init__(self, config: ClassifierModelConfig, *, device: torch.device):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.config = config
        self.path = config.path
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.path)
        model = AutoModelForSequenceClassification.from_pretrained(config.path, dtype=getattr(torch, config.dtype))
        self.model = model.to(device).eval().requires_grad_(False)
        labels = int(self.model.config.num_labels)
        if config.score_index >= labels:
            raise ValueError(f"score_index {config.score_index}: the model at {config.path} has {labels} logits")
        if len(config.sub_scores) > labels:
            raise ValueError(f"sub_scores names {len(config.sub_scores)} logits; the model has {labels}")
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        if pad is None:
            raise ValueError(f"the tokenizer at {config.path} has neither a pad nor an eos token to pad batches with")
        self.pad_token_id = int(pad)
        if self.model.config.pad_token_id is None:  # the head reads the last non-pad token of each row
            self.model.config.pad_token_id = self.pad_token_id
        if config.chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer at {config.path} has no chat template; set chat_template: false to score prompt "
                "text + response"
            )

    def text(self, sample: RewardSample) -> str:
        if not self.config.chat_template:
            return sample.prompt + sample.response
        rendered = self.tokenizer.apply_chat_template(chat_of(sample), tokenize=False)
        if not isinstance(rendered, str):
            raise TypeError("the chat template rendered one conversation into more than one text")
        return rendered

    def encode(self, samples: Sequence[RewardSample]) -> list[list[int]]:
        """As the text-classification pipeline tokenizes (special tokens added), cut from the left to max_length."""
        texts = [self.text(s) for s in samples]
        ids = self.tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
        return [list(row)[-self.config.max_length :] for row in ids]

    def score(self, samples: Sequence[RewardSample]) -> ScoreResult:
        import torch

        ids = self.encode(samples)
        logits: list[list[float]] = [[] for _ in ids]
        for batch in token_batches([len(r) for r in ids], self.config.max_batch_tokens):
            rows = torch.full((len(batch.indices), batch.width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(rows)
            for j, i in enumerate(batch.indices):  # right padding: the head reads each row's last real token
                rows[j, : len(ids[i])] = torch.tensor(ids[i])
                mask[j, : len(ids[i])] = 1
            with torch.inference_mode():
                out = self.model(input_ids=rows.to(self.device), attention_mask=mask.to(self.device)).logits
            for j, i in enumerate(batch.indices):
                logits[i] = out[j].float().cpu().tolist()
        cfg = self.config
        return ScoreResult(
            scores=tuple(row[cfg.score_index] for row in logits),
            sub_scores={name: SubScores(tuple(row[k] for row in logits)) for k, name in enumerate(cfg.sub_scores)},
            tokens=sum(len(r) for r in ids),
        )

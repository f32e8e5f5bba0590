"""The model families `tandem init-model` builds at their real shapes: Qwen2.5, Qwen3 and Llama-3.2.

One table of facts, read from each model's Hugging Face config.json / generation_config.json / tokenizer_config.json
(Qwen/Qwen2.5-0.5B-Instruct, Qwen/Qwen2.5-1.5B-Instruct, Qwen/Qwen3-0.6B, meta-llama/Llama-3.2-1B-Instruct): the body
shape, rope, tying, the vocabulary size and where the special tokens sit in it, which ids end a generation, and the
chat template. init_model.py builds the model from it and bpe_tokenizer.py the tokenizer; the tests compare both with
the table. No torch or transformers here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# The pre-tokenizer regexes of the real tokenizer.json files: Qwen splits numbers into single digits, Llama-3 into
# groups of up to three.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML as Qwen writes it, without Qwen2.5's default system prompt and tool blocks (a prompt of the local tokenizer
# stays short; a real Qwen directory brings its own template).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama-3's header format, without Llama-3.2's dated system block and tool blocks.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_QWEN25_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Added to the vocabulary but not special (decoding keeps them), as in the real tokenizer.json files.
_QWEN25_PLAIN = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
_QWEN3_PLAIN = (*_QWEN25_PLAIN, "<tool_response>", "</tool_response>", "<think>", "</think>")


def _llama3_specials() -> tuple[str, ...]:
    """Llama-3.1/3.2's 256 special tokens, ids 128000..128255."""
    named = {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        4: "<|finetune_right_pad_id|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        8: "<|eom_id|>",
        9: "<|eot_id|>",
        10: "<|python_tag|>",
    }
    out, reserved = [], 0
    for i in range(256):
        if i in named:
            out.append(named[i])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return tuple(out)


@dataclass(frozen=True)
class Family:
    """A tokenizer layout: ids [0, first_special) are byte-level BPE tokens, then `specials` (special: skipped by
    `decode(skip_special_tokens=True)`) and `plain` added tokens in this order, then reserved special tokens up to
    `vocab_size` (the size of the embedding matrix)."""

    name: str
    vocab_size: int
    first_special: int
    specials: tuple[str, ...]
    plain: tuple[str, ...]
    split_regex: str
    bos: str | None
    eos: str  # the tokenizer's eos: the end of an assistant turn
    pad: str | None
    generation_eos: tuple[str, ...]  # generation_config.json's eos_token_id, in its order
    chat_template: str
    tokenizer_class: str
    nfc: bool  # Qwen normalises to NFC; Llama-3 does not normalise
    ignore_merges: bool  # Llama-3's BPE takes a whole pre-token found in the vocabulary as it is

    @property
    def added(self) -> tuple[str, ...]:
        """The added tokens of the real vocabulary, in id order from first_special."""
        if self.name == "llama3":
            return self.specials
        return (*self.specials, *self.plain)

    def token_id(self, token: str) -> int:
        return self.first_special + self.added.index(token)

    @property
    def generation_eos_ids(self) -> tuple[int, ...]:
        return tuple(self.token_id(t) for t in self.generation_eos)

    @property
    def reserved(self) -> int:
        """Reserved special tokens that fill the vocabulary up to vocab_size."""
        return self.vocab_size - self.first_special - len(self.added)


QWEN25 = Family(
    name="qwen2.5",
    vocab_size=151_936,
    first_special=151_643,
    specials=_QWEN25_SPECIALS,
    plain=_QWEN25_PLAIN,
    split_regex=QWEN_SPLIT,
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    generation_eos=("<|im_end|>", "<|endoftext|>"),
    chat_template=CHATML_TEMPLATE,
    tokenizer_class="Qwen2Tokenizer",
    nfc=True,
    ignore_merges=False,
)
QWEN3 = replace(QWEN25, name="qwen3", plain=_QWEN3_PLAIN)  # the same specials and template
LLAMA3 = Family(
    name="llama3",
    vocab_size=128_256,
    first_special=128_000,
    specials=_llama3_specials(),
    plain=(),
    split_regex=LLAMA3_SPLIT,
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
    pad=None,
    generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
    chat_template=LLAMA3_TEMPLATE,
    tokenizer_class="PreTrainedTokenizerFast",
    nfc=False,
    ignore_merges=True,
)


@dataclass(frozen=True)
class ModelPreset:
    """A real model's shape (config.json), built as `model_type`. `bos` / `eos` name config.json's ids."""

    name: str
    model_type: str  # qwen2 | qwen3 | llama
    family: Family
    shape: dict[str, Any] = field(hash=False)
    tie_word_embeddings: bool = True
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    config_bos: str = "<|endoftext|>"
    config_eos: tuple[str, ...] = ("<|im_end|>",)


MODEL_PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            "qwen2.5-0.5b",
            "qwen2",
            QWEN25,
            dict(
                hidden_size=896,
                intermediate_size=4864,
                num_hidden_layers=24,
                num_attention_heads=14,
                num_key_value_heads=2,
                head_dim=64,
                rope_theta=1_000_000.0,
                max_position_embeddings=32_768,
                rms_norm_eps=1e-6,
                max_window_layers=21,
            ),
        ),
        ModelPreset(
            "qwen2.5-1.5b",
            "qwen2",
            QWEN25,
            dict(
                hidden_size=1536,
                intermediate_size=8960,
                num_hidden_layers=28,
                num_attention_heads=12,
                num_key_value_heads=2,
                head_dim=128,
                rope_theta=1_000_000.0,
                max_position_embeddings=32_768,
                rms_norm_eps=1e-6,
                max_window_layers=21,
            ),
        ),
        ModelPreset(
            "qwen3-0.6b",
            "qwen3",
            QWEN3,
            dict(
                hidden_size=1024,
                intermediate_size=3072,
                num_hidden_layers=28,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
                rope_theta=1_000_000.0,
                max_position_embeddings=40_960,
                rms_norm_eps=1e-6,
                max_window_layers=28,
                attention_bias=False,
            ),
        ),
        ModelPreset(
            "llama3.2-1b",
            "llama",
            LLAMA3,
            dict(
                hidden_size=2048,
                intermediate_size=8192,
                num_hidden_layers=16,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=64,
                rope_theta=500_000.0,
                max_position_embeddings=131_072,
                rms_norm_eps=1e-5,
                attention_bias=False,
            ),
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            config_bos="<|begin_of_text|>",
            config_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        ),
    )
}

# A small body over a real family's vocabulary, tokenizer, special ids, rope, tying and head size: what a CPU test
# or demo can train in seconds while the tokenizer is the real layout.
BODIES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
}

"""A small real ChatML tokenizer for tests: byte-level BPE trained here on a few generated lines, with Qwen2.5's
special tokens and a ChatML chat template. Real runs use a model's own tokenizer; this one has its shape (byte-level
BPE, added special tokens, a template that ends turns with <|im_end|>) at a few hundred tokens, built in well
under a second, with no download."""

from __future__ import annotations

from pathlib import Path

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# Qwen2.5's template without its tool-calling branches: a default system turn when none is given, every message
# as <|im_start|>role\ncontent<|im_end|>\n, and the assistant's header as the generation prompt.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _corpus(lines: int) -> list[str]:
    """Word problems and chat turns in plain English with numbers: enough merges that words and numbers are split
    into several tokens in more than one way (what a re-tokenisation test needs)."""
    names = ["Ava", "Ben", "Cleo", "Dan", "Eve", "Finn"]
    items = ["apples", "pencils", "marbles", "stickers", "books"]
    out = []
    for i in range(lines):
        name, item = names[i % len(names)], items[i % len(items)]
        a, b = 3 + i % 17, 2 + i % 11
        out.append(f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now? "
                   f"The answer is {a + b}. #### {a + b}")
        out.append(f"system user assistant tool observation: the result is {a * b}. Think step by step.")
    return out


def build_chatml_tokenizer(out_dir: Path, *, vocab_size: int = 400, lines: int = 200,
                           chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """Writes tokenizer.json + tokenizer_config.json (with the chat template) to `out_dir`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(lines), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=END_OF_TEXT,
                                   additional_special_tokens=[IM_START, IM_END])
    if chat_template is not None:
        fast.chat_template = chat_template
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir

"""A small real ChatML tokenizer for tests: byte-level BPE trained here on a few generated lines, with Qwen2.5's
special tokens and a ChatML chat template. Real runs use a model's own tokenizer; this one has its shape (byte-level
BPE, added special tokens, a template that ends turns with <|im_end|>) at a few hundred tokens, built in well
under a second, with no download."""

from __future__ import annotations

import json
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
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _corpus(lines: int) -> list[str]:
    """Word problems and chat turns in plain English with numbers: enough merges that words and numbers are split
    into several tokens in more than one way (what a re-tokenisation test needs)."""
    names = ["Ava", "Ben", "Cleo", "Dan", "Eve", "Finn"]
    items = ["apples", "pencils", "marbles", "stickers", "books"]
    out = []
    for i in range(lines):
        name, item = names[i % len(names)], items[i % len(items)]
        a, b = 3 + i % 17, 2 + i % 11
        out.append(
            f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now? "
            f"The answer is {a + b}. #### {a + b}"
        )
        out.append(f"system user assistant tool observation: the result is {a * b}. Think step by step.")
    return out


def build_chatml_tokenizer(
    out_dir: Path, *, vocab_size: int = 400, lines: int = 200, chat_template: str | None = CHATML_TEMPLATE
) -> Path:
    """Writes tokenizer.json + tokenizer_config.json (with the chat template) to `out_dir`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(lines), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=END_OF_TEXT, additional_special_tokens=[IM_START, IM_END]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    if chat_template is not None:  # where Qwen2.5's directories keep it (transformers 5 would write a .jinja file)
        config_file = out_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, "chat_template": chat_template}, indent=2))
    return out_dir


def build_chatml_model(out_dir: Path, *, seed: int = 0) -> Path:
    """A random-init two-layer Llama over the ChatML tokenizer (vocabulary ~400), EOS ids <|im_end|> and
    <|endoftext|> as Qwen2.5-Instruct's generation_config has them: a real model for the native engine in tests."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer_dir = build_chatml_tokenizer(out_dir)
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    size = len(vocab["model"]["vocab"]) + sum(
        1 for t in vocab["added_tokens"] if t["content"] not in vocab["model"]["vocab"]
    )
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    config = LlamaConfig(
        vocab_size=size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=ids[IM_END],
        pad_token_id=ids[END_OF_TEXT],
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.update(
        bos_token_id=None, eos_token_id=[ids[IM_END], ids[END_OF_TEXT]], pad_token_id=ids[END_OF_TEXT]
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

"""`tandem init-model`: a random-init Hugging Face causal LM and a tokenizer, built locally (no download).

The tokenizer is a `tokenizers` WordLevel model over digits, a few arithmetic symbols and the special
tokens, wrapped in `PreTrainedTokenizerFast`. The default architecture is Llama because transformers 5.x
gives a `qwen2` directory a `Qwen2Tokenizer` whose ByteLevel decoder drops the spaces ('34=' for
'3 4 ='); the engine loads tokenizers with `PreTrainedTokenizerFast` so both archs decode faithfully.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from services.contracts.config import ConfigError

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
SYMBOLS = ("+", "-", "*", "/", "=", "(", ")", ",")
VOCAB = (*SPECIAL_TOKENS, *"0123456789", *SYMBOLS)

# tiny learns the example task in seconds of compute; small is a few M parameters for throughput work.
# q05 / q15 are the bodies of Qwen2-0.5B / Qwen2-1.5B (their layer shapes, rope theta and context) over this
# vocabulary, for real-size speed work: ~0.36B and ~1.31B parameters, nearly all of them in the layers.
_QWEN2_BODY = dict(num_key_value_heads=2, max_position_embeddings=131_072, rope_theta=1_000_000.0)
PRESETS: dict[str, dict[str, Any]] = {   # config kwargs (transformers types them per field)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128),
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=512),
    "q05": dict(_QWEN2_BODY, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, max_window_layers=24,
                num_attention_heads=14),
    "q15": dict(_QWEN2_BODY, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, max_window_layers=28,
                num_attention_heads=12),
}
ARCHS = ("llama", "qwen2")
# A preset named after a model family is built only as that family; the others default to llama (module doc).
PRESET_ARCH = {"q05": "qwen2", "q15": "qwen2"}


def preset_arch(preset: str, arch: str | None = None) -> str:
    """The arch to build `preset` as: `arch` when given (refused if the preset fixes another one)."""
    fixed = PRESET_ARCH.get(preset)
    if arch is not None and fixed is not None and arch != fixed:
        raise ModelInitError(f"init-model: preset {preset!r} is a {fixed} body; drop --arch or pass --arch {fixed}")
    return arch or fixed or "llama"


class ModelInitError(ConfigError):
    """Bad arguments to init-model (a ConfigError, so the CLI prints it as one line and exits 2)."""


def build_tokenizer(*, model_max_length: int):
    """WordLevel over VOCAB; digits are split one per token, `<s>` is prepended by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins tokens with single spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        model_max_length=model_max_length, clean_up_tokenization_spaces=False, padding_side="left")


def build_config(*, preset: str, arch: str, vocab_size: int, bos: int, eos: int, pad: int):
    from transformers import LlamaConfig, Qwen2Config

    if preset not in PRESETS:
        raise ModelInitError(f"init-model: unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    if arch not in ARCHS:
        raise ModelInitError(f"init-model: unknown arch {arch!r} (choose from {', '.join(ARCHS)})")
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    # Untied embeddings: every parameter has exactly one name, which keeps weight sync simple.
    return cls(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
               tie_word_embeddings=False, rms_norm_eps=1e-6, dtype="float32", **PRESETS[preset])


def init_model(out_dir: str | os.PathLike[str], *, preset: str = "tiny", arch: str | None = None,
               seed: int = 0) -> Path:
    """Writes config, safetensors weights, generation config and tokenizer to `out_dir`; returns it.

    `arch` defaults to the preset's (`preset_arch`).

    Refuses to overwrite a directory that already holds a model. Writes into a temporary sibling and
    renames, so an interrupted run never leaves a half-written model behind.
    """
    out = Path(out_dir).resolve()
    arch = preset_arch(preset, arch) if preset in PRESETS else arch or "llama"
    if preset not in PRESETS or arch not in ARCHS:
        raise ModelInitError(f"init-model: unknown preset {preset!r} or arch {arch!r} (presets: "
                             f"{', '.join(PRESETS)}; archs: {', '.join(ARCHS)})")
    if (out / "config.json").exists():
        raise ModelInitError(f"init-model: {out} already holds a model (config.json); delete it or pick "
                             "another directory")
    if out.exists() and any(out.iterdir()):
        raise ModelInitError(f"init-model: {out} exists and is not empty")
    import torch  # after the checks: a refused call should not pay for importing torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = build_tokenizer(model_max_length=int(PRESETS[preset]["max_position_embeddings"]))
    config = build_config(preset=preset, arch=arch, vocab_size=len(VOCAB), bos=tokenizer.bos_token_id,
                          eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.update(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                   pad_token_id=config.pad_token_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for path in (tmp, *tmp.iterdir()):   # mkdtemp makes 0700; a shared model volume needs readable files
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():
            out.rmdir()   # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_count(model_dir: str | os.PathLike[str]) -> int:
    """Parameters of the model in `model_dir`, from its config alone (built on the meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return count_parameters(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)))

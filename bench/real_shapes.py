"""Real models' exact shapes for the benches: Qwen2.5-0.5B / 1.5B and Qwen3-0.6B, with their 151,936-token
vocabulary and tied embeddings (the lm_head is 136M of Qwen2.5-0.5B's 494M parameters), random-init, built locally.

`tandem init-model` gains these presets with real tokenizers (issue 30); the benches that only time the trainer
need the shapes alone, so they are defined here (vocabulary size, widths, depth, heads, rope theta, tying) from
the models' published config.json files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

REAL_VOCAB = 151_936
_QWEN = dict(vocab_size=REAL_VOCAB, tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
             max_position_embeddings=32_768, bos_token_id=151_643, eos_token_id=151_645, pad_token_id=151_643)
REAL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": ("qwen2", dict(_QWEN, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2)),
    "qwen2.5-1.5b": ("qwen2", dict(_QWEN, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2)),
    "qwen3-0.6b": ("qwen3", dict(_QWEN, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=40_960)),
}


def build_real_model_dir(name: str, out: Path) -> Path:
    """A random-init bf16 model of shape `name` saved under `out` (initialised on the GPU when there is one)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    if (out / "config.json").is_file():
        return out
    arch, kwargs = REAL_SHAPES[name]
    config = (Qwen2Config if arch == "qwen2" else Qwen3Config)(**kwargs)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    return out

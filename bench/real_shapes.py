"""Real models' exact shapes for the benches: `tandem init-model`'s presets of Qwen2.5-0.5B / 1.5B, Qwen3-0.6B and
Llama-3.2-1B (services/modelinit/families.py, from the models' published config.json files), with their real
vocabularies and tied embeddings (the lm_head is 136M of Qwen2.5-0.5B's 494M parameters), random-init, built locally.

The benches that only time the trainer need the weights alone, not init-model's tokenizer: `build_real_model_dir`
saves the model of the preset's config (initialised on the GPU when there is one).
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.modelinit.families import MODEL_PRESETS
from services.modelinit.init_model import build_family_config

REAL_SHAPES = tuple(MODEL_PRESETS)


def real_vocab(name: str) -> int:
    return MODEL_PRESETS[name].family.vocab_size


def build_real_model_dir(name: str, out: Path) -> Path:
    """A random-init bf16 model of preset `name` saved under `out`."""
    from transformers import AutoModelForCausalLM

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(build_family_config(name), dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    return out

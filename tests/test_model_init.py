"""`tandem init-model`: random-init model + tokenizer built locally, reloadable offline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.rollout.model_init import VOCAB, ModelInitError, build_config, init_model, preset_arch
from services.rollout.tokenizer import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_reloads_offline(tmp_path: Path, arch: str):
    from transformers import AutoModelForCausalLM

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    out = init_model(tmp_path / "m", preset="tiny", arch=arch, seed=0)
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= \
        {p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == arch and model.config.num_hidden_layers == 2
    assert model.config.hidden_size == 64 and model.config.vocab_size == len(VOCAB)
    assert 50_000 < sum(p.numel() for p in model.parameters()) < 150_000
    tok = load_tokenizer(out)
    ids = tok("3 7 =")["input_ids"]
    assert ids == [tok.bos_token_id, VOCAB.index("3"), VOCAB.index("7"), VOCAB.index("=")]
    assert tok.decode(ids, skip_special_tokens=True) == "3 7 ="          # faithful for qwen2 dirs too
    assert tok.decode([VOCAB.index("1"), VOCAB.index("2"), tok.eos_token_id], skip_special_tokens=True) == "1 2"
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, 4, len(VOCAB)) and torch.isfinite(logits).all()


def test_seed_decides_the_weights(tmp_path: Path):
    from safetensors.torch import load_file

    a = load_file(str(init_model(tmp_path / "a", seed=0) / "model.safetensors"))
    b = load_file(str(init_model(tmp_path / "b", seed=0) / "model.safetensors"))
    c = load_file(str(init_model(tmp_path / "c", seed=1) / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].dim() > 1)


def test_small_preset_has_a_few_million_parameters(tmp_path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(init_model(tmp_path / "s", preset="small"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 10_000_000


@pytest.mark.parametrize(("preset", "layers", "hidden", "params"), [
    ("q05", 24, 896, 357_937_536),     # Qwen2-0.5B's body over our 22-token vocabulary
    ("q15", 28, 1536, 1_310_408_192),  # Qwen2-1.5B's
])
def test_qwen2_body_presets(preset: str, layers: int, hidden: int, params: int):
    """The config a q05/q15 model directory gets, counted on the meta device (building the weights is minutes)."""
    from transformers import AutoModelForCausalLM

    arch = preset_arch(preset)
    config = build_config(preset=preset, arch=arch, vocab_size=len(VOCAB), bos=1, eos=2, pad=0)
    assert (arch, config.model_type, config.num_hidden_layers, config.hidden_size) == ("qwen2", "qwen2", layers, hidden)
    assert (config.num_key_value_heads, config.max_position_embeddings) == (2, 131_072)
    assert config.rope_parameters["rope_theta"] == 1_000_000.0
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == params
    with pytest.raises(ModelInitError, match="q05' is a qwen2 body"):
        preset_arch("q05", "llama")
    assert preset_arch("tiny") == "llama" and preset_arch("tiny", "qwen2") == "qwen2"


def test_refuses_to_overwrite_and_rejects_bad_arguments(tmp_path: Path):
    out = init_model(tmp_path / "m")
    with pytest.raises(ModelInitError, match="already holds a model"):
        init_model(out)
    with pytest.raises(ModelInitError, match="unknown preset 'huge'"):
        init_model(tmp_path / "x", preset="huge")
    with pytest.raises(ModelInitError, match="arch 'gpt9'"):
        init_model(tmp_path / "y", arch="gpt9")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_cli_init_model(tmp_path: Path):
    out = tmp_path / "cli-model"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "init-model", str(out), "--preset", "tiny"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").is_file() and str(out) in proc.stdout
    again = subprocess.run([sys.executable, "-m", "services.cli", "init-model", str(out)],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already holds a model" in again.stderr

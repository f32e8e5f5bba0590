"""`tandem init-model`: random-init model + tokenizer built locally, reloadable offline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.modelinit.init_model import VOCAB, ModelInitError, build_config, init_model, preset_arch
from services.rollout.tokenizer import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_reloads_offline(tmp_path: Path, arch: str):
    from transformers import AutoModelForCausalLM

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    out = init_model(tmp_path / "m", preset="tiny", arch=arch, seed=0)
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == arch and model.config.num_hidden_layers == 2
    assert model.config.hidden_size == 64 and model.config.vocab_size == len(VOCAB)
    assert 50_000 < sum(p.numel() for p in model.parameters()) < 150_000
    tok = load_tokenizer(out)
    ids = tok("3 7 =")["input_ids"]
    assert ids == [tok.bos_token_id, VOCAB.index("3"), VOCAB.index("7"), VOCAB.index("=")]
    assert tok.decode(ids, skip_special_tokens=True) == "3 7 ="  # faithful for qwen2 dirs too
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


@pytest.mark.parametrize(
    ("preset", "layers", "hidden", "params"),
    [
        ("q05", 24, 896, 357_937_536),  # Qwen2-0.5B's body over our 22-token vocabulary
        ("q15", 28, 1536, 1_310_408_192),  # Qwen2-1.5B's
    ],
)
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
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "init-model", str(out), "--preset", "tiny"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").is_file() and str(out) in proc.stdout
    again = subprocess.run(
        [sys.executable, "-m", "services.cli", "init-model", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2 and "already holds a model" in again.stderr


# ---- real models' presets -------------------------------------------------------------------------------------
# From each model's config.json / generation_config.json on the Hugging Face hub (Qwen/Qwen2.5-0.5B-Instruct,
# Qwen/Qwen2.5-1.5B-Instruct, Qwen/Qwen3-0.6B, meta-llama/Llama-3.2-1B-Instruct), typed here by hand so that a slip in
# services/modelinit/families.py is caught, not copied. Parameters: the published counts (tied embeddings).
REAL = {
    #               arch      hidden layers heads kv  inter  head rope_theta max_pos  eps    vocab    params
    "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 4864, 64, 1_000_000.0, 32_768, 1e-6, 151_936, 494_032_768),
    "qwen2.5-1.5b": ("qwen2", 1536, 28, 12, 2, 8960, 128, 1_000_000.0, 32_768, 1e-6, 151_936, 1_543_714_304),
    "qwen3-0.6b": ("qwen3", 1024, 28, 16, 8, 3072, 128, 1_000_000.0, 40_960, 1e-6, 151_936, 596_049_920),
    "llama3.2-1b": ("llama", 2048, 16, 32, 8, 8192, 64, 500_000.0, 131_072, 1e-5, 128_256, 1_235_814_400),
}
REAL_EOS = {  # (config.json eos_token_id, generation_config.json eos_token_id, bos)
    "qwen2.5-0.5b": (151645, [151645, 151643], 151643),
    "qwen2.5-1.5b": (151645, [151645, 151643], 151643),
    "qwen3-0.6b": (151645, [151645, 151643], 151643),
    "llama3.2-1b": ([128001, 128008, 128009], [128001, 128008, 128009], 128000),
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("preset", list(REAL))
def test_real_presets_have_the_real_shapes(preset: str):
    """Counted on the meta device: building 0.5-1.5B weights is tens of seconds (bench numbers in the README)."""
    from transformers import AutoModelForCausalLM

    from services.modelinit.init_model import InitSpec, build_family_config

    arch, hidden, layers, heads, kv, inter, head_dim, theta, max_pos, eps, vocab, params = REAL[preset]
    config = build_family_config(preset)
    assert (
        config.model_type,
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
        config.head_dim,
    ) == (arch, hidden, layers, heads, kv, inter, head_dim)
    assert (
        config.rope_parameters["rope_theta"],
        config.max_position_embeddings,
        config.rms_norm_eps,
        config.vocab_size,
    ) == (theta, max_pos, eps, vocab)
    assert config.tie_word_embeddings is True  # all four tie the output head to the embeddings
    rope = {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"}
    assert rope == (LLAMA3_ROPE if arch == "llama" else {"rope_type": "default"})
    assert set(getattr(config, "layer_types", None) or ["full_attention"]) == {"full_attention"}
    eos, generation_eos, bos = REAL_EOS[preset]
    assert (config.eos_token_id, config.bos_token_id) == (eos, bos)
    assert InitSpec(preset, arch, None, None, "bfloat16").generation_ids(config)["eos_token_id"] == generation_eos
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert (
        type(model).__name__
        == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == params
    assert hasattr(model.model.layers[0].self_attn, "q_norm") == (arch == "qwen3")
    tiny = build_family_config(preset, body="tiny", layers=1)
    assert (
        tiny.num_hidden_layers,
        tiny.hidden_size,
        tiny.vocab_size,
        tiny.head_dim,
        tiny.rope_parameters,
        tiny.tie_word_embeddings,
        tiny.eos_token_id,
    ) == (1, 64, vocab, head_dim, config.rope_parameters, True, eos)


@pytest.fixture(scope="module")
def qwen_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's one real save: qwen2.5-0.5b over the tiny body (the real vocabulary and tokenizer)."""
    return init_model(tmp_path_factory.mktemp("q") / "qwen", preset="qwen2.5-0.5b", body="tiny", seed=3)


TEXTS = [
    "Tom has 12 apples.  He buys 7 more.\n\nHow many?  #### 19",
    "  leading spaces, tabs\tand é→ü 1234567",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def test_real_preset_directory_reloads_offline(qwen_tiny: Path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    config = AutoConfig.from_pretrained(qwen_tiny)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "qwen2",
        2,
        64,
        151_936,
    )
    assert GenerationConfig.from_pretrained(qwen_tiny).eos_token_id == [151645, 151643]
    model = AutoModelForCausalLM.from_pretrained(qwen_tiny)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32  # a tiny body is saved in float32
    tok = load_tokenizer(qwen_tiny)
    auto = AutoTokenizer.from_pretrained(qwen_tiny)  # what SGLang loads: Qwen2Tokenizer
    assert type(auto).__name__ == "Qwen2Tokenizer"
    for t in (tok, auto):
        assert len(t) == config.vocab_size
        assert (t.eos_token, t.eos_token_id, t.pad_token, t.pad_token_id, t.bos_token) == (
            "<|im_end|>",
            151645,
            "<|endoftext|>",
            151643,
            None,
        )
        assert t.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
        assert t.convert_ids_to_tokens(151935) == "<|reserved_special_token_270|>"
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == auto(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == auto.decode(ids) == text  # spaces, newlines and UTF-8 round-trip
    assert tok("3 + 45")["input_ids"] == tok("3 + 45", add_special_tokens=False)["input_ids"]  # Qwen adds no BOS
    assert [tok.decode([i]) for i in tok("2026", add_special_tokens=False)["input_ids"]] == list("2026")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    chat = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == chat
    assert auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == chat
    logits = model(torch.tensor([tok(chat)["input_ids"]])).logits
    assert logits.shape[-1] == 151_936 and torch.isfinite(logits).all()


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_family_tokenizers_have_the_real_special_ids(tmp_path: Path, family: str):
    from transformers import AutoTokenizer

    from services.modelinit.bpe_tokenizer import build_tokenizer, save_tokenizer
    from services.modelinit.families import LLAMA3, QWEN3

    fam = {"qwen3": QWEN3, "llama3": LLAMA3}[family]
    save_tokenizer(build_tokenizer(fam, model_max_length=4096), fam, tmp_path)
    tok, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    if family == "qwen3":
        expected = {"<|endoftext|>": 151643, "<|im_end|>": 151645, "<think>": 151667, "</think>": 151668}
        size, eos, bos = 151_936, 151645, None
        chat = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    else:
        expected = {
            "<|begin_of_text|>": 128000,
            "<|end_of_text|>": 128001,
            "<|finetune_right_pad_id|>": 128004,
            "<|start_header_id|>": 128006,
            "<|end_header_id|>": 128007,
            "<|eom_id|>": 128008,
            "<|eot_id|>": 128009,
            "<|reserved_special_token_247|>": 128255,
        }
        size, eos, bos = 128_256, 128009, 128000
        chat = (
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 3?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    for t in (tok, auto):
        assert len(t) == size and (t.eos_token_id, t.bos_token_id) == (eos, bos)
        assert {k: t.convert_tokens_to_ids(k) for k in expected} == expected
        assert t.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == chat
        for text in TEXTS:
            ids = t(text, add_special_tokens=False)["input_ids"]
            assert t.decode(ids) == text
    assert tok("12")["input_ids"][:1] == ([128000] if bos else tok("12", add_special_tokens=False)["input_ids"][:1])
    if family == "llama3":  # Llama-3 groups digits by three, Qwen splits every digit
        assert [tok.decode([i]) for i in tok("1234567", add_special_tokens=False)["input_ids"]] == ["123", "456", "7"]


def test_real_preset_arguments_are_checked(tmp_path: Path):
    from services.cli import main
    from services.modelinit.init_model import check_init_args

    assert check_init_args(preset="llama3.2-1b").dtype == "bfloat16"  # as the real checkpoints
    assert check_init_args(preset="llama3.2-1b", body="tiny").dtype == "float32"
    assert check_init_args(preset="qwen3-0.6b").arch == "qwen3"
    with pytest.raises(ModelInitError, match=r"'qwen3-0\.6b' is a qwen3 model; drop --arch"):
        check_init_args(preset="qwen3-0.6b", arch="llama")
    with pytest.raises(ModelInitError, match="--body applies to the real models' presets"):
        check_init_args(preset="tiny", body="tiny")
    with pytest.raises(ModelInitError, match="--layers must be >= 1"):
        check_init_args(preset="qwen2.5-0.5b", layers=0)
    with pytest.raises(ModelInitError, match="unknown preset 'qwen9'"):
        check_init_args(preset="qwen9")
    config = build_config(preset="q05", arch="qwen2", vocab_size=len(VOCAB), bos=1, eos=2, pad=0, layers=3)
    assert (config.num_hidden_layers, len(config.layer_types), config.max_window_layers) == (3, 3, 3)
    assert main(["init-model", str(tmp_path / "m"), "--preset", "tiny", "--body", "tiny"]) == 2
    assert not (tmp_path / "m").exists()


def test_config_presets_are_the_cli_presets():
    from typing import get_args

    from services.contracts.config import ModelConfig
    from services.modelinit.init_model import preset_names

    literal = ModelConfig.model_fields["init_preset"].annotation
    assert set(next(a for a in get_args(literal) if a is not type(None)).__args__) == set(preset_names())
    with pytest.raises(ValueError, match="init_body applies to a real model's init_preset"):
        ModelConfig(path="m", init_preset="q05", init_body="tiny")
    assert ModelConfig(path="m", init_preset="llama3.2-1b", init_body="tiny").init_body == "tiny"


def test_the_classifier_preset_is_a_sequence_classifier_on_a_real_tokenizer(tmp_path):
    """`tandem init-model --preset classifier`: the reward service's `type: classifier` on a CPU."""
    from transformers import AutoConfig, AutoTokenizer

    from services.cli import main
    from services.modelinit.init_model import parameter_count

    out = tmp_path / "rm"
    assert main(["init-model", str(out), "--preset", "classifier"]) == 0
    config = AutoConfig.from_pretrained(out)
    assert config.architectures == ["Qwen2ForSequenceClassification"] and config.num_labels == 1
    assert config.hidden_size == 64 and config.vocab_size == 151_936
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert config.pad_token_id == tokenizer.pad_token_id is not None and tokenizer.chat_template
    assert 0.009e9 < parameter_count(out) < 0.011e9  # the embedding of 151,936 x 64, the body, a 64-wide head
    with pytest.raises(ValueError, match="already holds a model"):
        init_model(out, preset="classifier")

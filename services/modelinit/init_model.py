"""`tandem init-model`: a random-init Hugging Face causal LM and a tokenizer, built locally (no download).

Two kinds of preset:
- toy presets (PRESETS: tiny, small, q05, q15) over a `tokenizers` WordLevel model of digits, a few arithmetic
  symbols and the special tokens (22 tokens), wrapped in `PreTrainedTokenizerFast`. Their default architecture is
  Llama because transformers 5.x gives a `qwen2` directory a `Qwen2Tokenizer` whose ByteLevel decoder drops the
  spaces of this word-level tokenizer ('34=' for '3 4 ='); the engine loads tokenizers with
  `PreTrainedTokenizerFast` so both archs decode faithfully.
- real models' presets (families.MODEL_PRESETS: qwen2.5-0.5b, qwen2.5-1.5b, qwen3-0.6b, llama3.2-1b) at
  their exact shape, vocabulary size and tying, with a byte-level BPE tokenizer in their family's layout
  (bpe_tokenizer.py); `body="tiny"` keeps all of that but the layer count and widths.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.contracts.config import ConfigError
from services.modelinit.families import BODIES, MODEL_PRESETS, Family

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
SYMBOLS = ("+", "-", "*", "/", "=", "(", ")", ",")
VOCAB = (*SPECIAL_TOKENS, *"0123456789", *SYMBOLS)

# tiny learns the example task in seconds of compute; small is a few M parameters for throughput work.
# q05 / q15 are the bodies of Qwen2-0.5B / Qwen2-1.5B (their layer shapes, rope theta and context) over this
# vocabulary, for real-size speed work: ~0.36B and ~1.31B parameters, nearly all of them in the layers.
_QWEN2_BODY = dict(num_key_value_heads=2, max_position_embeddings=131_072, rope_theta=1_000_000.0)
PRESETS: dict[str, dict[str, Any]] = {  # config kwargs (transformers types them per field)
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
    ),
    "q05": dict(
        _QWEN2_BODY,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        max_window_layers=24,
        num_attention_heads=14,
    ),
    "q15": dict(
        _QWEN2_BODY,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        max_window_layers=28,
        num_attention_heads=12,
    ),
}
ARCHS = ("llama", "qwen2")
# Sequence classifiers (a reward model, `type: classifier` of the reward service): a real model's preset over a small
# body, with a one-logit score head instead of the LM head
CLASSIFIER_PRESETS: dict[str, tuple[str, str]] = {"classifier": ("qwen2.5-0.5b", "tiny")}
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
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Punctuation()]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with single spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def build_config(*, preset: str, arch: str, vocab_size: int, bos: int, eos: int, pad: int, layers: int | None = None):
    """The config of a toy preset (PRESETS) over a vocabulary of `vocab_size` (with `layers` layers if given)."""
    from transformers import LlamaConfig, Qwen2Config

    if preset not in PRESETS:
        raise ModelInitError(f"init-model: unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    if arch not in ARCHS:
        raise ModelInitError(f"init-model: unknown arch {arch!r} (choose from {', '.join(ARCHS)})")
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    shape = dict(PRESETS[preset])
    if layers is not None:
        shape["num_hidden_layers"] = layers
        if "max_window_layers" in shape:
            shape["max_window_layers"] = layers
    # Untied embeddings: every parameter has exactly one name, which keeps weight sync simple.
    return cls(
        vocab_size=vocab_size,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        dtype="float32",
        **shape,
    )


def build_family_config(preset: str, *, body: str | None = None, layers: int | None = None, dtype: str = "bfloat16"):
    """The config.json of a real model's preset (MODEL_PRESETS), optionally over a small `body` (BODIES: the
    vocabulary, special ids, rope, tying and head size stay the real ones) and with `layers` layers."""
    from transformers import AutoConfig

    p = MODEL_PRESETS[preset]
    fam = p.family
    shape = {**p.shape, **(BODIES[body] if body else {})}
    if layers is not None:
        shape["num_hidden_layers"] = layers
    if "max_window_layers" in shape:
        shape["max_window_layers"] = min(shape["max_window_layers"], shape["num_hidden_layers"])
    rope = {"rope_theta": shape.pop("rope_theta"), **(p.rope_scaling or {"rope_type": "default"})}
    eos = [fam.token_id(t) for t in p.config_eos]
    return AutoConfig.for_model(
        p.model_type,
        vocab_size=fam.vocab_size,
        tie_word_embeddings=p.tie_word_embeddings,
        rope_parameters=rope,
        bos_token_id=fam.token_id(p.config_bos),
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        dtype=dtype,
        **shape,
    )


def init_model(
    out_dir: str | os.PathLike[str],
    *,
    preset: str = "tiny",
    arch: str | None = None,
    seed: int = 0,
    body: str | None = None,
    layers: int | None = None,
    dtype: str | None = None,
) -> Path:
    """Writes config, safetensors weights, generation config and tokenizer to `out_dir`; returns it.

    A toy preset (PRESETS) gets the 22-token word-level tokenizer and `arch` (default: the preset's,
    `preset_arch`); a real model's preset (MODEL_PRESETS) gets its architecture and a byte-level BPE tokenizer in its
    family's layout (bpe_tokenizer.py), `body` / `layers` shrink it (build_family_config). `dtype` is what the
    weights are saved in: default bfloat16 for a real model's full body (as its checkpoints are), else float32.

    Refuses to overwrite a directory that already holds a model. Writes into a temporary sibling and
    renames, so an interrupted run never leaves a half-written model behind.
    """
    out = Path(out_dir).resolve()
    head = "classifier" if preset in CLASSIFIER_PRESETS else "causal"
    spec = check_init_args(preset=preset, arch=arch, body=body, layers=layers, dtype=dtype)
    if (out / "config.json").exists():
        raise ModelInitError(
            f"init-model: {out} already holds a model (config.json); delete it or pick another directory"
        )
    if out.exists() and any(out.iterdir()):
        raise ModelInitError(f"init-model: {out} exists and is not empty")
    import torch  # after the checks: a refused call should not pay for importing torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.initialization import no_init_weights
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config, tokenizer, save_tokenizer = _config_and_tokenizer(spec, seed=seed)
    auto: type[AutoModelForCausalLM] | type[AutoModelForSequenceClassification] = AutoModelForCausalLM
    if head == "classifier":
        auto = AutoModelForSequenceClassification
        config.num_labels = 1
        config.pad_token_id = tokenizer.pad_token_id  # the score head reads each row's last non-pad token
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # torch's own init at construction (kaiming, normal) is thrown away by the model's _init_weights: a real
        # model's preset skips it, which halves the random numbers drawn (the bulk of a 0.5B init on a CPU); the
        # toy presets keep the stream their seeds always gave
        with no_init_weights() if spec.family is not None else contextlib.nullcontext():
            model = auto.from_config(config, dtype=getattr(torch, spec.dtype))
        if spec.family is not None:
            model.init_weights()
    if getattr(model, "generation_config", None) is not None and head == "causal":
        model.generation_config.update(**spec.generation_ids(config))
    _save_atomically(
        out, lambda tmp: (model.save_pretrained(tmp, safe_serialization=True), save_tokenizer(tokenizer, tmp))
    )
    return out


def _save_atomically(out: Path, save: Callable[[Path], object]) -> None:
    """`save` into a temporary sibling of `out` (an empty or missing directory), then renamed to `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save(tmp)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp makes 0700; a shared model volume needs readable files
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class InitSpec:
    """Checked arguments of one init-model call."""

    preset: str
    arch: str
    body: str | None
    layers: int | None
    dtype: str

    @property
    def family(self) -> Family | None:
        return MODEL_PRESETS[self.preset].family if self.preset in MODEL_PRESETS else None

    def generation_ids(self, config: PretrainedConfig) -> dict[str, int | list[int] | None]:
        """generation_config.json's token ids: every id that ends a generation (the real file's list)."""
        fam = self.family
        if fam is None:
            return dict(
                bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
            )
        eos = list(fam.generation_eos_ids)
        return dict(
            bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=fam.token_id(fam.pad) if fam.pad else None
        )


def check_init_args(
    *,
    preset: str,
    arch: str | None = None,
    body: str | None = None,
    layers: int | None = None,
    dtype: str | None = None,
) -> InitSpec:
    """ModelInitError naming the first bad argument; else what to build (a classifier preset: its real model's
    preset over its body)."""
    if preset in CLASSIFIER_PRESETS:
        preset, default_body = CLASSIFIER_PRESETS[preset]
        body = body or default_body
    if preset in MODEL_PRESETS:
        model_type = MODEL_PRESETS[preset].model_type
        if arch is not None and arch != model_type:
            raise ModelInitError(f"init-model: preset {preset!r} is a {model_type} model; drop --arch")
        arch = model_type
    elif preset in PRESETS:
        if body is not None:
            raise ModelInitError(
                f"init-model: --body applies to the real models' presets "
                f"({', '.join(MODEL_PRESETS)}), not to {preset!r}"
            )
        arch = preset_arch(preset, arch)
        if arch not in ARCHS:
            raise ModelInitError(f"init-model: unknown arch {arch!r} (choose from {', '.join(ARCHS)})")
    else:
        raise ModelInitError(f"init-model: unknown preset {preset!r} (choose from {', '.join(all_preset_names())})")
    if body is not None and body not in BODIES:
        raise ModelInitError(f"init-model: unknown body {body!r} (choose from {', '.join(BODIES)})")
    if layers is not None and layers < 1:
        raise ModelInitError(f"init-model: --layers must be >= 1, got {layers}")
    if dtype is not None and dtype not in DTYPES:
        raise ModelInitError(f"init-model: unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    full_real = preset in MODEL_PRESETS and body is None
    return InitSpec(
        preset=preset, arch=arch, body=body, layers=layers, dtype=dtype or ("bfloat16" if full_real else "float32")
    )


def _config_and_tokenizer(spec: InitSpec, *, seed: int) -> tuple[Any, Any, Any]:
    """(model config, tokenizer, a function saving that tokenizer into a directory)."""
    fam = spec.family
    if fam is None:
        tokenizer = build_tokenizer(model_max_length=int(PRESETS[spec.preset]["max_position_embeddings"]))
        config = build_config(
            preset=spec.preset,
            arch=spec.arch,
            vocab_size=len(VOCAB),
            bos=tokenizer.bos_token_id,
            eos=tokenizer.eos_token_id,
            pad=tokenizer.pad_token_id,
            layers=spec.layers,
        )
        return config, tokenizer, lambda tok, path: tok.save_pretrained(path)
    from services.modelinit import bpe_tokenizer

    config = build_family_config(spec.preset, body=spec.body, layers=spec.layers, dtype=spec.dtype)
    tokenizer = bpe_tokenizer.build_tokenizer(fam, model_max_length=int(config.max_position_embeddings), seed=seed)
    return config, tokenizer, lambda tok, path: bpe_tokenizer.save_tokenizer(tok, fam, path)


def preset_names() -> tuple[str, ...]:
    """The causal LM presets (a policy's, model.init_preset)."""
    return (*PRESETS, *MODEL_PRESETS)


def all_preset_names() -> tuple[str, ...]:
    """What `tandem init-model --preset` takes: the causal LM presets and the classifier ones (a reward model)."""
    return (*preset_names(), *CLASSIFIER_PRESETS)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_count(model_dir: str | os.PathLike[str]) -> int:
    """Parameters of the model in `model_dir`, from its config alone (built on the meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(model_dir)
    classifier = any(a.endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or ())
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    with torch.device("meta"):
        return count_parameters(auto.from_config(config))

"""LoRA (`trainer.lora`) through peft: which layers are adapted, the merged weights the engines get, the adapter.

- `check_targets` resolves `target_modules` against the model (one ConfigError naming every unknown or non-linear
  name); `tandem run` calls it before any service starts (on a meta-device copy), the trainer again at start.
- `wrap` puts peft's LoRA layers on the model: afterwards only the adapters' factors require grad, so the
  DeepSpeed optimizer (built over `requires_grad` parameters) holds state for them alone.
- `merged_tensors` is what weight sync, the HF export and the old actor read: the base model's names and shapes,
  an adapted weight as W + scaling · B·A (weight_export.ExportedTensor), the trained parameters untouched.
- `AdapterOffReference` is the KL term's reference model: the trained model with its adapters switched off is the
  base model, so no second copy is loaded.
- `adapter_state` / `save_adapter`: the adapter in peft's format (`PeftModel.from_pretrained` loads it).

peft is imported only when LoRA is configured.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from services.contracts.config import ConfigError, LoraConfig
from services.contracts.files import write_atomic
from services.contracts.untyped import JsonObject
from services.trainer.model.weight_export import ExportedTensor, LowRankUpdate

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

ALL_LINEAR = "all-linear"
ADAPTER = "default"  # peft's name of the one adapter


def _matches(path: str, target: str) -> bool:
    """peft's rule for a target name: the whole module path, or its last dotted parts."""
    return path == target or path.endswith("." + target)


def _output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    return getter() if callable(getter) else None


def _target_problem(model: torch.nn.Module, target: str, head: torch.nn.Module | None) -> str | None:
    """Why `target` cannot be adapted, or None when it names linear layers peft can wrap."""
    hits = [(path, m) for path, m in model.named_modules() if path and _matches(path, target)]
    if not hits:
        return f"{target!r} names no module"
    if not all(isinstance(m, torch.nn.Linear) for _, m in hits):
        kinds = sorted({type(m).__name__ for _, m in hits if not isinstance(m, torch.nn.Linear)})
        return f"{target!r} names a {', '.join(kinds)}, not a linear layer"
    if head is not None and any(m is head for _, m in hits) and _tied(model, head):
        return f"{target!r} is the output head, whose weight is tied to the input embeddings"
    return None


def check_targets(model: torch.nn.Module, targets: tuple[str, ...], *, what: str) -> list[str]:
    """The module names to give peft, or one ConfigError naming every bad target (`what` names the model in it).
    all-linear = every nn.Linear but the output head (peft's meaning), as full module paths; other names may be
    listed beside it (e.g. lm_head)."""
    linear = {path: m for path, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    head = _output_head(model)
    body = sorted(path for path, m in linear.items() if m is not head)
    names = [t for t in targets if t != ALL_LINEAR]
    problems = (
        [f"{ALL_LINEAR!r} finds no linear layer but the output head"] if ALL_LINEAR in targets and not body else []
    )
    problems += [p for p in (_target_problem(model, target, head) for target in names) if p is not None]
    if problems:
        known = sorted({path.rsplit(".", 1)[-1] for path in linear})
        raise ConfigError(
            f"trainer.lora.target_modules: {'; '.join(problems)} in {what} (its linear layers: "
            f"{', '.join(known)}; or {ALL_LINEAR}: all of them but the output head)"
        )
    return sorted({*(body if ALL_LINEAR in targets else []), *names})


def _tied(model: torch.nn.Module, head: torch.nn.Module) -> bool:
    getter = getattr(model, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    return embeddings is not None and getattr(embeddings, "weight", None) is getattr(head, "weight", None)


def check_model_targets(config_dir: str, lora: LoraConfig, *, critic: bool) -> None:
    """`tandem run`'s preflight: the targets against the model built from its config on the meta device (no
    weights read). The critic's backbone is the model without its output head."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    model_config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = (AutoModel if critic else AutoModelForCausalLM).from_config(model_config)
    check_targets(model, lora.target_modules, what=f"{type(model).__name__} at {config_dir}")


def wrap(model: torch.nn.Module, lora: LoraConfig, *, what: str) -> PeftModel:
    """peft's LoRA layers on `model` (an HF causal LM, or the critic's backbone). B starts at 0, so the wrapped
    model computes exactly what `model` did; only the adapters require grad afterwards."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = check_targets(model, lora.target_modules, what=what)
    peft_config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM" if _output_head(model) is not None else None,
    )
    return get_peft_model(model, peft_config)


def merged_tensors(module: torch.nn.Module) -> list[ExportedTensor]:
    """The tensors of `module` under the names (and in the order) the model without LoRA has them: peft's wrappers
    dropped from the paths, each adapted weight merged with its adapter."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    out: list[ExportedTensor] = []
    seen: set[int] = set()

    def emit(name: str, param: torch.nn.Parameter, update: LowRankUpdate | None = None) -> None:
        if id(param) not in seen:  # a tied parameter appears once, as named_parameters() has it
            seen.add(id(param))
            out.append(ExportedTensor(name=name, base=param, update=update))

    def walk(mod: torch.nn.Module, prefix: str) -> None:
        if isinstance(mod, PeftModel):
            walk(mod.get_base_model(), prefix)
        elif isinstance(mod, LoraLayer):
            layer = mod.get_base_layer()
            for name, p in layer.named_parameters(recurse=False):
                update = (
                    LowRankUpdate(
                        a=cast("torch.nn.Parameter", mod.lora_A[ADAPTER].weight),
                        b=cast("torch.nn.Parameter", mod.lora_B[ADAPTER].weight),
                        scaling=float(mod.scaling[ADAPTER]),
                    )
                    if name == "weight"
                    else None
                )
                emit(prefix + name, p, update)
        else:
            for name, p in mod.named_parameters(recurse=False):
                emit(prefix + name, p)
            for name, child in mod.named_children():
                walk(child, f"{prefix}{name}.")

    walk(module, "")
    return out


def peft_part(module: torch.nn.Module) -> PeftModel:
    """The PeftModel in the trained module: the policy itself, or the critic's backbone."""
    from peft import PeftModel

    found = [m for m in module.modules() if isinstance(m, PeftModel)]
    if len(found) != 1:
        raise RuntimeError(f"expected one peft model in {type(module).__name__}, found {len(found)}")
    return found[0]


def adapter_params(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(peft-model name, parameter) of every adapter factor of the trained module's PeftModel."""
    for name, p in peft_part(module).named_parameters():
        if "lora_" in name:
            yield name, p


def adapter_state(module: torch.nn.Module, *, zero3: bool) -> dict[str, torch.Tensor]:
    """The adapter's factors, whole, on the host (under ZeRO-3 a gather: a collective on every rank)."""
    named = list(adapter_params(module))
    if not zero3:
        return {name: p.detach().cpu().clone() for name, p in named}
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
        return {name: p.detach().cpu().clone() for name, p in named}


def save_adapter(module: torch.nn.Module, out: Path, state: dict[str, torch.Tensor], *, base_path: str) -> None:
    """peft's adapter files (adapter_config.json, adapter_model.safetensors) for `PeftModel.from_pretrained`."""
    peft_model = peft_part(module)
    peft_model.save_pretrained(str(out), state_dict=state, safe_serialization=True, save_embedding_layers=False)
    config_file = out / "adapter_config.json"  # the base model is model.path, whatever peft recorded
    data = json.loads(config_file.read_text())
    data["base_model_name_or_path"] = base_path
    write_atomic(config_file, json.dumps(data, indent=2, sort_keys=True))


def describe(lora: LoraConfig | None) -> JsonObject | None:
    """What a checkpoint records of the LoRA setup (compared on Load: the shards only fit the same adapters)."""
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.lora_alpha, "target_modules": list(lora.target_modules)}


class AdapterOffReference(torch.nn.Module):
    """The KL term's reference with LoRA: the trained engine with its adapters switched off computes the base
    model, the initial weights, without a second copy. Called like a model (`frozen_log_probs` does), no grad."""

    def __init__(self, engine: torch.nn.Module):
        super().__init__()
        self._parts = (engine, peft_part(engine))  # a tuple, not submodules: this view owns no parameters

    def forward(self, **inputs: torch.Tensor) -> CausalLMOutputWithPast:
        engine, peft_model = self._parts
        with torch.no_grad(), peft_model.disable_adapter():
            return engine(**inputs)

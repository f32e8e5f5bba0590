"""The DeepSpeed engine around a local Hugging Face model (policy) or a value model (critic).

One optimizer step per Train call: micro-batches accumulate gradients with the accumulation boundary set
by hand (their number varies with the token budget), then `step()` clips, updates and advances the lr
schedule. DeepSpeed averages gradients over data-parallel ranks, so callers scale each rank's loss by the
world size to get the global sum their per-token weights describe.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from services.contracts.config import LORA_ZERO3_OFFLOAD, TandemConfig, TrainerConfig
from services.contracts.untyped import JsonObject
from services.tensors import fused
from services.trainer.algo import head_scoring
from services.trainer.algo.head_scoring import BEHAVIOUR_ROW, TEMPERED_ROW, ChunkSetting
from services.trainer.algo.scoring import TokenSampling, score_request
from services.trainer.batching import MicroBatch
from services.trainer.dist import DistInfo
from services.trainer.model.flat_adamw import FlatAdamW
from services.trainer.model.weight_export import ExportedTensor, plain_tensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def param_dtype(config: TandemConfig) -> torch.dtype:
    """The dtype of the trained module's parameters (DeepSpeed bf16 keeps fp32 masters in the optimizer, bf16_pure
    none)."""
    return torch.float32 if config.trainer.precision == "fp32" else torch.bfloat16


def lr_lambda(
    *, schedule: str, warmup_steps: int, total_steps: int | None, lr: float, min_lr: float
) -> Callable[[int], float]:
    """Factor of the base lr for optimizer step `s` (0-based): linear warm-up that reaches the base lr on
    step warmup_steps - 1, then constant, cosine or linear decay to min_lr at total_steps."""
    if schedule != "constant" and total_steps is None:
        raise ValueError(f"trainer.lr_schedule: {schedule} needs trainer.total_steps (or loop.num_rollout)")
    floor = min_lr / lr
    decay_steps = max(1, total_steps - warmup_steps) if total_steps is not None else 1

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        if schedule == "cosine":
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - (1.0 - floor) * progress

    return factor


def deepspeed_config(config: TandemConfig, *, world_size: int, lr: float) -> JsonObject:
    t = config.trainer
    ds: JsonObject = {
        # One "sample" per micro-batch call; the real batch size is decided by the token budget.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        # ZeRO-0's FlatAdamW clips and handles bf16 itself (DeepSpeed's would do both per parameter tensor)
        "gradient_clipping": 0.0 if t.zero_stage == 0 else t.grad_clip,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": False} if t.zero_stage == 0 else bf16_config(config),
        "zero_optimization": {"stage": t.zero_stage},
    }
    if t.zero_stage == 3:
        # Partition every parameter: by default DeepSpeed keeps ones under 1e5 elements whole, so a small
        # model would never be partitioned and its gathers (weight export, HF save) never exercised.
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if t.optimizer == "adamw_deepspeed":
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": lr, "betas": list(t.betas), "eps": t.eps, "weight_decay": t.weight_decay},
        }
    return ds


def bf16_config(config: TandemConfig) -> JsonObject:
    """bf16: bf16 weights in the model, fp32 master weights, gradients and Adam states in the optimizer (the
    default: an update smaller than a bf16 ulp of its weight is kept, not rounded away). bf16_pure: all of them in
    bf16, as TRL trains (half the optimizer memory, no master copy to update; small updates can be lost)."""
    t = config.trainer
    if t.precision == "fp32":
        return {"enabled": False}
    pure = t.precision == "bf16_pure"
    return {
        "enabled": True,
        "check_grad_overflow": t.skip_nonfinite_steps,
        "bf16_master_weights_and_grads": pure,
        "bf16_optimizer_states": pure,
    }


def load_causal_lm(path: str, *, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)


class ValueModel(torch.nn.Module):
    """Critic: the policy's transformer body with a scalar head; values[b, i] estimates V(tokens[:i+1])."""

    def __init__(self, backbone: PreTrainedModel, hidden_size: int):
        super().__init__()
        self.backbone: torch.nn.Module = backbone  # a peft model around it with trainer.lora
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)  # V = 0 at start: the first advantages are the returns
        torch.nn.init.zeros_(self.value_head.bias)
        self.config = backbone.config

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype, attn: str) -> ValueModel:
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=attn)
        model = cls(backbone, backbone.config.hidden_size)
        return model.to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def _hf_part(model: torch.nn.Module) -> PreTrainedModel:
    """The policy, or the critic's backbone, as the HF model without LoRA wrappers (its config, save_pretrained)."""
    hf = model.backbone if isinstance(model, ValueModel) else model
    unwrap = getattr(hf, "get_base_model", None)  # a peft model (trainer.lora)
    return cast("PreTrainedModel", unwrap() if callable(unwrap) else hf)


def build_model(config: TandemConfig, *, role: str) -> torch.nn.Module:
    """The trained module: the policy (a causal LM) or the critic (ValueModel); with trainer.lora its HF part gets
    peft's LoRA layers, and only they (and the critic's value head) require grad."""
    t = config.trainer
    dtype, attn = param_dtype(config), config.model.attn_implementation
    if role == "critic":
        model: torch.nn.Module = ValueModel.from_pretrained(config.model.path, dtype=dtype, attn=attn)
    else:
        model = load_causal_lm(config.model.path, dtype=dtype, attn=attn)
    if t.activation_checkpointing:
        enable_activation_checkpointing(_hf_part(model))
    if t.lora is None:
        return model if isinstance(model, ValueModel) else _scoring(model)
    from services.trainer.model import lora

    what = f"the {role}'s model at {config.model.path}"
    if isinstance(model, ValueModel):
        model.backbone = lora.wrap(model.backbone, t.lora, what=what)
        return model
    return _scoring(lora.wrap(model, t.lora, what=what))


def _scoring(model: torch.nn.Module) -> torch.nn.Module:
    head_scoring.install(model)  # the output head answers score requests (chunked, no [tokens x vocab] table)
    return model


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Each decoder layer's activations are recomputed in the backward instead of kept (transformers' own
    checkpointing, non-reentrant: it works under DeepSpeed ZeRO 0-3 and with LoRA's frozen inputs)."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.25's name
    if callable(enable):
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@dataclass(frozen=True)
class StepResult:
    grad_norm: float
    lr: float


def _optimizer(
    t: TrainerConfig, model: torch.nn.Module, params: list[torch.nn.Parameter], *, lr: float, device: torch.device
) -> torch.optim.Optimizer | None:
    """ZeRO-0's FlatAdamW, torch's fused AdamW (trainer.optimizer adamw_torch), or None: DeepSpeed's own."""
    if t.zero_stage == 0:
        # on the device first: DeepSpeed's own move would replace the tensors the flat buffers' views are
        model.to(device)
        return FlatAdamW(
            model.named_parameters(),
            precision=t.precision,
            lr=lr,
            betas=t.betas,
            eps=t.eps,
            weight_decay=t.weight_decay,
            max_grad_norm=t.grad_clip,
            skip_nonfinite=t.skip_nonfinite_steps,
        )
    if t.optimizer == "adamw_torch":
        # fused: one kernel over every tensor of the step (DeepSpeed hands it its flat partitions)
        return torch.optim.AdamW(
            params, lr=lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay, fused=device.type == "cuda"
        )
    return None


class DeepSpeedBackend:
    """Owns the DeepSpeed engine: forward passes on micro-batches, backward, step, checkpoints, offload."""

    def __init__(self, *, config: TandemConfig, role: str, dist_info: DistInfo):
        import deepspeed

        t = config.trainer
        self.dist_info = dist_info
        self.zero_stage = t.zero_stage
        torch.manual_seed(t.seed)
        self.lora = t.lora
        model = build_model(config, role=role)
        fused_kernels = use_fused_kernels(config, dist_info.device)
        if fused_kernels:
            fused.patch_model(model)
        lr = (t.critic_lr or t.lr) if role == "critic" else t.lr
        total = t.total_steps or config.loop.num_rollout
        schedule = lr_lambda(
            schedule=t.lr_schedule, warmup_steps=t.warmup_steps, total_steps=total, lr=lr, min_lr=t.min_lr
        )
        self.parameters = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
        self.vocab_size = int(_hf_part(model).config.vocab_size)
        self.chunk_tokens, self.pack_sequences = t.scoring_chunk_tokens, t.pack_sequences
        self.compiled_scoring = fused_kernels  # the head's block math compiled where the fused kernels run
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = _optimizer(t, model, params, lr=lr, device=dist_info.device)
        self.flat: FlatAdamW | None = optimizer if isinstance(optimizer, FlatAdamW) else None
        self.engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=params if optimizer is None else None,
            config=deepspeed_config(config, world_size=dist_info.world_size, lr=lr),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
        )
        self.engine.train()
        if self.flat is not None:
            self.flat.check_bound()
            self.engine.enable_backward_allreduce = False  # FlatAdamW all-reduces its flat buffers in step()
        if fused_kernels:
            fused.warm_up(self.engine.module, dist_info.device)  # compiles now, while the engines start
        # LoRA's frozen base weights: DeepSpeed's offload moves only what its optimizer holds (see offload)
        self._frozen = [p for p in self.engine.module.parameters() if not p.requires_grad]
        self.offloaded = False
        # DeepSpeed's offload_states runs gc.collect() three times; over everything torch, transformers and
        # deepspeed leave tracked, one full collection took 176 ms on CPU and 283 ms next to an H200, so an
        # Offload took 0.5-0.9 s. What is alive now lives for the run: frozen, collections scan only what came
        # later, and an Offload takes 2.5 ms (bench/bench_trainer.py --offload).
        gc.collect()
        gc.freeze()

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def hf_model(self) -> PreTrainedModel:
        """The Hugging Face model inside: the policy, or the critic's backbone (its config, save_pretrained)."""
        return _hf_part(self.module)

    @property
    def device(self) -> torch.device:
        return self.dist_info.device

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    @property
    def global_steps(self) -> int:
        return int(self.engine.global_steps)

    # ---- forward ----------------------------------------------------------------------------------

    def scores(
        self,
        mb: MicroBatch,
        sampling: TokenSampling,
        *,
        tempered: bool = False,
        entropy: bool = False,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the [3, N] scores of the micro-batch's response tokens (head_scoring; `sampling` = theirs, on the
        device), the same tensor as the forward's anchor for an empty micro-batch's backward)."""
        mb = mb.to(self.device)
        request = score_request(
            mb,
            sampling,
            vocab=self.vocab_size,
            chunk_tokens=self.chunk_tokens,
            tempered=tempered,
            entropy=entropy,
            entropy_grad=entropy_grad,
            compiled=self.compiled_scoring,
        )
        with head_scoring.scoring(request):
            out = self.engine(**model_inputs(mb), use_cache=False)
        scores = head_scoring.scores_of(out, request)
        return scores, scores

    def values(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Critic: (values at the response positions [N], all values)."""
        mb = mb.to(self.device)
        values = self.engine(**model_inputs(mb))
        return values[mb.rows, mb.positions], values

    # ---- update -----------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss)
        if self.flat is not None:
            self.flat.fold_grads()

    def step(self) -> StepResult:
        lr = self.lr  # the lr this update uses; step() advances the schedule
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return StepResult(grad_norm=norm, lr=lr)

    # ---- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, directory: Path, *, client_state: JsonObject) -> None:
        """Collective: every rank writes its shards under directory/ds. With LoRA the frozen base weights are left
        out (they are model.path's): the shards hold the adapters and their optimizer state."""
        self.engine.save_checkpoint(
            str(directory),
            tag="ds",
            client_state=client_state,
            save_latest=False,
            exclude_frozen_parameters=self.lora is not None,
        )

    def load_checkpoint(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(
            str(directory),
            tag="ds",
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            custom_load_fn=_load_trainable if self.lora is not None else None,
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory}/ds")

    # ---- export -----------------------------------------------------------------------------------

    def exported_tensors(self) -> list[ExportedTensor]:
        """What weight sync and the HF export send: the model's parameters, or with LoRA the merged weights under
        the base model's names."""
        if self.lora is None:
            return plain_tensors(self.module)
        from services.trainer.model import lora

        return lora.merged_tensors(self.module)

    # ---- offload ----------------------------------------------------------------------------------

    def check_offload_supported(self) -> None:
        if self.zero_stage == 3 and self._frozen:
            raise NotImplementedError(LORA_ZERO3_OFFLOAD)

    def offload(self) -> str:
        self.check_offload_supported()
        if self.offloaded:
            return "already offloaded"
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

        pin = self.device.type == "cuda"
        if self.flat is not None:
            self.flat.move(torch.device("cpu"), pin=pin)
        else:
            self.engine.offload_states(device=OffloadDeviceEnum.cpu, pin_memory=pin, non_blocking=False)
        for p in self._frozen:  # ZeRO 1/2: whole tensors of the module, outside DeepSpeed's buffers
            host = p.data.to("cpu")
            p.data = host.pin_memory() if pin else host
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back, so the engines on this GPU can use them
        self.offloaded = True
        return "parameters, gradients and optimizer states moved to host memory"

    def onload(self) -> str:
        if not self.offloaded:
            return "not offloaded"
        if self.flat is not None:
            self.flat.move(self.device)
        else:
            self.engine.reload_states(non_blocking=False)
        for p in self._frozen:
            p.data = p.data.to(self.device)
        self.offloaded = False
        return f"states reloaded to {self.device}"

    def close(self) -> None:
        self.engine.destroy()


def use_fused_kernels(config: TandemConfig, device: torch.device) -> bool:
    return fused.enabled(config.model.fused_kernels, device=device, dtype=param_dtype(config))


def _load_trainable(*, src: dict[str, torch.Tensor], dst: torch.nn.Module) -> None:
    """A LoRA checkpoint's module state holds the trainable parameters only: every one of them must be there,
    nothing else may be (a checkpoint of other adapters, or of full fine-tuning, is refused)."""
    result = dst.load_state_dict(src, strict=False)
    frozen = {name for name, p in dst.named_parameters() if not p.requires_grad}
    missing = sorted(set(result.missing_keys) - frozen)
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the checkpoint does not hold this trainer's adapters: missing {missing[:3]}, "
            f"unexpected {sorted(result.unexpected_keys)[:3]}"
        )


def load_frozen_causal_lm(config: TandemConfig, device: torch.device, *, path: str | None = None) -> torch.nn.Module:
    """A frozen copy of the policy from model.path in the trainer's dtype: the reference model of the KL term
    (the initial weights), and the old actor's container (keep_old_actor loads snapshots into it); of another
    model at `path` (the distillation teacher) the same way."""
    model = load_causal_lm(path or config.model.path, dtype=param_dtype(config), attn=config.model.attn_implementation)
    model = _scoring(model.to(device))
    if use_fused_kernels(config, device):
        fused.patch_model(model)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def model_inputs(mb: MicroBatch) -> dict[str, torch.Tensor | None]:
    """A micro-batch as the model's forward takes it: padded rows under their attention mask, or packed rows
    (several samples per row) by their position ids, from which transformers masks attention per sample."""
    if mb.position_ids is None:
        return {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask}
    return {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "attention_mask": None}


@torch.no_grad()
def frozen_log_probs(
    model: torch.nn.Module,
    mb: MicroBatch,
    device: torch.device,
    *,
    sampling: TokenSampling,
    tempered: bool,
    vocab: int,
    chunk_tokens: ChunkSetting,
    compiled: bool = False,
) -> torch.Tensor:
    """Log-probs of a micro-batch's response tokens under a frozen model, on `device`: in each token's behaviour
    space, or (`tempered`, the KL's reference) of logits / T."""
    mb = mb.to(device)
    request = score_request(mb, sampling, vocab=vocab, chunk_tokens=chunk_tokens, tempered=tempered, compiled=compiled)
    with head_scoring.scoring(request):
        out = model(**model_inputs(mb), use_cache=False)
    return head_scoring.scores_of(out, request)[TEMPERED_ROW if tempered else BEHAVIOUR_ROW]

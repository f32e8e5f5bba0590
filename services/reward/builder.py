"""The reward service's parts, built once per process: the device (with `memory_fraction` when colocated on a GPU),
then each model of reward.models by its type. `build_reward(config).parts()` is what RewardService takes."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from services.contracts.config import TandemConfig
from services.contracts.reward_config import ClassifierModelConfig, JudgeModelConfig, RewardServiceConfig
from services.reward.models import RewardModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardParts:
    """What RewardService runs on: the models by name, the device they are on, and the limits of a request."""

    models: Mapping[str, RewardModel]
    device: str
    max_request_samples: int


def build_model(model: ClassifierModelConfig | JudgeModelConfig, *, device: str) -> RewardModel:
    """One model of reward.models, by its type."""

    from services.rollout.engines.native.engine import resolve_device

    where = resolve_device(device)
    match model:
        case ClassifierModelConfig():
            from services.reward.classifier import ClassifierModel

            return ClassifierModel(model, device=where)
        case JudgeModelConfig():
            from services.reward.judge import JudgeModel
            from services.rollout.chat_template import ChatTemplate
            from services.rollout.engines.native.engine import NativeEngine
            from services.rollout.tokenizer import Texts, end_of_generation_ids, load_tokenizer

            tokenizer = load_tokenizer(model.tokenizer_path or model.path)
            texts = Texts(tokenizer, ChatTemplate(tokenizer, source=f"the chat template of {model.path}"))
            engine = NativeEngine(
                model.path,
                device=str(where),
                dtype=model.dtype,
                max_batch_size=model.max_batch_size,
                eos_token_ids=end_of_generation_ids(model.path, tokenizer) or None,
                detokenizer=texts,
            )
            return JudgeModel(model, engine=engine, texts=texts)


def claim_memory(reward: RewardServiceConfig) -> str:
    """The device the models go on; on a GPU shared with the rollout, this process's share of its memory."""
    from services.rollout.engines.native.engine import resolve_device
    from services.tensors.devices import limit_cpu_threads

    device = resolve_device(reward.device)
    limit_cpu_threads(reward.cpu_threads, device)
    if reward.memory_fraction is not None and device.type == "cuda":
        import torch

        torch.cuda.set_per_process_memory_fraction(reward.memory_fraction, device)
    return str(device)


def build_reward(config: TandemConfig) -> RewardParts:
    if config.reward is None:
        raise ValueError("tandem reward: the config has no reward: section (reward.models names what to serve)")
    device = claim_memory(config.reward)
    models: dict[str, RewardModel] = {}
    for name, model in config.reward.models.items():
        started = time.monotonic()
        try:
            models[name] = build_model(model, device=device)
        except (OSError, ValueError) as exc:
            raise ValueError(f"reward.models.{name}: {exc}") from exc
        log.info("startup: reward model %s (%s) ready in %.2fs", name, model.type, time.monotonic() - started)
    return RewardParts(
        models=MappingProxyType(models), device=device, max_request_samples=config.rollout.max_request_samples
    )

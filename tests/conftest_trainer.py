"""Helpers and fixtures of the trainer tests (imported by tests/test_trainer_*.py; not a pytest conftest).

- `tiny_model_dir`: a random-init 2-layer, hidden-64 Llama (vocab 32) saved with save_pretrained.
- `trainer_config(...)`: a TandemConfig for one trainer, Redis at the given URL, its own stream.
- `DEVICE`: the trainer device of these tests, cpu unless TANDEM_TEST_TRAINER_DEVICE says otherwise.
- `make_batch(...)`: a deterministic rollout batch of `groups` prompts × `group_size` samples, optionally
  with the log-probs the tiny model itself assigns (so PPO ratios start at exactly 1).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.common.config import TandemConfig, config_from_dict
from services.common.wire import RolloutBatchData, build_batch

VOCAB = 32
# CI runs on CPU; TANDEM_TEST_TRAINER_DEVICE=cuda runs the same tests on a GPU machine.
DEVICE = os.environ.get("TANDEM_TEST_TRAINER_DEVICE", "cpu")


def build_tiny_model(out_dir: Path, *, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "model")


def trainer_config(*, model_dir: Path, run_dir: Path, redis_url: str | None, trainer: dict[str, Any] | None = None,
                   algorithm: dict[str, Any] | None = None, run_name: str | None = None,
                   loop: dict[str, Any] | None = None) -> TandemConfig:
    data = {
        "run_name": run_name or f"t{uuid.uuid4().hex[:8]}",
        "model": {"path": str(model_dir), "attn_implementation": "eager"},
        "data": {"train_path": str(run_dir / "unused.jsonl")},
        "trainer": {"device": DEVICE, "lr": 1e-2, "micro_batch_tokens": 64, "export_hf_on_save": False,
                    **(trainer or {})},
        "algorithm": {"use_rollout_logprobs": True, **(algorithm or {})},
        "loop": {"mode": "async", **(loop or {})},
        "redis": {"url": redis_url, "get_timeout_s": 5.0, "max_buffered_batches": 64},
    }
    return config_from_dict(data, source="test")


def model_log_probs(model_dir: Path, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            ids = torch.tensor([p + r])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            out.append([float(logp[len(p) - 1 + j, t]) for j, t in enumerate(r)])
    return out


def make_batch(*, rollout_id: int = 0, groups: int = 3, group_size: int = 4, seed: int = 0, version: int = 0,
               model_dir: Path | None = None, sample_versions: list[int] | None = None) -> RolloutBatchData:
    rng = np.random.default_rng(seed)
    n = groups * group_size
    prompts = [[1, *rng.integers(4, VOCAB, size=int(rng.integers(2, 5))).tolist()] for _ in range(groups)
               for _ in range(group_size)]
    responses = [rng.integers(4, VOCAB, size=int(rng.integers(2, 7))).tolist() for _ in range(n)]
    rewards = rng.integers(0, 2, size=n).astype(float).tolist()
    log_probs = model_log_probs(model_dir, prompts, responses) if model_dir else [[-1.0] * len(r) for r in responses]
    return build_batch(rollout_id=rollout_id, policy_version=version, prompts=prompts, responses=responses,
                       log_probs=log_probs, rewards=rewards,
                       group_ids=[rollout_id * 1000 + i // group_size for i in range(n)],
                       finish_reasons=["stop"] * n, sample_versions=sample_versions)


class TrainerHarness:
    """An in-process TrainerService plus a producer handle on its stream (tests drive it directly)."""

    def __init__(self, config: TandemConfig, *, run_dir: Path, role: str = "actor"):
        from services.common.buffer import RolloutBuffer, connect, stream_key
        from services.trainer.service import TrainerService

        self.config = config
        self.service = TrainerService(config, run_dir=run_dir, role=role)
        groups = ("actor", "critic") if config.algorithm.uses_critic else ("actor",)
        self.client = connect(config.redis.url)
        self.stream = stream_key(config.redis.stream_prefix, config.run_name)
        self.producer = RolloutBuffer(self.client, self.stream, groups=groups, max_buffered_batches=64)

    def put(self, batch: RolloutBatchData) -> str:
        return self.producer.put(batch, timeout_s=5.0)

    def pending(self, group: str = "actor") -> int:
        return int(self.client.xpending(self.stream, group)["pending"])

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
            self.client.close()
            self.service = None

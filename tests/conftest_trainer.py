"""Helpers and fixtures of the trainer tests (imported by tests/test_trainer_*.py; not a pytest conftest).

- `tiny_model_dir`: a random-init 2-layer, hidden-64 Llama (vocab 32) saved with save_pretrained;
  `peaked_model_dir` the same with 20x larger init weights, so its next-token distributions are peaked (a
  temperature or nucleus then changes log-probs a lot).
- `harness`: makes in-process trainers (`TrainerHarness`) on the session's redis-server, closed afterwards.
- `trainer_config(...)`: a TandemConfig for one trainer, Redis at the given URL, its own stream; the scoring head
  works in 5-token chunks, so every trainer test crosses chunk boundaries.
- `DEVICE`: the trainer device of these tests, cpu unless TANDEM_TEST_TRAINER_DEVICE says otherwise.
- `make_batch(...)`: a deterministic rollout batch of `groups` prompts x `group_size` samples, optionally
  with the log-probs the tiny model itself assigns under the batch's sampling distribution (computed by the
  independent reference in rl_reference.py), so PPO ratios start at exactly 1.
"""

from __future__ import annotations

import functools
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rl_reference
import torch

from services.contracts.config import TandemConfig
from services.contracts.config_loading import config_from_dict
from services.contracts.sampling_spec import SamplingSpec
from services.contracts.wire import RolloutBatchData, build_batch
from services.trainer.parts import TrainerParts

VOCAB = 32
# CI runs on CPU; TANDEM_TEST_TRAINER_DEVICE=cuda runs the same tests on a GPU machine.
DEVICE = os.environ.get("TANDEM_TEST_TRAINER_DEVICE", "cpu")
DEFAULT_SAMPLING = SamplingSpec()  # temperature 1, no truncation


def build_tiny_model(out_dir: Path, *, seed: int = 0, initializer_range: float = 0.02) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=initializer_range,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "model")


@pytest.fixture(scope="session")
def peaked_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("peaked_model") / "model", initializer_range=0.4)


def trainer_config(
    *,
    model_dir: Path,
    run_dir: Path,
    redis_url: str | None,
    trainer: dict[str, Any] | None = None,
    algorithm: dict[str, Any] | None = None,
    run_name: str | None = None,
    loop: dict[str, Any] | None = None,
    rollout: dict[str, Any] | None = None,
) -> TandemConfig:
    data = {
        "run_name": run_name or f"t{uuid.uuid4().hex[:8]}",
        "model": {"path": str(model_dir), "attn_implementation": "eager"},
        "data": {"train_path": str(run_dir / "unused.jsonl")},
        "trainer": {
            "device": DEVICE,
            "lr": 1e-2,
            "micro_batch_tokens": 64,
            "scoring_chunk_tokens": 5,
            "export_hf_on_save": False,
            **(trainer or {}),
        },
        "algorithm": {"use_rollout_logprobs": True, **(algorithm or {})},
        "rollout": rollout or {},
        "loop": {"mode": "async", **(loop or {})},
        "redis": {"url": redis_url, "get_timeout_s": 5.0, "max_buffered_batches": 64},
    }
    return config_from_dict(data, source="test")


@functools.lru_cache(maxsize=4)
def _load_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def model_logits(model_dir: Path, prompts: list[list[int]], responses: list[list[int]]) -> list[list[list[float]]]:
    """Per sample, per response token: the tiny model's logits at the position that predicts it."""
    model = _load_model(str(model_dir))
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses, strict=True):
            logits = model(input_ids=torch.tensor([p + r])).logits[0].float()
            out.append([logits[len(p) - 1 + j].tolist() for j in range(len(r))])
    return out


def model_log_probs(
    model_dir: Path, prompts: list[list[int]], responses: list[list[int]], sampling: SamplingSpec = DEFAULT_SAMPLING
) -> list[list[float]]:
    """The log-prob of each response token under the tiny model's sampling distribution (reference formula)."""
    rows = model_logits(model_dir, prompts, responses)
    s = sampling
    return [
        [
            rl_reference.sampling_log_probs(row, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)[t]
            for row, t in zip(sample, r, strict=True)
        ]
        for sample, r in zip(rows, responses, strict=True)
    ]


def make_batch(
    *,
    rollout_id: int = 0,
    groups: int = 3,
    group_size: int = 4,
    seed: int = 0,
    version: int = 0,
    model_dir: Path | None = None,
    sample_versions: list[int] | None = None,
    sampling: SamplingSpec = DEFAULT_SAMPLING,
    loss_masks: list[list[int]] | None = None,
) -> RolloutBatchData:
    rng = np.random.default_rng(seed)
    n = groups * group_size
    prompts = [
        [1, *rng.integers(4, VOCAB, size=int(rng.integers(2, 5))).tolist()]
        for _ in range(groups)
        for _ in range(group_size)
    ]
    responses = [rng.integers(4, VOCAB, size=int(rng.integers(2, 7))).tolist() for _ in range(n)]
    rewards = rng.integers(0, 2, size=n).astype(float).tolist()
    if model_dir:
        responses = [_within_support(model_dir, p, r, sampling) for p, r in zip(prompts, responses, strict=True)]
    log_probs = (
        model_log_probs(model_dir, prompts, responses, sampling) if model_dir else [[-1.0] * len(r) for r in responses]
    )
    return build_batch(
        rollout_id=rollout_id,
        policy_version=version,
        prompts=prompts,
        responses=responses,
        log_probs=log_probs,
        rewards=rewards,
        group_ids=[rollout_id * 1000 + i // group_size for i in range(n)],
        finish_reasons=["stop"] * n,
        sampling=sampling,
        sample_versions=sample_versions,
        loss_masks=loss_masks,
    )


def _within_support(model_dir: Path, prompt: list[int], response: list[int], sampling: SamplingSpec) -> list[int]:
    """The response with every token the truncated distribution excludes replaced by its most likely token
    (a sampler can only have drawn tokens of its support)."""
    if sampling.top_p >= 1.0 and not 0 < sampling.top_k < VOCAB:
        return response
    out: list[int] = []
    for token in response:
        row = model_logits(model_dir, [prompt], [[*out, token]])[0][-1]
        lps = rl_reference.sampling_log_probs(
            row, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k
        )
        out.append(token if lps[token] != rl_reference.NEG_INF else max(range(VOCAB), key=lambda i: lps[i]))
    return out


@pytest.fixture
def harness(tiny_model_dir, tmp_path, redis_server):
    made = []

    def make(*, role: str = "actor", run_dir=None, model_dir=None, **sections) -> TrainerHarness:
        h = TrainerHarness(
            trainer_config(
                model_dir=model_dir or tiny_model_dir,
                run_dir=run_dir or tmp_path,
                redis_url=redis_server.url,
                **sections,
            ),
            run_dir=run_dir or tmp_path,
            role=role,
        )
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


class ConcreteTrainer:
    """The concrete objects behind a built trainer's parts: its DeepSpeed backend, its step (and the old actor the
    step scores with), where it computes."""

    def __init__(self, parts: TrainerParts):
        from services.trainer.model.backend import DeepSpeedBackend
        from services.trainer.training import TrainStep

        assert isinstance(parts.backend, DeepSpeedBackend) and isinstance(parts.step, TrainStep)
        self.parts, self.backend, self.step = parts, parts.backend, parts.step
        self.old_actor = parts.step.old_actor
        self.dist = parts.backend.dist_info


class TrainerHarness:
    """An in-process TrainerService plus a producer handle on its stream (tests drive it directly)."""

    def __init__(self, config: TandemConfig, *, run_dir: Path, role: str = "actor"):
        from services.buffer.stream import RolloutBuffer, connect, stream_key
        from services.trainer.builder import build_trainer
        from services.trainer.service import TrainerService

        self.config = config
        parts = build_trainer(config, run_dir=run_dir, role=role)
        self.trainer = ConcreteTrainer(parts)  # the objects behind the parts, for tests that look into the model
        self.service = TrainerService(parts)
        self.closed = False
        groups = ("actor", "critic") if config.algorithm.uses_critic else ("actor",)
        assert config.redis.url is not None, "a trainer harness needs the session's redis-server"
        self.client = connect(config.redis.url)
        self.stream = stream_key(config.redis.stream_prefix, config.run_name)
        self.producer = RolloutBuffer(self.client, self.stream, groups=groups, max_buffered_batches=64)

    def put(self, batch: RolloutBatchData) -> str:
        return self.producer.put(batch, timeout_s=5.0)

    def pending(self, group: str = "actor") -> int:
        return int(self.client.xpending(self.stream, group)["pending"])

    def close(self) -> None:
        if not self.closed:
            self.service.close()
            self.client.close()
            self.closed = True

"""The reward service's models on a CUDA device (skipped without one): the classifier's scores equal its CPU
scores and transformers' pipeline on the GPU, the judge generates on the GPU, and `reward.memory_fraction` (a
reward service colocated on the rollout's GPU) caps what this process may allocate there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.contracts.config_loading import config_from_dict
from services.contracts.reward_calls import RewardSample, ScoreRequest
from services.modelinit.init_model import init_model
from services.reward.builder import build_reward
from services.reward.service import RewardService

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SAMPLES = tuple(
    RewardSample(prompt=f"{a} {b} =", response=str(r), label=str(max(a, b)))
    for a, b, r in ((3, 7, 7), (3, 7, 3), (9, 0, 9), (1, 1, 0))
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rw")
    return init_model(root / "rm", preset="classifier", seed=1), init_model(root / "judge", preset="tiny", seed=1)


def service(models: tuple[Path, Path], device: str, **section: object) -> RewardService:
    rm, judge = models
    section = {
        "device": device,
        "models": {
            "rm": {"type": "classifier", "path": str(rm)},
            "j": {
                "type": "judge",
                "path": str(judge),
                "template": "{{ prompt }} {{ response }} =",
                "max_new_tokens": 2,
            },
        },
        **section,
    }
    return RewardService(
        build_reward(config_from_dict({"model": {"path": "m"}, "data": {"train_path": "t"}, "reward": section}))
    )


def test_the_models_score_on_the_gpu_as_on_the_cpu(models):
    gpu, cpu = service(models, "cuda"), service(models, "cpu")
    assert gpu.get_state().device.startswith("cuda")
    on_gpu = gpu.score(ScoreRequest(model="rm", samples=SAMPLES)).scores
    assert on_gpu == pytest.approx(cpu.score(ScoreRequest(model="rm", samples=SAMPLES)).scores, abs=1e-4)
    verdicts = gpu.score(ScoreRequest(model="j", samples=SAMPLES)).verdicts
    assert verdicts == cpu.score(ScoreRequest(model="j", samples=SAMPLES)).verdicts  # greedy: the same tokens


def test_memory_fraction_caps_the_reward_service_on_a_shared_gpu(models):
    service(models, "cuda", memory_fraction=0.05)
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
    torch.cuda.set_per_process_memory_fraction(1.0)

"""Every example config under examples/ loads, and what preflight can check without its model holds: the engine
settings, the data files, the reward and environment plug-ins, and (where the config sizes the context) that the
longest prompt plus max_new_tokens fits. The GPU examples run on the device (bench/gpu_suite.py); here they are only
checked, so a typo in one is found by CI rather than after a GPU machine started."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.contracts.config_loading import load_config
from services.launcher import preflight
from services.rollout.model_init import init_model
from services.rollout.rewards import resolve_reward
from services.rollout.tokenizer import load_tokenizer

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_the_examples_are_found():
    assert {p.name for p in EXAMPLES} >= {"digit_max.yaml", "digit_max_gpu.yaml", "qwen05_gpu.yaml",
                                          "qwen15_gpu.yaml", "tool_lookup.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_an_example_config_passes_the_checks_that_need_no_model(path, tmp_path_factory):
    config = load_config(str(path), [])
    preflight.check_engine(config)
    records = preflight.check_data(config)
    resolve_reward(config.rollout.reward)
    preflight._check_environment(config.rollout.environment)
    limit = config.rollout.max_context_length
    if limit is not None:   # every preset shares the tiny model's tokenizer
        tokenizer = load_tokenizer(init_model(tmp_path_factory.mktemp("tok") / "tiny", preset="tiny", seed=0))
        prompts = preflight.model_prompts(config, records, tokenizer)
        longest = max(len(ids) for encoded in prompts.values() for ids in encoded.ids)
        assert longest + config.rollout.sampling.max_new_tokens <= limit, (longest, limit)


def test_the_long_digit_reward_reads_only_the_first_digit_of_a_forced_length_response():
    reward = resolve_reward(str(Path(__file__).resolve().parents[1] / "examples/digit_max_long/reward.py") + ":reward")
    assert reward.score(prompts=["3 7 1 ="] * 3, responses=["7 9 9 </s> 1", "  7", "9 7"], labels=["7"] * 3,
                        metadatas=[{}] * 3) == [1.0, 1.0, 0.0]

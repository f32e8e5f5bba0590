"""Every example config under examples/ loads, and what preflight can check without its model holds: the engine
settings, the data files, the reward and environment plug-ins, and (where the config sizes the context) that the
longest prompt plus max_new_tokens fits. The GPU examples run on the device (bench/gpu_suite.py); here they are only
checked, so a typo in one is found by CI rather than after a GPU machine started."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from services.contracts.config_loading import load_config
from services.launcher import preflight
from services.rollout import bpe_tokenizer
from services.rollout.model_families import MODEL_PRESETS
from services.rollout.model_init import init_model
from services.rollout.rewards import resolve_reward
from services.rollout.tokenizer import load_tokenizer

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_the_examples_are_found():
    assert {p.name for p in EXAMPLES} >= {
        "digit_max.yaml",
        "digit_max_gpu.yaml",
        "math_chat.yaml",
        "qwen05_gpu.yaml",
        "qwen15_gpu.yaml",
        "tool_lookup.yaml",
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_an_example_config_passes_the_checks_that_need_no_model(path, tmp_path_factory):
    config = load_config(str(path), [])
    preflight.check_engine(config)
    records = preflight.check_data(config)
    resolve_reward(config.rollout.reward)
    preflight._check_environment(config.rollout.environment)
    limit = config.rollout.max_context_length
    if limit is not None:  # the tokenizer --init-model would build, without its model
        tokenizer = preset_tokenizer(config.model.init_preset or "tiny", tmp_path_factory)
        prompts = preflight.model_prompts(config, records, tokenizer)
        longest = max(length for encoded in prompts.values() for length in encoded.lengths)
        assert longest + config.rollout.sampling.max_new_tokens <= limit, (longest, limit)


def preset_tokenizer(preset: str, tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """A real model's preset: its local BPE tokenizer (trained in about a second); a toy preset: the word-level one
    they all share."""
    if preset in MODEL_PRESETS:
        return bpe_tokenizer.build_tokenizer(MODEL_PRESETS[preset].family, model_max_length=4096)
    return load_tokenizer(init_model(tmp_path_factory.mktemp("tok") / "tiny", preset="tiny", seed=0))


def test_the_long_digit_reward_reads_only_the_first_digit_of_a_forced_length_response():
    reward = resolve_reward(str(Path(__file__).resolve().parents[1] / "examples/digit_max_long/reward.py") + ":reward")
    assert reward.score(
        prompts=["3 7 1 ="] * 3, responses=["7 9 9 </s> 1", "  7", "9 7"], labels=["7"] * 3, metadatas=[{}] * 3
    ) == [1.0, 1.0, 0.0]


def test_the_math_chat_generator_writes_the_same_chat_parquet_every_time_and_math_answer_scores_its_solutions(tmp_path):
    import importlib.util

    from services.contracts.config import DataConfig
    from services.coordinator.data import load_prompts

    spec = importlib.util.spec_from_file_location("make_data", EXAMPLES[0].parent / "math_chat" / "make_data.py")
    assert spec is not None and spec.loader is not None
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    for out in ("a", "b"):
        assert make_data.main(["--out", str(tmp_path / out), "--train", "40", "--eval", "10"]) == 0
    for name in ("train.parquet", "eval.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    records = load_prompts(
        str(tmp_path / "a" / "train.parquet"),
        DataConfig(train_path="unused", prompt_key="messages", label_key="answer"),
    )
    assert len(records) == 40 and all(len(r.messages) == 1 and r.messages[0].role == "user" for r in records)
    assert {r.metadata["kind"] for r in records} == set(make_data.KINDS)
    solutions = [r.metadata["solution"] for r in records]
    scores = resolve_reward("math_answer").score(
        prompts=[""] * 40, responses=solutions, labels=[r.label for r in records], metadatas=[{}] * 40
    )
    assert scores == [1.0] * 40

"""Every example config under examples/ loads, and what preflight can check without its model holds: the engine
settings, the data files, the reward and environment plug-ins, and (where the config sizes the context) that the
longest prompt plus max_new_tokens fits. The GPU examples run on the device (bench/gpu_suite.py); here they are only
checked, so a typo in one is found by CI rather than after a GPU machine started."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path
from types import ModuleType

import pyarrow.parquet as pq
import pytest
from transformers import PreTrainedTokenizerBase

from services.contracts.config_loading import load_config
from services.launcher import preflight
from services.modelinit import bpe_tokenizer
from services.modelinit.families import MODEL_PRESETS
from services.modelinit.init_model import init_model
from services.rollout.reward_mix import check_rule_terms
from services.rollout.rewards import resolve_reward
from services.rollout.tokenizer import load_tokenizer

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_the_examples_are_found():
    assert {p.name for p in EXAMPLES} >= {
        "digit_max.yaml",
        "digit_max_gpu.yaml",
        "distill.yaml",
        "judge.yaml",
        "math_chat.yaml",
        "qwen05_gpu.yaml",
        "qwen15_gpu.yaml",
        "tool_lookup.yaml",
        "agent_tools.yaml",
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_an_example_config_passes_the_checks_that_need_no_model(path, tmp_path_factory):
    config = load_config(str(path), [])
    preflight.check_engine(config)
    records = preflight.check_data(config)
    check_rule_terms(config.rollout.reward)  # a reward-service model is the config's to check, and is checked there
    preflight._check_environment(config.rollout.environment)
    preflight._check_agents(config)
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


MATH_CHAT = EXAMPLES[0].parent / "math_chat"


def math_chat_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_data", MATH_CHAT / "make_data.py")
    assert spec is not None and spec.loader is not None
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    return make_data


def test_the_math_chat_generator_writes_the_same_chat_parquet_every_time_and_math_answer_scores_its_solutions(tmp_path):
    from services.contracts.config import DataConfig
    from services.coordinator.data import load_prompts

    make_data = math_chat_generator()
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


def test_the_committed_math_chat_files_are_what_the_generator_writes_by_default(tmp_path):
    """The example's data is make_data.py's default output, row for row (the bytes carry pyarrow's version)."""
    assert math_chat_generator().main(["--out", str(tmp_path)]) == 0
    for name in ("train.parquet", "eval.parquet"):
        assert pq.read_table(MATH_CHAT / name).to_pylist() == pq.read_table(tmp_path / name).to_pylist(), name


def test_the_gsm8k_command_of_the_own_task_page_makes_a_valid_config():
    """docs/own-task.md's `tandem run examples/math_chat.yaml --set ...` for a real GSM8K and Qwen2.5-0.5B-Instruct
    validates (its paths are the reader's: only the config is checked)."""
    page = (EXAMPLES[0].parents[1] / "docs" / "own-task.md").read_text()
    command = page[page.index("tandem run examples/math_chat.yaml --set") :].split("```")[0].replace("\\\n", " ")
    words = shlex.split(command)
    sets = [words[i + 1] for i, word in enumerate(words) if word == "--set"]
    config = load_config(str(EXAMPLES[0].parent / words[2].removeprefix("examples/")), sets)
    assert (config.model.path, config.data.prompt_key, config.data.label_key) == (
        "/models/Qwen2.5-0.5B-Instruct",
        "prompt",
        "reward_model.ground_truth",
    )
    assert config.data.chat_template == "auto" and config.rollout.reward == "math_answer"
    assert config.rollout.sampling.stop == () and config.rollout.sampling.max_new_tokens == 512
    assert config.loop.num_rollout is None and config.weights.transport == "cuda_ipc"
    assert (config.trainer.lr, config.trainer.eps) == (1e-6, 1e-8)  # not the tiny example's AdamW-as-SGD

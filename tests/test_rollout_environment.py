"""RolloutService with an environment (rollout.environment): the example lookup environment played by the real
native engine on the tiny model, batches written to a real redis-server and decoded as the trainer reads them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.buffer.stream import RolloutBuffer, connect
from services.contracts.config import ConfigError
from services.contracts.config_loading import config_from_dict, load_config
from services.contracts.rollout_calls import EvaluateRequest, GenerateRequest
from services.contracts.sampling_spec import SamplingSpec
from services.rollout.builder import build_rollout
from services.rollout.math_feedback import FEEDBACK
from services.rollout.math_rewards import math_answer
from services.rollout.service import PromptInput, RolloutService

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
LOOKUP = "examples/tool_lookup/env.py:LookupEnvironment"


def make_service(model: Path, redis_url: str, **rollout) -> RolloutService:
    config = config_from_dict(
        {
            "run_name": "env-test",
            "model": {"path": str(model)},
            "data": {"train_path": "unused.jsonl"},
            "rollout": {
                "device": "cpu",
                "n_samples_per_prompt": 4,
                "environment": LOOKUP,
                "max_turns": 3,
                "sampling": {"temperature": 1.0, "max_new_tokens": 1, "seed": 3},
                **rollout,
            },
            "redis": {"url": redis_url},
        }
    )
    return RolloutService(build_rollout(config, replica=0))


@pytest.fixture(scope="module")
def service(example_model: Path, redis_server) -> Iterator[RolloutService]:
    svc = make_service(example_model, redis_server.url)
    yield svc
    svc.close()


def lookup_prompts(n: int, start_group: int = 0) -> list[PromptInput]:
    rows = [json.loads(line) for line in (REPO / "examples/tool_lookup/eval.jsonl").read_text().splitlines()][:n]
    return [
        PromptInput(text=r["prompt"], label=r["label"], group_id=start_group + i, metadata={"table": r["table"]})
        for i, r in enumerate(rows)
    ]


def read_batch(url: str, stream: str, entry_id: str):
    buf = RolloutBuffer(connect(url), stream, groups=("actor",), group="actor", consumer="actor-0")
    entry = buf.read([entry_id], timeout_s=10)[0]
    buf.ack([entry_id])
    return entry.batch


def replay(service: RolloutService, prompt: PromptInput, response: list[int]) -> tuple[list[int], float]:
    """The lookup environment's rules replayed over a response: (its loss mask, its reward). Asserts that each
    call is followed by exactly the observation `) v` and that an answer (or any other token) ends the episode."""
    call = service.texts.encode_text("(")[0]
    j, looked_up, mask, reward = 0, False, [], 0.0
    while j < len(response):
        mask.append(1)
        if response[j] == call:
            looked_up = True
            observation = service.texts.encode_text(f") {prompt.metadata['table'][int(prompt.text.split()[0])]}")
            assert response[j + 1 : j + 1 + len(observation)] == observation
            mask += [0] * len(observation)
            j += 1 + len(observation)
        else:
            reward = float(looked_up and service.texts.decode([response[j]]) == prompt.label)
            j += 1
            assert j == len(response)
    return mask, reward


def test_episodes_reach_the_wire_with_observations_masked_and_their_log_probs_zero(service, redis_server, stream):
    """Every episode is prompt, then turns: a call `(` followed by the observation `) v` (loss_mask 0, log-prob 0),
    or an answer (the engine's log-prob), which ends it; the reward is the environment's."""
    prompts = lookup_prompts(16)
    result = service.generate(GenerateRequest(rollout_id=0, prompts=tuple(prompts), stream=stream))
    batch = read_batch(redis_server.url, stream, result.entry_id)
    assert batch.num_samples == 64 and batch.metadata["environment"].endswith("LookupEnvironment")
    assert batch.metadata["max_turns"] == "3" and batch.metadata["episode_reward"] == "env"
    call = service.texts.encode_text("(")[0]
    calls = 0
    for i, (p_sl, r_sl, t_sl) in enumerate(batch.sample_slices()):
        prompt = prompts[i // 4]
        assert service.texts.decode(batch.tokens[p_sl].tolist()) == prompt.text
        response = batch.tokens[r_sl].tolist()
        mask, log_probs = batch.loss_mask[t_sl].tolist(), batch.rollout_log_probs[t_sl].tolist()
        assert (mask, float(batch.rewards[i])) == replay(service, prompt, response)
        assert all(lp == 0.0 for lp, m in zip(log_probs, mask, strict=True) if not m)
        assert all(lp < 0.0 for lp, m in zip(log_probs, mask, strict=True) if m)
        ran_out = sum(mask) == 3 and response[-1] == call  # three calls: max_turns, not done
        assert batch.finish_reasons[i] == ("length" if ran_out else "stop")
        calls += response.count(call)
    # the untrained policy calls in a few percent of turns: 64 seeded episodes on the seed-0 model hold some
    assert calls > 0
    m = result.metrics
    assert m["reward_mean"] == pytest.approx(float(batch.rewards.mean()))
    assert m["env_turns_mean"] == pytest.approx(float(batch.loss_mask.sum()) / 64)
    assert m["env_end_done_frac"] + m["env_end_max_turns_frac"] == 1.0
    assert m["env_observation_token_frac"] == pytest.approx(1 - batch.loss_mask.mean())


def test_evaluate_plays_episodes_and_reports_environment_metrics(service):
    result = service.evaluate(
        EvaluateRequest(
            name="tool",
            prompts=tuple(lookup_prompts(10)),
            sampling=SamplingSpec(temperature=0.0, max_new_tokens=1).params(),
        )
    )
    assert result.metrics["tool/num_samples"] == 10.0 and 1.0 <= result.metrics["tool/env_turns_mean"] <= 3.0
    assert 0.0 <= result.metrics["tool/reward_mean"] <= 1.0


def test_env_plus_reward_adds_the_reward_function_and_env_alone_refuses_a_requested_one(
    example_model, redis_server, stream, service
):
    with pytest.raises(ValueError, match=r"rollout\.episode_reward is env"):
        service.generate(
            GenerateRequest(rollout_id=1, prompts=tuple(lookup_prompts(1)), stream=stream, reward="exact_match")
        )
    both = make_service(
        example_model,
        redis_server.url,
        episode_reward="env_plus_reward",
        reward=f"{REPO}/examples/digit_max/reward.py:reward",
    )
    try:
        prompts = lookup_prompts(8)
        result = both.generate(GenerateRequest(rollout_id=2, prompts=tuple(prompts), stream=stream))
        batch = read_batch(redis_server.url, stream, result.entry_id)
        for i, (_, r_sl, _) in enumerate(batch.sample_slices()):
            response = batch.tokens[r_sl].tolist()
            # digit_max's reward scores the whole transcript: 1 for exactly the label, i.e. an unassisted answer
            plug_in = float(both.texts.decode(response).split() == [prompts[i // 4].label])
            assert batch.rewards[i] == replay(both, prompts[i // 4], response)[1] + plug_in
        assert batch.metadata["episode_reward"] == "env_plus_reward"
    finally:
        both.close()


def test_the_built_in_math_feedback_plays_answer_feedback_answer_with_the_feedback_masked(
    example_model, redis_server, stream
):
    """rollout.environment: math_feedback by name. Each one-token turn is an answer checked with math_answer; a
    wrong one with turns left is followed by the feedback (loss_mask 0, log-prob 0), a right one ends the episode
    with reward 1, and the third wrong one ends it as done (stop, not a cut) with reward 0."""
    svc = make_service(example_model, redis_server.url, environment="math_feedback")
    try:
        prompts = [
            PromptInput(text=f"{a} + {b} =", label=str(a + b), group_id=i)
            for i, (a, b) in enumerate((a, b) for a in range(1, 5) for b in range(1, 5))
        ]
        result = svc.generate(GenerateRequest(rollout_id=0, prompts=tuple(prompts), stream=stream))
        batch = read_batch(redis_server.url, stream, result.entry_id)
        feedback = svc.texts.encode_text(f"\n\n{FEEDBACK}\n\n")
        turns = []
        for i, (_, r_sl, t_sl) in enumerate(batch.sample_slices()):
            response, label = batch.tokens[r_sl].tolist(), prompts[i // 4].label
            answers = response[:: 1 + len(feedback)]  # answer, feedback, answer, ...: one token each answer
            scores = [math_answer(svc.texts.decode([a]), label) for a in answers]
            assert scores[:-1] == [0.0] * (len(answers) - 1) and (scores[-1] == 1.0 or len(answers) == 3)
            assert response == [*(t for a in answers[:-1] for t in (a, *feedback)), answers[-1]]
            mask = batch.loss_mask[t_sl].tolist()
            assert mask == [*(m for _ in answers[:-1] for m in (1, *[0] * len(feedback))), 1]
            assert all(lp == 0.0 for lp, m in zip(batch.rollout_log_probs[t_sl].tolist(), mask, strict=True) if not m)
            assert (float(batch.rewards[i]), batch.finish_reasons[i]) == (scores[-1], "stop")
            turns.append((len(answers), scores[-1]))
        # the seeded untrained policy: some right at once, some right after feedback, some wrong three times
        assert {(1, 1.0), (3, 0.0)} <= set(turns) and any(n > 1 and r == 1.0 for n, r in turns)
        assert batch.metadata["environment"] == "math_feedback" and result.metrics["env_end_done_frac"] == 1.0
    finally:
        svc.close()


def test_environment_keys_are_checked_and_plug_in_paths_resolve_against_the_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"env_plus_reward needs rollout\.environment"):
        config_from_dict(
            {"model": {"path": "m"}, "data": {"train_path": "t"}, "rollout": {"episode_reward": "env_plus_reward"}}
        )
    with pytest.raises(ConfigError, match=r"rollout\.overlong_penalty measures one generation"):
        config_from_dict(
            {
                "model": {"path": "m"},
                "data": {"train_path": "t"},
                "rollout": {"environment": LOOKUP, "overlong_penalty": {"enabled": True}},
            }
        )
    config = load_config(REPO / "examples" / "tool_lookup.yaml")
    assert config.rollout.environment == f"{REPO}/examples/tool_lookup/env.py:LookupEnvironment"
    assert (config.rollout.max_turns, config.rollout.episode_reward) == (3, "env")


def test_preflight_names_a_broken_environment_before_anything_starts(tmp_path):
    from services.launcher.preflight import check_run_inputs

    assert check_run_inputs(load_config(REPO / "examples" / "tool_lookup.yaml")) == []
    (tmp_path / "envs.py").write_text("class Env:\n    def reset(self, sample):\n        return ''\n")
    for spec, fragment in [
        (f"{tmp_path}/envs.py:Env", "Env has no step method"),
        (f"{tmp_path}/nothere.py:Env", "file"),
        ("no_colon", "not of the form"),
    ]:
        config = load_config(REPO / "examples" / "tool_lookup.yaml", [f"rollout.environment={spec}"])
        with pytest.raises(ConfigError, match=rf"^rollout\.environment: environment .*{fragment}"):
            check_run_inputs(config)

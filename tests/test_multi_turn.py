"""The multi-turn rollout loop (services.rollout.multi_turn) driven with a scripted fake engine (a real model would
make the token layout random) and scripted environments: the exact tokens, loss mask and log-probs of an
episode, its endings (done, max_turns, the context, abort), the engine batched over live episodes, async steps
run concurrently, and every way an environment can be wrong."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers.scripted_engine import GenerateOnlyEngine

from services.contracts.sampling_spec import SamplingSpec
from services.rollout.engines.interface import FINISH_ABORT, FINISH_STOP, Engine, SampleOutput
from services.rollout.environment_registry import resolve_environment
from services.rollout.environments import (
    Action,
    EnvironmentFailure,
    EnvironmentPlugin,
    EnvironmentSpecError,
    EnvironmentUnavailable,
    EpisodeSample,
    StepResult,
)
from services.rollout.multi_turn import MultiTurnRollout, episode_metrics, turn_sampling

SAMPLING = SamplingSpec(temperature=1.0, max_new_tokens=2, seed=5)


class ScriptedFakeEngine(GenerateOnlyEngine):
    """Turn t of every episode is the tokens [10 + t, 20 + t] with log-probs [-0.1 (t+1), -0.2 (t+1)], where t is
    the number of earlier calls that episode was in (read off its context: each earlier turn left a 10 + t token)."""

    def __init__(self, *, max_context: int = 64, abort_on_call: int | None = None, version: int = 3):
        super().__init__(max_context=max_context, version=version)
        self.calls: list[tuple[list[list[int]], SamplingSpec]] = []
        self.abort_on_call = abort_on_call

    def _generate_admitted(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec, budgets: Sequence[int]
    ) -> list[SampleOutput]:
        self.calls.append(([list(p) for p in prompts], sampling))
        if self.abort_on_call == len(self.calls) - 1:
            return [SampleOutput((), (), FINISH_ABORT, self._version) for _ in prompts]
        out = []
        for p in prompts:
            t = sum(10 <= tok < 20 for tok in p)
            room = self._max_context - len(p)
            ids = (10 + t, 20 + t)[:room]
            out.append(SampleOutput(ids, (-0.1 * (t + 1), -0.2 * (t + 1))[:room], FINISH_STOP, self._version + t))
        return out


def encode(text: str) -> list[int]:
    return [int(w) for w in text.split()]  # observation text in these tests: token ids as words


def decode(ids: Sequence[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def sample(i: int = 0, prompt: tuple[int, ...] = (1, 4, 5, 6)) -> EpisodeSample:
    return EpisodeSample(
        prompt=f"p{i}", prompt_ids=prompt, label=str(i), metadata={"i": str(i)}, group_id=i, sample_index=0
    )


def rollout(engine: Engine, factory, *, max_turns: int = 4, timeout_s: float = 5.0) -> MultiTurnRollout:
    return MultiTurnRollout(
        engine=engine,
        plugin=EnvironmentPlugin(spec="test:Env", factory=factory),
        encode=encode,
        decode=decode,
        max_turns=max_turns,
        step_timeout_s=timeout_s,
        vocab_size=32,
    )


class ThreeTurns:
    """reset: token ids [2]; step 0: ids [7, 8], reward 0.5; step 1: text "9 3", reward 0.25; step 2: done, 1.0."""

    def __init__(self) -> None:
        self.actions: list[Action] = []

    def reset(self, sample: EpisodeSample) -> list[int]:
        self.sample = sample
        return [2]

    def step(self, action: Action) -> StepResult:
        self.actions.append(action)
        return [StepResult([7, 8], 0.5, False), StepResult("9 3", 0.25, False), StepResult("", 1.0, True)][action.turn]


def test_a_three_turn_episode_has_exact_tokens_mask_and_log_probs_with_a_scripted_fake_engine():
    engine, envs = ScriptedFakeEngine(), list[ThreeTurns]()

    def make() -> ThreeTurns:
        envs.append(ThreeTurns())
        return envs[-1]

    played = rollout(engine, make, max_turns=3).run([sample()], SAMPLING)
    (e,) = played.episodes
    assert e.prompt_ids == (1, 4, 5, 6, 2)  # the reset observation is prompt, not response
    assert e.output.token_ids == (10, 20, 7, 8, 11, 21, 9, 3, 12, 22)
    assert e.loss_mask == (1, 1, 0, 0, 1, 1, 0, 0, 1, 1)
    assert e.output.log_probs == pytest.approx((-0.1, -0.2, 0, 0, -0.2, -0.4, 0, 0, -0.3, -0.6))
    assert [lp for lp, m in zip(e.output.log_probs, e.loss_mask, strict=True) if not m] == [0.0] * 4
    assert (e.reward, e.turns, e.end, e.output.finish_reason) == (1.75, 3, "done", "stop")
    assert e.output.weight_version == 3  # the oldest version that generated a turn
    # turn t was sampled by version 3 + t; an observation token carries the version of the policy token before it
    assert e.output.token_versions == (3, 3, 3, 3, 4, 4, 4, 4, 5, 5)
    # each generation continues the conversation: prompt + reset observation + every turn and observation so far
    assert [c[0] for c in engine.calls] == [
        [[1, 4, 5, 6, 2]],
        [[1, 4, 5, 6, 2, 10, 20, 7, 8]],
        [[1, 4, 5, 6, 2, 10, 20, 7, 8, 11, 21, 9, 3]],
    ]
    assert [c[1] for c in engine.calls] == [turn_sampling(SAMPLING, t) for t in range(3)]
    (env,) = envs
    assert env.sample == sample()
    assert env.actions == [
        Action(text="t10 t20", token_ids=(10, 20), finish_reason="stop", turn=0, last_turn=False),
        Action(text="t11 t21", token_ids=(11, 21), finish_reason="stop", turn=1, last_turn=False),
        Action(text="t12 t22", token_ids=(12, 22), finish_reason="stop", turn=2, last_turn=True),
    ]


class Endless:
    """Never done; every step observes `observation` (token ids)."""

    def __init__(self, observation: Sequence[int] = (7, 8, 9), reset: Sequence[int] = ()) -> None:
        self.observation, self.first = list(observation), list(reset)

    def reset(self, sample: EpisodeSample) -> list[int]:
        return self.first

    def step(self, action: Action) -> StepResult:
        return StepResult(self.observation, 1.0, False)


def test_max_turns_ends_an_episode_after_its_last_turn_without_a_trailing_observation():
    (e,) = rollout(ScriptedFakeEngine(), Endless, max_turns=2).run([sample()], SAMPLING).episodes
    assert e.output.token_ids == (10, 20, 7, 8, 9, 11, 21) and e.loss_mask == (1, 1, 0, 0, 0, 1, 1)
    assert (e.turns, e.end, e.output.finish_reason, e.reward) == (2, "max_turns", "length", 2.0)


def test_the_context_limit_ends_an_episode_before_an_observation_that_leaves_no_room():
    # context 12: prompt 4 + turn 2 + observation 3 = 9; turn 2 more = 11; the next observation would make 14
    engine = ScriptedFakeEngine(max_context=12)
    (e,) = rollout(engine, Endless).run([sample()], SAMPLING).episodes
    assert e.output.token_ids == (10, 20, 7, 8, 9, 11, 21) and e.loss_mask[-1] == 1  # ends on a policy token
    assert (e.turns, e.end, e.output.finish_reason) == (2, "context", "length")
    assert max(len(p) for call in engine.calls for p in call[0]) < 12  # never a prompt the context cannot extend
    # a turn the engine cut at the context: even an empty observation leaves no room for another turn
    engine = ScriptedFakeEngine(max_context=9)
    (e,) = rollout(engine, lambda: Endless(observation=[7, 8])).run([sample()], SAMPLING).episodes
    assert e.output.token_ids == (10, 20, 7, 8, 11) and e.end == "context" and len(engine.calls) == 2
    # a reset observation that fills the context: no turn at all, no engine call for it
    engine = ScriptedFakeEngine(max_context=8)
    (e,) = rollout(engine, lambda: Endless(reset=[2, 2, 2, 2])).run([sample()], SAMPLING).episodes
    assert (e.output.token_ids, e.turns, e.end, len(engine.calls)) == ((), 0, "context", 0)


class DoneAfter:
    """Done after `turns` turns (from the sample's label), observing [3] in between."""

    def reset(self, sample: EpisodeSample) -> str:
        self.turns = int(sample.label) + 1
        return ""

    def step(self, action: Action) -> StepResult:
        return StepResult([3], float(action.turn), action.turn + 1 == self.turns)


def test_the_engine_is_called_once_per_round_over_the_episodes_still_running():
    engine = ScriptedFakeEngine()
    played = rollout(engine, DoneAfter).run([sample(i) for i in range(4)], SAMPLING)
    assert [len(prompts) for prompts, _ in engine.calls] == [4, 3, 2, 1]
    assert [e.turns for e in played.episodes] == [1, 2, 3, 4] and {e.end for e in played.episodes} == {"done"}
    assert [e.reward for e in played.episodes] == [0.0, 1.0, 3.0, 6.0]
    m = episode_metrics(played.episodes)
    assert m["env_turns_mean"] == 2.5 and m["env_end_done_frac"] == 1.0 and m["env_end_context_frac"] == 0.0
    # observation tokens: 0 + 1 + 2 + 3 of 2 + 5 + 8 + 11 response tokens
    assert m["env_observation_token_frac"] == pytest.approx(6 / 26)


def test_async_steps_of_a_round_run_concurrently():
    barrier: dict[str, asyncio.Barrier] = {}

    class Meets:
        """Each step waits until all four episodes are inside their step at once: stepped one after another,
        the first would wait forever (here: until the timeout)."""

        async def reset(self, sample: EpisodeSample) -> str:
            barrier.setdefault("b", asyncio.Barrier(4))
            return ""

        async def step(self, action: Action) -> StepResult:
            await barrier["b"].wait()
            return StepResult("", 1.0, True)

    played = rollout(ScriptedFakeEngine(), Meets, timeout_s=3.0).run([sample(i) for i in range(4)], SAMPLING)
    assert [e.reward for e in played.episodes] == [1.0] * 4


def test_an_aborted_generation_ends_every_live_episode_and_generates_no_more():
    engine = ScriptedFakeEngine(abort_on_call=1)
    played = rollout(engine, DoneAfter).run([sample(i) for i in range(3)], SAMPLING)
    assert [e.end for e in played.episodes] == ["done", "abort", "abort"] and len(engine.calls) == 2
    assert [e.output.finish_reason for e in played.episodes] == ["stop", "abort", "abort"]


def test_turn_seeds_differ_and_turn_zero_samples_like_a_single_turn_request():
    assert turn_sampling(SAMPLING, 0) == SAMPLING
    seeds = {turn_sampling(SAMPLING, t).seed for t in range(8)}
    assert len(seeds) == 8 and all(s is not None and 0 <= s < 2**63 for s in seeds)
    unseeded = SamplingSpec(seed=None)
    assert turn_sampling(unseeded, 3) == unseeded


class Scripted:
    def __init__(self, result) -> None:
        self.result = result

    def reset(self, sample: EpisodeSample) -> str:
        return ""

    def step(self, action: Action):
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


@pytest.mark.parametrize(
    "result,error,fragment",
    [
        (RuntimeError("boom"), EnvironmentFailure, "step of episode 0 raised RuntimeError: boom"),
        (ConnectionError("refused"), EnvironmentUnavailable, "could not reach a dependency: ConnectionError"),
        (TimeoutError("slow"), EnvironmentUnavailable, "environment_timeout_s"),
        (("", "1.0", True), EnvironmentFailure, "the reward '1.0'; expected a number"),
        (("", float("nan"), True), EnvironmentFailure, "the reward nan"),
        (("", 1.0, 1), EnvironmentFailure, "done=1; expected True or False"),
        (("", 1.0), EnvironmentFailure, "expected \\(observation, reward, done\\)"),
        (([3, 99], 0.0, False), EnvironmentFailure, "holds 99; token ids are ints in \\[0, 32\\)"),
        ((b"3", 0.0, False), EnvironmentFailure, "is a bytes; expected text or a list of token ids"),
    ],
)
def test_a_bad_environment_fails_the_request_naming_the_episode(result, error, fragment):
    with pytest.raises(error, match=fragment):
        rollout(ScriptedFakeEngine(), lambda: Scripted(result)).run([sample()], SAMPLING)


def test_an_async_step_past_the_timeout_is_unavailable():
    class Slow:
        async def reset(self, sample: EpisodeSample) -> str:
            return ""

        async def step(self, action: Action) -> StepResult:
            await asyncio.sleep(30)
            raise AssertionError("not reached")

    with pytest.raises(EnvironmentUnavailable, match=r"longer than rollout.environment_timeout_s \(0.2 s\)"):
        rollout(ScriptedFakeEngine(), Slow, timeout_s=0.2).run([sample()], SAMPLING)


def test_a_failing_constructor_names_the_environment():
    def broken():
        raise KeyError("table")

    with pytest.raises(EnvironmentFailure, match="environment test:Env: constructing it raised KeyError"):
        rollout(ScriptedFakeEngine(), broken).run([sample()], SAMPLING)


def test_an_environment_runs_inside_a_running_event_loop():
    async def caller() -> list[float]:
        return [e.reward for e in rollout(ScriptedFakeEngine(), DoneAfter).run([sample(1)], SAMPLING).episodes]

    assert asyncio.run(caller()) == [1.0]


ENV_FILE = """
from dataclasses import dataclass
from services.rollout.environments import Environment, StepResult

@dataclass
class Counter(Environment):
    turns: int = 0
    def reset(self, sample): return ""
    def step(self, action): return StepResult("", 1.0, True)

class Half(Environment):
    def reset(self, sample): return ""

class NoStep:
    def reset(self, sample): return ""

NOT_CALLABLE = 3
"""


def test_environment_specs_resolve_like_rewards_and_bad_ones_are_clear(tmp_path: Path):
    path = tmp_path / "envs.py"
    path.write_text(ENV_FILE)
    plugin = resolve_environment(f"{path}:Counter")
    assert vars(plugin.make())["turns"] == 0 and plugin.make() is not plugin.make()  # one instance per episode
    assert resolve_environment("examples/tool_lookup/env.py:LookupEnvironment").spec.endswith("LookupEnvironment")
    for spec, fragment in [
        ("no_colon", "is not a built-in \\(math_feedback\\) and not of the form module:Class"),
        (f"{path}:Half", "leaves abstract methods unimplemented \\(step\\)"),
        (f"{path}:NoStep", "NoStep has no step method"),
        (f"{path}:NOT_CALLABLE", "is a int, not a class or factory"),
        (f"{path}:Missing", "has no attribute 'Missing'"),
        ("missing/envs.py:Env", "environment 'missing/envs.py:Env': file missing/envs.py not found"),
        ("tandem_no_such_module_q:Env", "module 'tandem_no_such_module_q' not found"),
    ]:
        with pytest.raises(EnvironmentSpecError, match=fragment):
            resolve_environment(spec)

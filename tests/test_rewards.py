"""Reward built-ins and the plug-in point (module:function, file.py:function, sync/async, batched/per sample)."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from services.contracts.errors import Unavailable
from services.rollout import rewards
from services.rollout.rewards import RewardError, RewardSpecError, RewardUnavailable, resolve_reward

REPO_ROOT = Path(__file__).resolve().parents[1]


def score(spec: str, responses: list[str], labels: list[str]) -> list[float]:
    return resolve_reward(spec).score(
        prompts=["p"] * len(responses), responses=responses, labels=labels, metadatas=[{} for _ in responses]
    )


def test_exact_match_strips_whitespace_only():
    assert score("exact_match", [" 7 ", "7.", "seven"], ["7", "7", "7"]) == [1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("so the answer is 42", "42", 1.0),
        ("first 3 then 5", "5", 1.0),  # last number counts
        ("first 5 then 3", "5", 0.0),
        ("x = \\boxed{1,234}. Later 7", "1234", 1.0),  # boxed wins over the last number
        ("\\boxed{\\frac{1}{2}} hmm", "\\frac{1}{2}", 1.0),  # non-numeric boxed: compared as text
        ("it is 0.5", "1/2", 1.0),
        ("-3", "-3.0", 1.0),
        ("The total is $18.", "#### 18", 1.0),  # GSM8K-style label
        ("no number here", "3", 0.0),
    ],
)
def test_numeric_match(response: str, label: str, expected: float):
    assert score("numeric_match", [response], [label]) == [expected]


MATH_CASES = [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),  # GSM8K's marker
    ("#### 72 clips, and 5 left over", "72", 1.0),  # the number right after ####, not the last one
    ("So the answer is \\boxed{72}. Check: 70 + 2", "72", 1.0),  # the last boxed wins over the last number
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),  # a LaTeX fraction, compared numerically
    ("The answer is 3/4.", "\\frac{3}{4}", 1.0),
    ("The answer is: $1,000.", "1000", 1.0),  # "answer is", currency and thousands separator
    ("Answer: -7 apples. 9 are left.", "-7", 1.0),  # "Answer:" beats the last number
    ("She has 3 then 5", "5", 1.0),  # the final number
    ("She has 5 then 3", "5", 0.0),
    ("It is 72.0", "#### 72", 1.0),  # a GSM8K solution as label; 72.0 == 72
    ("It is 0.3333333", "1/3", 1.0),  # decimals: within a relative 1e-6
    ("It is 0.33", "1/3", 0.0),
    ("\\boxed{72 \\text{ clips}}", "72", 1.0),  # units in the box are decoration
    ("\\boxed{18\\%}", "18", 1.0),
    ("I think 12", '["12", "twelve"]', 1.0),  # verl's ground_truth lists: any answer counts
    ("I think 13", '["12", "twelve"]', 0.0),
    ("\\boxed{x+1}", "x+1", 1.0),  # not a number: compared as text
    ("no number here", "3", 0.0),
    ("7", "", 0.0),
]


@pytest.mark.parametrize("response,label,expected", MATH_CASES)
def test_math_answer_reads_boxed_hashes_answer_is_and_the_final_number(response: str, label: str, expected: float):
    assert score("math_answer", [response], [label]) == [expected]


def test_math_verify_agrees_on_the_numeric_cases_and_checks_symbols_on_a_worker_thread():
    """The math-verify package (installed by the dev extra), run as rollout services run rewards: under a deadline,
    on a worker thread, where its own signal-based timeouts could not work."""
    reward = resolve_reward("math_verify")
    # math-verify reads the last expression of a response, not the number after "####"
    numeric = [c for c in MATH_CASES if c[1] and c[0] != "#### 72 clips, and 5 left over"]
    got = reward.score(
        prompts=[""] * len(numeric),
        responses=[c[0] for c in numeric],
        labels=[c[1] for c in numeric],
        metadatas=[{}] * len(numeric),
        timeout_s=60,
    )
    assert got == [c[2] for c in numeric]
    symbolic = reward.score(
        prompts=[""] * 2,
        responses=["\\boxed{\\frac{2}{4}}", "$x^2 + 2x + 1$"],
        labels=["0.5", "(x+1)^2"],
        metadatas=[{}] * 2,
        timeout_s=60,
    )
    assert symbolic == [1.0, 1.0]


def test_math_verify_without_its_package_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(
        RewardSpecError,
        match=r"reward math_verify needs the math-verify package: pip install "
        r"'tandem-rl\[math\]'",
    ):
        rewards.resolve_reward.__wrapped__("math_verify")


def test_extract_boxed_handles_nested_braces():
    assert rewards.extract_boxed("a \\boxed{x} b \\boxed{{1}+{2}} c") == "{1}+{2}"
    assert rewards.extract_boxed("\\boxed{unclosed") is None


def test_digit_task_builtin_and_example_file_agree():
    responses, labels = ["7", " 7", "7 7", "", "3"], ["7", "7", "7", "7", "7"]
    builtin = score("digit_task", responses, labels)
    plugin = score("examples/digit_max/reward.py:reward", responses, labels)  # relative to the repo root
    by_module = score("services.rollout.rewards:digit_task", responses, labels)
    assert builtin == plugin == by_module == [1.0, 1.0, 0.0, 0.0, 0.0]


def _write_module(tmp_path: Path, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    sys.path.insert(0, str(tmp_path))
    return name


@pytest.fixture
def plugin_module(tmp_path: Path):
    name = _write_module(
        tmp_path,
        "tandem_test_rewards_mod",
        """
        import asyncio
        from services.rollout.rewards import batched

        def per_sample(prompt, response, label, metadata):
            return len(response) + (10 if metadata.get("bonus") else 0)

        def two_args(response, label):
            return response == label

        async def async_per_sample(prompt, response, label, metadata):
            await asyncio.sleep(0.01)
            return {"score": float(response == label)}

        def lists(prompts, responses, labels, metadatas):
            return [float(r == l) for r, l in zip(responses, labels)]

        @batched
        async def async_batch(p, r, l, m):
            return [0.5] * len(r)

        def returns_text(prompt, response, label, metadata):
            return "good"

        def raises(prompt, response, label, metadata):
            raise RuntimeError("boom")

        def raises_on_b(prompt, response, label, metadata):
            return 1 / (response != "b")

        async def async_raises(prompt, response, label, metadata):
            raise KeyError(response)

        def numeric_text(prompt, response, label, metadata):
            return "1.0"

        def score_text(prompt, response, label, metadata):
            return {"score": "0.5"}

        def judge_down(prompt, response, label, metadata):
            raise ConnectionRefusedError("judge at 10.0.0.7:8000 refused the connection")

        async def judge_slow(prompt, response, label, metadata):
            raise TimeoutError("judge did not answer within 30s")

        def wrong_length(prompts, responses, labels, metadatas):
            return [1.0]

        def only_response(response):
            return float(len(response))

        def odd_names(a, b):
            return 1.0

        import threading
        import time

        def hangs_on_b(prompt, response, label, metadata):
            if response == "b":
                threading.Event().wait()
            return 1.0

        async def async_hangs_on_b(prompt, response, label, metadata):
            if response == "b":
                await asyncio.Event().wait()
            return 1.0

        async def async_blocks_on_b(prompt, response, label, metadata):
            if response == "b":
                time.sleep(3600)   # blocks the event loop: only the watchdog can see it
            return 1.0

        @batched
        def batch_hangs(prompts, responses, labels, metadatas):
            threading.Event().wait()

        @batched
        async def async_batch_hangs(prompts, responses, labels, metadatas):
            await asyncio.Event().wait()

        def slow_but_in_time(prompt, response, label, metadata):
            time.sleep(0.05)
            return 0.5

        NOT_CALLABLE = 3
    """,
    )
    yield name
    sys.path.remove(str(tmp_path))
    sys.modules.pop(name, None)


def test_per_sample_batched_and_async_plugins(plugin_module: str):
    m = plugin_module
    fn = resolve_reward(f"{m}:per_sample")
    assert not fn.batched
    assert fn.score(prompts=["a", "b"], responses=["xy", "z"], labels=["", ""], metadatas=[{}, {"bonus": "1"}]) == [
        2.0,
        11.0,
    ]
    assert score(f"{m}:two_args", ["1", "2"], ["1", "1"]) == [1.0, 0.0]
    assert score(f"{m}:only_response", ["abc"], ["x"]) == [3.0]
    assert score(f"{m}:async_per_sample", ["1", "2", "3"], ["1", "1", "3"]) == [1.0, 0.0, 1.0]
    assert resolve_reward(f"{m}:lists").batched
    assert score(f"{m}:lists", ["1", "2"], ["1", "1"]) == [1.0, 0.0]
    assert score(f"{m}:async_batch", ["1", "2"], ["1", "1"]) == [0.5, 0.5]


def test_plugin_by_file_path(tmp_path: Path):
    path = tmp_path / "my_reward.py"
    path.write_text("def reward(response, label):\n    return 2.0 if response == label else -1.0\n")
    assert score(f"{path}:reward", ["a", "b"], ["a", "a"]) == [2.0, -1.0]


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("no_such_builtin", "not a built-in"),
        ("tandem_no_such_module_xyz:fn", "module 'tandem_no_such_module_xyz' not found"),
        ("services.rollout.rewards:no_such_fn", "has no attribute 'no_such_fn'"),
        ("missing/file.py:fn", "not found"),
        ("", "empty"),
    ],
)
def test_bad_specs_are_clear_value_errors(spec: str, fragment: str):
    with pytest.raises(RewardSpecError, match=fragment) as info:
        resolve_reward(spec)
    assert isinstance(info.value, ValueError)  # INVALID_ARGUMENT over gRPC


def test_bad_plugins(plugin_module: str):
    m = plugin_module
    with pytest.raises(RewardSpecError, match="not a function"):
        resolve_reward(f"{m}:NOT_CALLABLE")
    with pytest.raises(RewardSpecError, match="must take"):
        resolve_reward(f"{m}:odd_names")
    with pytest.raises(RewardError, match="expected a number"):
        score(f"{m}:returns_text", ["a"], ["a"])
    with pytest.raises(RewardError, match="raised RuntimeError on sample 0: boom"):
        score(f"{m}:raises", ["a"], ["a"])
    with pytest.raises(RewardError, match="for 2 samples"):
        score(f"{m}:wrong_length", ["a", "b"], ["a", "b"])


def test_a_raising_reward_names_the_sample_and_is_not_transient(plugin_module: str):
    m = plugin_module
    with pytest.raises(RewardError, match=f"reward function {m}:raises_on_b raised ZeroDivisionError on sample 1"):
        score(f"{m}:raises_on_b", ["a", "b", "c"], ["a"] * 3)
    with pytest.raises(RewardError, match=f"{m}:async_raises raised KeyError on sample 0: 'x'") as info:
        score(f"{m}:async_raises", ["x"], ["x"])
    assert isinstance(info.value, ValueError)  # INVALID_ARGUMENT over gRPC: the coordinator does not retry it


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("numeric_text", "returned the str '1.0' for sample 0; expected a number (int, float or bool)"),
        ("score_text", "returned the str '0.5' for sample 0"),
    ],
)
def test_a_reward_given_as_text_is_refused_even_when_it_parses(plugin_module: str, name: str, fragment: str):
    with pytest.raises(RewardError, match=re.escape(f"reward function {plugin_module}:{name} {fragment}")):
        score(f"{plugin_module}:{name}", ["a"], ["a"])


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("judge_down", "could not reach a dependency on sample 0: ConnectionRefusedError: judge at 10.0.0.7:8000"),
        ("judge_slow", "could not reach a dependency on sample 0: TimeoutError: judge did not answer"),
    ],
)
def test_a_reward_whose_dependency_is_down_is_transient(plugin_module: str, name: str, fragment: str):
    with pytest.raises(RewardUnavailable, match=fragment) as info:
        score(f"{plugin_module}:{name}", ["a"], ["a"])
    assert isinstance(info.value, Unavailable) and not isinstance(info.value, ValueError)  # UNAVAILABLE: retried


@pytest.mark.parametrize(
    "name,which",
    [
        ("hangs_on_b", "sample 1"),
        ("async_hangs_on_b", "sample 1"),
        ("async_blocks_on_b", "sample 1"),
        ("batch_hangs", "the 3 samples of its one batched call"),
        ("async_batch_hangs", "the 3 samples of its one batched call"),
    ],
)
def test_a_reward_that_never_returns_is_named_at_its_deadline_and_is_not_transient(
    plugin_module: str, name: str, which: str
):
    fn = resolve_reward(f"{plugin_module}:{name}")
    with pytest.raises(rewards.RewardTimeout) as info:
        fn.score(prompts=["p"] * 3, responses=["a", "b", "c"], labels=["a"] * 3, metadatas=[{}] * 3, timeout_s=0.3)
    assert str(info.value) == (
        f"reward function {plugin_module}:{name} did not return within 0.3 s (rollout.reward_timeout_s) for {which}"
    )
    assert info.value.hint == (
        f"make {plugin_module}:{name} return sooner (give what it waits for a timeout of its "
        "own), or raise rollout.reward_timeout_s"
    )
    assert isinstance(info.value, RewardError)  # INVALID_ARGUMENT: not retried on another replica


def test_the_deadline_is_per_call_so_many_quick_samples_may_take_longer_in_all(plugin_module: str):
    fn = resolve_reward(f"{plugin_module}:slow_but_in_time")
    assert (
        fn.score(prompts=["p"] * 8, responses=["a"] * 8, labels=["a"] * 8, metadatas=[{}] * 8, timeout_s=0.2)
        == [0.5] * 8
    )  # 8 x 0.05 s = 0.4 s in all, each call well within 0.2 s

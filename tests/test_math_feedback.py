"""The built-in environment math_feedback (services/rollout/math_feedback.py) as a unit: the exact observation,
reward and done of every turn, for a text prompt and a chat prompt. Through the rollout: test_multi_turn_chat.py
(the feedback as a chat turn) and test_rollout_environment.py (the real RolloutService and native engine)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from services.contracts.chat_messages import ChatMessage
from services.rollout.environment_registry import resolve_environment
from services.rollout.environments import Action, EpisodeSample, StepResult
from services.rollout.math_feedback import FEEDBACK, MathFeedbackEnvironment

QUESTION = "Ava has 3 apples and buys 4 more. How many apples does she have?"


def start(*, label: str = "7", chat: bool = False, metadata: Mapping[str, str] | None = None):
    env = resolve_environment("math_feedback").make()
    assert isinstance(env, MathFeedbackEnvironment)
    sample = EpisodeSample(
        prompt=QUESTION,
        prompt_ids=(1, 2, 3),
        label=label,
        metadata=metadata or {},
        group_id=0,
        sample_index=0,
        messages=(ChatMessage("user", QUESTION),) if chat else (),
    )
    assert env.reset(sample) == ""  # the problem is the prompt: nothing is added before the first answer
    return env


def answer(env: MathFeedbackEnvironment, text: str, turn: int, *, max_turns: int = 3) -> StepResult:
    action = Action(text=text, token_ids=(9,), finish_reason="stop", turn=turn, last_turn=turn + 1 >= max_turns)
    result = env.step(action)
    assert isinstance(result, StepResult)
    return result


def test_a_wrong_answer_gets_the_feedback_between_blank_lines_and_a_right_one_ends_with_reward_1():
    env = start()
    assert answer(env, "3 + 4 = 8. #### 8", 0) == StepResult(f"\n\n{FEEDBACK}\n\n", 0.0, False)
    assert answer(env, "She has \\boxed{7}.", 1) == StepResult("", 1.0, True)


def test_the_last_turn_ends_the_episode_as_done_with_reward_0_and_no_feedback():
    env = start()
    assert answer(env, "#### 6", 0) == StepResult(f"\n\n{FEEDBACK}\n\n", 0.0, False)
    assert answer(env, "no number at all", 1) == StepResult(f"\n\n{FEEDBACK}\n\n", 0.0, False)
    assert answer(env, "The answer is 12", 2) == StepResult("", 0.0, True)
    # a right answer on the last turn still scores
    assert answer(start(), "The answer is 7", 0, max_turns=1) == StepResult("", 1.0, True)


def test_a_chat_prompt_gets_the_bare_feedback_for_the_chat_template_and_a_row_may_word_its_own():
    env = start(chat=True)
    assert answer(env, "#### 8", 0) == StepResult(FEEDBACK, 0.0, False)
    own = start(chat=True, metadata={"math_feedback": "Not quite: count again."})
    assert answer(own, "#### 8", 0) == StepResult("Not quite: count again.", 0.0, False)
    text = start(metadata={"math_feedback": "Try again."})
    assert answer(text, "#### 8", 0) == StepResult("\n\nTry again.\n\n", 0.0, False)


def test_labels_are_read_as_math_answer_reads_them_and_a_missing_one_is_refused():
    # a GSM8K solution as the label: its #### answer counts; 7.0 equals 7
    assert answer(start(label="3 + 4 = 7\n#### 7"), "#### 7.0", 0).reward == 1.0
    assert answer(start(label='["7", "seven"]'), "It is 7 apples", 0).reward == 1.0
    with pytest.raises(ValueError, match=r"math_feedback checks each answer against the row's label"):
        start(label=" ")

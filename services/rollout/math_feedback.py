"""The built-in environment `math_feedback`: a math word problem the policy may correct after feedback (multi-turn
self-correction, the game verl's Gsm8kInteraction plays).

Each turn is an answer. Its final answer (services/rollout/math_rewards.py `math_answer`: the last `\\boxed{}`, the
number after `####` or "answer is", else the last number of that turn) is checked against the row's label:

- right: reward 1, done;
- wrong on the last turn (rollout.max_turns): reward 0, done. The episode ends as done (finish reason stop), not
  as cut: algorithm.overlong_filter masks cut episodes, and would drop exactly the failures;
- wrong with turns left: reward 0, and the feedback becomes the next turn of the conversation (loss_mask 0), after
  which the policy answers again.

So an episode's reward is 1 when any attempt was right, whichever it was: no partial credit for a later attempt
(verl's scores the same way). The feedback is the row's `math_feedback` key when it has one, else FEEDBACK. With a
chat prompt it is a turn in role rollout.observation_role (user by default), rendered by the chat template; with
a text prompt it is set between blank lines.
"""

from __future__ import annotations

from services.rollout.environments import Action, Environment, EpisodeSample, StepResult
from services.rollout.math_rewards import math_answer

FEEDBACK = "That is not correct. Check your reasoning and try again."  # no "answer is": math_answer reads that
FEEDBACK_KEY = "math_feedback"  # a row's own feedback text (its metadata: a top-level key of the row)


class MathFeedbackEnvironment(Environment):
    label: str
    feedback: str

    def reset(self, sample: EpisodeSample) -> str:
        if not sample.label.strip():
            raise ValueError(
                "math_feedback checks each answer against the row's label (data.label_key), and this row has none"
            )
        self.label = sample.label
        feedback = sample.metadata.get(FEEDBACK_KEY) or FEEDBACK
        self.feedback = feedback if sample.messages else f"\n\n{feedback}\n\n"
        return ""  # the problem is the prompt

    def step(self, action: Action) -> StepResult:
        score = math_answer(action.text, self.label)
        if score:
            return StepResult(observation="", reward=score, done=True)
        if action.last_turn:
            return StepResult(observation="", reward=0.0, done=True)
        return StepResult(observation=self.feedback, reward=0.0, done=False)

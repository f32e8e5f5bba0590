"""The lookup environment of examples/tool_lookup: `rollout.environment: tool_lookup/env.py:LookupEnvironment`.

Each turn is one token (`max_new_tokens: 1`). The policy either calls the tool, `(`, and the environment
answers `) v` with v = table[k] (loss_mask 0: the policy never trains on it), or it answers with a digit,
which ends the episode: reward 1 if a lookup came before it and the digit is table[k], else 0. Any other
token ends it with 0.

    prompt        turn 0   observation   turn 1
    <s> 4 =       (        ) 7           7         reward 1
    <s> 4 =       7                                reward 0 (a guess: not grounded in a lookup)

Why a guess scores 0 (README.md): with guesses scored, GRPO settles on guessing (0.1 in expectation) before the
two-token skill call-then-copy pays more, and the tool is never learned.
"""

from __future__ import annotations

from services.rollout.environments import Action, Environment, EpisodeSample, StepResult

CALL = "("  # the tool call: one token of the tiny tokenizer's vocabulary


class LookupEnvironment(Environment):
    def reset(self, sample: EpisodeSample) -> str:
        key = int(sample.prompt.split()[0])
        self.value = sample.metadata["table"][key]
        self.looked_up = False
        return ""  # nothing beyond the prompt: the table stays hidden until the policy asks

    def step(self, action: Action) -> StepResult:
        words = action.text.split()
        first = words[0] if words else ""
        if first == CALL:
            self.looked_up = True
            return StepResult(observation=f") {self.value}", reward=0.0, done=False)
        return StepResult(observation="", reward=float(self.looked_up and first == self.value), done=True)

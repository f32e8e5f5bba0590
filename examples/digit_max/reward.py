"""The digit-max reward as a plug-in file: `rollout.reward: digit_max/reward.py:reward` in examples/digit_max.yaml.

Same rule as the built-in `digit_task`: 1 when the response is exactly the label digit, else 0.
"""


def reward(response: str, label: str) -> float:
    return float(response.split() == [label.strip()])

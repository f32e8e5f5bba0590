"""The long digit task's reward: 1 when the response starts with the label digit (the rest of a forced-length
response is not read). `rollout.reward: digit_max_long/reward.py:reward`."""


def reward(response: str, label: str) -> float:
    return float(response.strip()[:1] == label.strip())

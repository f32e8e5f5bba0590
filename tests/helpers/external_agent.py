"""An external agent process (rollout.agent: external), as a user would write one around the CLI: `tandem ctl
episodes` claims episodes, the plain `openai` client drives each through its base URL, `tandem ctl reward` posts
its reward. Usage: external_agent.py ENDPOINT TOKEN EPISODES; it leaves the last episode without a reward (so it
fails at its deadline) and exits 3 if a claim hands out an episode twice."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import openai


def ctl(endpoint: str, token: str, *args: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "ctl", *args, "--endpoint", endpoint, "--token", token],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def main(endpoint: str, token: str, count: int) -> int:
    claimed: list[dict] = []
    deadline = time.monotonic() + 60
    while len(claimed) < count and time.monotonic() < deadline:
        claimed += ctl(endpoint, token, "episodes", "--max", "8")
    if len({e["episode_id"] for e in claimed}) != count or ctl(endpoint, token, "episodes", "--max", "8"):
        return 3
    for i, episode in enumerate(claimed):
        client = openai.OpenAI(base_url=episode["base_url"], api_key=token, max_retries=0)
        reply = client.chat.completions.create(model="policy", messages=episode["row"]["conversation"])
        assert reply.choices[0].message.content is not None
        if i < count - 1:
            [ack] = ctl(endpoint, token, "reward", "--episode", episode["episode_id"], "--reward", str(float(i)))
            assert ack["status"] == "finished", ack
    print(json.dumps([e["row"]["conversation"] for e in claimed]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))

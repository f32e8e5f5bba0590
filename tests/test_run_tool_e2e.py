"""`tandem run` of the multi-turn example (examples/tool_lookup.yaml): every service a separate process, a real
redis-server, DeepSpeed on CPU. The policy learns to call the lookup tool and copy its answer, and its reward
rises far above what any policy that does not call it can reach."""

import collections
import json

import pytest
from tandem_runs import REPO, assert_above, assert_below, metrics, start_run, supervisor_log, window_mean

pytestmark = pytest.mark.slow
TOOL_EXAMPLE = REPO / "examples" / "tool_lookup.yaml"


def best_no_tool_reward(path) -> float:
    """The most any policy that never calls the tool can score on these prompts, even one told the answers in
    hindsight and even were guesses scored (the environment scores them 0): per key, always the digit that is most
    often the answer for that key here. The tables are random per line, so the prompt says nothing more."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in rows:
        counts[r["prompt"]][r["label"]] += 1
    return sum(max(c.values()) for c in counts.values()) / len(rows)


def test_policy_learns_to_call_the_lookup_tool(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, "loop.num_rollout=40", "loop.eval_interval=40", config=TOOL_EXAMPLE)
    assert proc.wait(timeout=600) == 0, supervisor_log(run_dir)
    rows = metrics(run_dir)
    evals = [r for r in rows if "eval/reward_mean" in r]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["rollout_id"] for r in evals] == [-1, 39] and len(steps) == 40
    ceiling = best_no_tool_reward(REPO / "examples" / "tool_lookup" / "eval.jsonl")
    assert 0.1 < ceiling < 0.25  # 200 eval prompts, 10 keys: ~0.2 in hindsight; 0.1 in expectation
    untrained, trained = evals[0], evals[-1]
    # untrained, greedy: the most likely first token is not the call (reward 0, one turn); trained: call, copy
    assert_below("untrained eval reward", untrained["eval/reward_mean"], ceiling, untrained)
    assert_below("untrained eval env_turns_mean", untrained["eval/env_turns_mean"], 1.5, untrained)
    assert_above("trained eval reward", trained["eval/reward_mean"], max(0.8, ceiling + 0.5), trained)
    assert_above("trained eval env_turns_mean", trained["eval/env_turns_mean"], 1.9, trained)
    assert_below("trained eval env_turns_mean", trained["eval/env_turns_mean"], 2.1, trained)
    # Sampled at T=1, a step's numbers swing with the prompts it drew: windows of 5 steps, never one step.
    head, tail = steps[:5], steps[-5:]
    assert_below("reward, first 5 steps", window_mean(head, "rollout/reward_mean"), 0.05)  # no-tool expectation 0.1
    assert_above("reward, last 5 steps", window_mean(tail, "rollout/reward_mean"), 0.5)
    assert_below("env_turns_mean, first 5 steps", window_mean(head, "rollout/env_turns_mean"), 1.2)
    assert_above("env_turns_mean, last 5 steps", window_mean(tail, "rollout/env_turns_mean"), 1.8)
    # half of a call-and-answer episode's response is the observation `) v`: masked, so never trained on
    assert_above("env_observation_token_frac, last 5", window_mean(tail, "rollout/env_observation_token_frac"), 0.4)
    assert_above("env_end_done_frac, last 5 steps", window_mean(tail, "rollout/env_end_done_frac"), 0.95)

"""`tandem run` of examples/agent_tools.yaml: the policy trains through the rollout service's OpenAI-compatible
endpoint, driven by an agent written with the real `openai` client (tools, several turns, one sample per episode).
Every service a separate process, a real redis-server, DeepSpeed on CPU. It learns the lookup tool of
examples/tool_lookup (call, then copy the result), which no policy that does not call it can score on."""

import json

import pytest
from tandem_runs import REPO, assert_above, assert_below, metrics, start_run, supervisor_log, window_mean
from test_run_tool_e2e import best_no_tool_reward

pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

# ~1.5-2 min on the shared 2-core box when it is quiet, 3-6 under load: every turn is an HTTP call
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
AGENT_EXAMPLE = REPO / "examples" / "agent_tools.yaml"
# 8 prompts x 16 episodes a step for 80 steps: the learning's onset varies from run to run by 10-15 steps, and at 60
# steps the trained eval was mid-rise (seed 5 of 6 here 0.40, CI's run 0.265: both failed); at 80 the
# five seeds scored 0.645-1.0 (> 0.405 asserted), the last 5 steps' reward 0.51-0.99 (bench/RESULTS.md, "the agent e2e")
PROMPTS, EPISODES, STEPS = 8, 16, 80


def test_an_openai_client_agent_learns_to_call_the_lookup_tool_through_the_endpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(
        run_dir,
        f"loop.num_rollout={STEPS}",
        f"loop.eval_interval={STEPS}",
        f"rollout.rollout_batch_size={PROMPTS}",
        f"rollout.n_samples_per_prompt={EPISODES}",
        config=AGENT_EXAMPLE,
    )
    assert proc.wait(timeout=800) == 0, supervisor_log(run_dir)
    rows = metrics(run_dir)
    evals = [r for r in rows if "eval/reward_mean" in r]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["rollout_id"] for r in evals] == [-1, STEPS - 1] and len(steps) == STEPS
    ceiling = best_no_tool_reward(REPO / "examples" / "tool_lookup" / "eval.jsonl")
    untrained, trained = evals[0]["eval/reward_mean"], evals[-1]["eval/reward_mean"]
    assert_below("untrained greedy eval", untrained, ceiling, evals)
    assert_above("trained greedy eval - the no-tool ceiling", trained - ceiling, 0.2, evals)
    first, last = steps[:5], steps[-5:]
    reward = "rollout/reward_mean"  # sampled at T=1
    assert_below("first 5 steps' reward", window_mean(first, reward), 0.05)
    assert_above("last 5 steps' reward", window_mean(last, reward), 0.2)
    # the agent learned to call: more turns per episode; each episode stayed one sample (its history only grew)
    assert_below("first 5 steps' turns per episode", window_mean(first, "rollout/agent_turns_mean"), 1.3)
    assert_above("last 5 steps' turns per episode", window_mean(last, "rollout/agent_turns_mean"), 1.8)
    for r in steps:
        assert r["rollout/agent_samples_per_episode"] == 1.0 and r["rollout/agent_rewritten_turns"] == 0.0
        assert r["rollout/agent_episodes"] == PROMPTS * EPISODES
    assert (
        sum(r["rollout/agent_failed_episodes"] for r in steps) <= 0.01 * PROMPTS * EPISODES * STEPS
    )  # none expected; a loaded box
    # turns after a tool result reused the generated ids
    assert_above("last 5 steps' reused-turn fraction", window_mean(last, "rollout/agent_reused_turn_frac"), 0.4)
    # where `tandem ctl episodes --run-dir` finds the endpoint: 127.0.0.1 only
    assert json.loads((run_dir / "openai_api" / "rollout-0.json").read_text())["url"].startswith("http://127.0.0.1:")

"""The rollout side of model rewards, driven with fakes of the reward service's Score call (named so): the batcher's
packing by tokens across concurrent callers, its retries within reward.max_wait_s, the failures that name the
service, and weighted sums of rule and model rewards. The real service over the wire: test_reward_service.py."""

from __future__ import annotations

import threading
import time

import pytest
from test_tracing import read_spans, run_script

from services.contracts.config import RewardServiceConfig, TandemConfig
from services.contracts.config_loading import config_from_dict
from services.contracts.reward_calls import ScoreRequest, ScoreResult, SubScores
from services.contracts.reward_spec import RewardSpecError, RewardTerm, parse_reward, reward_text
from services.rollout.remote_reward import ScoreBatcher, ScoreCallFailed, messages_of
from services.rollout.reward_mix import RewardResolver, WeightedReward
from services.rollout.rewards import RewardError, RewardUnavailable, resolve_reward


def make_config(reward: object = "judge:j", **reward_section: object) -> TandemConfig:
    return config_from_dict(
        {
            "model": {"path": "m"},
            "data": {"train_path": "t"},
            "rollout": {"reward": reward},
            "reward": {
                "models": {"j": {"type": "judge", "path": "j", "template": "{{ response }}"}},
                **reward_section,
            },
        }
    )


class FakeScoreClient:
    """A fake of the reward service's Score call: scores a sample len(response); fails the first `fail` calls with
    `error`; records every request."""

    target = "fake-reward:1"

    def __init__(self, *, fail: int = 0, transient: bool = True, parse_failed_on: str = "", hold: float = 0.0):
        self.requests: list[ScoreRequest] = []
        self.fail, self.transient, self.parse_failed_on, self.hold = fail, transient, parse_failed_on, hold
        self.lock = threading.Lock()

    def score(self, request: ScoreRequest, *, timeout_s: float) -> ScoreResult:
        with self.lock:
            self.requests.append(request)
            failing = self.fail > 0
            self.fail -= 1
        time.sleep(self.hold)
        if failing:
            raise ScoreCallFailed("UNAVAILABLE: connection refused", transient=self.transient)
        return ScoreResult(
            scores=tuple(float(len(s.response)) for s in request.samples),
            sub_scores={"twice": SubScores(tuple(2.0 * len(s.response) for s in request.samples))},
            parse_failed=tuple(s.response == self.parse_failed_on for s in request.samples),
        )


def section(**keys: object) -> RewardServiceConfig:
    reward = make_config(**keys).reward
    assert reward is not None
    return reward


def inputs(responses: list[str]) -> dict:
    n = len(responses)
    return dict(prompts=["p"] * n, responses=responses, labels=["l"] * n, metadatas=[{"k": "v"}] * n)


def test_reward_specs_parse_into_weighted_terms():
    assert parse_reward("math_answer") == (RewardTerm("math_answer"),)
    terms = parse_reward("0.7*math_answer + 0.3*judge:helpfulness")
    assert terms == (RewardTerm("math_answer", 0.7), RewardTerm("judge:helpfulness", 0.3))
    assert [t.model for t in terms] == [None, "helpfulness"] and terms[1].model_type == "judge"
    assert RewardTerm("my_pkg.rewards:score").model is None  # module:function stays a rule
    assert reward_text({"math_answer": 0.7, "service:rm": 0.3}) == "0.7*math_answer + 0.3*service:rm"
    for bad, why in (("", "empty"), ("a + ", "empty term"), ("judge:", "names no model"), ("a + a", "twice")):
        with pytest.raises(RewardSpecError, match=why):
            parse_reward(bad)


def test_the_config_checks_the_models_rollout_reward_names():
    assert make_config({"digit_task": 0.5, "judge:j": 0.5}).rollout.reward == "0.5*digit_task + 0.5*judge:j"
    with pytest.raises(ValueError, match=r"judge:other names no model of reward\.models"):
        make_config("judge:other")
    with pytest.raises(ValueError, match=r"classifier:j is a judge"):
        make_config("classifier:j")
    with pytest.raises(ValueError, match=r"no model of reward\.models \(served: none"):
        config_from_dict({"model": {"path": "m"}, "data": {"train_path": "t"}, "rollout": {"reward": "service:j"}})


def test_the_batcher_packs_samples_of_concurrent_callers_up_to_the_token_budget():
    client = FakeScoreClient(hold=0.2)
    batcher = ScoreBatcher(client, "j", section(max_batch_tokens=10, max_calls_in_flight=1))
    first = batcher.submit([_sample("a")], [4])  # the one sender takes this alone and holds it 0.2 s
    time.sleep(0.05)
    rest = batcher.submit([_sample(r) for r in ("bb", "ccc", "dddd")], [4, 4, 4])
    second = batcher.submit([_sample("eeeee")], [3])
    scores = [f.result(timeout=10) for f in (*first, *rest, *second)]
    assert [s.score for s in scores] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [s.sub_scores for s in scores] == [{"twice": 2.0 * k} for k in range(1, 6)]
    # 4 | 4+4 (a third 4 would pass 10) | 4+3 from two callers
    assert [[s.response for s in r.samples] for r in client.requests] == [["a"], ["bb", "ccc"], ["dddd", "eeeee"]]
    assert scores[1].queue_s > 0.1  # waited for the first call


def test_a_service_that_is_down_is_asked_again_within_max_wait_s():
    client = FakeScoreClient(fail=3)
    batcher = ScoreBatcher(client, "j", section(max_wait_s=60, call_timeout_s=5))
    [future] = batcher.submit([_sample("abc")], [3])
    assert future.result(timeout=30).score == 3.0
    assert len(client.requests) == 4 and all(r.samples == client.requests[0].samples for r in client.requests)


def test_a_service_down_past_max_wait_s_fails_the_batch_naming_it():
    client = FakeScoreClient(fail=10**6)
    batcher = ScoreBatcher(client, "j", section(max_wait_s=1, call_timeout_s=1))
    [future] = batcher.submit([_sample("abc")], [3])
    with pytest.raises(RewardUnavailable, match=r"reward service at fake-reward:1 \(model j\) did not score 1"):
        future.result(timeout=30)


def test_a_refused_call_is_not_retried():
    client = FakeScoreClient(fail=1, transient=False)
    batcher = ScoreBatcher(client, "j", section())
    [future] = batcher.submit([_sample("abc")], [3])
    with pytest.raises(RewardError, match=r"refused Score\(j\)"):
        future.result(timeout=30)
    assert len(client.requests) == 1


def test_a_weighted_sum_of_rule_and_model_rewards():
    client = FakeScoreClient(parse_failed_on="7")
    config = make_config({"digit_task": 0.7, "judge:j": 0.3})
    reward = RewardResolver(config, client_factory=lambda c: client).resolve(config.rollout.reward)
    assert isinstance(reward, WeightedReward)
    labels = ["7", "7", "3"]
    scored = reward.score_detailed(**{**inputs(["7", "12", "3"]), "labels": labels}, tokens=[2, 3, 2])
    rule = resolve_reward("digit_task").score(**{**inputs(["7", "12", "3"]), "labels": labels})
    assert rule == [1.0, 0.0, 1.0]
    assert scored.values == pytest.approx([0.7 * r + 0.3 * m for r, m in zip(rule, [1.0, 2.0, 1.0], strict=True)])
    m = scored.metrics
    assert m["reward/digit_task/mean"] == pytest.approx(2 / 3) and m["reward/j/mean"] == pytest.approx(4 / 3)
    assert m["reward/j/parse_failure_frac"] == pytest.approx(1 / 3) and m["reward/j/twice"] == pytest.approx(8 / 3)
    assert {"reward/j/queue_s", "reward/j/call_s"} <= set(m)
    assert [s.metadata for s in client.requests[0].samples] == [{"k": "v"}] * 3


def test_a_lone_rule_reward_stays_the_plain_function():
    config = make_config("digit_task")
    assert RewardResolver(config, client_factory=lambda c: FakeScoreClient()).resolve("digit_task") is resolve_reward(
        "digit_task"
    )


def test_chat_messages_reach_the_service_as_messages():
    assert [m.as_dict() for m in messages_of({"messages": '[{"role": "user", "content": "hi"}]'})] == [
        {"role": "user", "content": "hi"}
    ]
    assert messages_of({}) == () and messages_of({"messages": "not json"}) == ()


def _sample(response: str):
    from services.contracts.reward_calls import RewardSample

    return RewardSample(prompt="p", response=response, label="l")


def test_each_score_call_is_a_span_with_its_queue_time_linked_to_the_calls_it_serves(tmp_path):
    """Two Generate calls' samples in one Score call (held back by a first call): its rl.reward_call span continues
    the first one's trace, links both, and carries samples, tokens, queue time and tries. Tracing is set up once
    per process, so this runs in one of its own."""
    path = tmp_path / "traces.jsonl"
    run_script(f"""
        import threading, time
        from services.contracts.config_loading import config_from_dict
        from services.contracts.reward_calls import RewardSample, ScoreResult
        from services.rollout.remote_reward import ScoreBatcher
        from services.telemetry import tracing
        tracing.setup_tracing("tandem-rollout", exporter="file", file_path={str(path)!r})

        class FakeScoreClient:  # a fake of the reward service's Score call: one score per sample, 0.3 s each call
            target = "fake-reward:1"
            def score(self, request, *, timeout_s):
                time.sleep(0.3)
                return ScoreResult(scores=tuple(1.0 for _ in request.samples), verdicts=("1",) * len(request.samples))

        reward = config_from_dict({{"model": {{"path": "m"}}, "data": {{"train_path": "t"}}, "reward": {{
            "max_calls_in_flight": 1, "models": {{"j": {{"type": "judge", "path": "j", "template": "x"}}}}}}}}).reward
        batcher = ScoreBatcher(FakeScoreClient(), "j", reward)
        sample = RewardSample(prompt="p", response="r")
        with tracing.span("rl.first"):
            first = batcher.submit([sample], [5])
        time.sleep(0.1)
        futures = []
        for name in ("rl.a", "rl.b"):
            with tracing.span(name):
                futures += batcher.submit([sample, sample], [3, 4])
        for f in first + futures:
            f.result(timeout=30)
        tracing.shutdown_tracing()
    """)
    spans = read_spans(path)
    by_name = {s["name"]: s for s in spans}
    calls = [s for s in spans if s["name"] == "rl.reward_call"]
    assert [c["attributes"]["rl.samples"] for c in calls] == [1, 4]
    second = calls[1]
    assert second["attributes"]["rl.tokens"] == 14 and second["attributes"]["rl.attempts"] == 1
    assert second["attributes"]["rl.model"] == "j" and second["attributes"]["rl.service"] == "fake-reward:1"
    assert second["attributes"]["rl.queue_s"] > 0.1  # waited for the first call
    assert second["attributes"]["rl.verdicts"] == "1 | 1 | 1 | 1"  # the judge's own words, kept for debugging
    assert second["parent_span_id"] == by_name["rl.a"]["span_id"]
    assert {link["span_id"] for link in second["links"]} == {by_name["rl.a"]["span_id"], by_name["rl.b"]["span_id"]}

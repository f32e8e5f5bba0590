"""The reward service's models and RewardService: the classifier against transformers' own text-classification
pipeline, the judge's parsers and parse failures (the default score and a count, never an error), majority votes,
and RewardService's checks and books over a fake model (named so). Over the wire, as its own process:
test_fuzz_services.py (bad requests) and test_reward_e2e.py (a run)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from services.contracts.chat_messages import ChatMessage
from services.contracts.config_loading import config_from_dict
from services.contracts.reward_calls import RewardSample, ScoreRequest, ScoreResult
from services.reward.builder import RewardParts, build_reward
from services.reward.classifier import token_batches
from services.reward.judge import JudgeConfigError, load_parser, majority
from services.reward.service import RewardService

SAMPLES = (
    RewardSample(prompt="3 7 =", response="7", label="7"),
    RewardSample(prompt="What is 2+2?", response="It is 4, because two and two make four.", label="4"),
    RewardSample(
        prompt="ignored: the messages are the prompt",
        messages=(ChatMessage("system", "Be brief."), ChatMessage("user", "Name a colour.")),
        response="Blue",
    ),
    RewardSample(prompt="1 1 =", response="", label="1"),
)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory) -> Path:
    from services.modelinit.init_model import init_model

    return init_model(tmp_path_factory.mktemp("rm") / "classifier", preset="classifier", seed=3)


def service(models: dict, **section) -> RewardService:
    config = config_from_dict(
        {"model": {"path": "m"}, "data": {"train_path": "t"}, "reward": {"device": "cpu", "models": models, **section}}
    )
    return RewardService(build_reward(config))


def test_the_classifier_scores_as_transformers_text_classification_pipeline_does(classifier_dir):
    """Batched by tokens (right-padded rows of different lengths) and alone, the raw logit equals the pipeline's
    (function_to_apply none) on the chat the model's own template renders."""
    from transformers import AutoTokenizer, pipeline

    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    asked = [[m.as_dict() for m in s.messages] or [{"role": "user", "content": s.prompt}] for s in SAMPLES]
    chats = [[*turns, {"role": "assistant", "content": s.response}] for turns, s in zip(asked, SAMPLES, strict=True)]
    texts = [str(tokenizer.apply_chat_template(c, tokenize=False)) for c in chats]
    reference = [
        r["score"] for r in pipeline("text-classification", model=str(classifier_dir), function_to_apply="none")(texts)
    ]
    for budget in (1, 10_000):  # one sample per forward pass, then all in one
        svc = service({"rm": {"type": "classifier", "path": str(classifier_dir), "max_batch_tokens": budget}})
        result = svc.score(ScoreRequest(model="rm", samples=SAMPLES))
        assert result.scores == pytest.approx(reference, abs=1e-5)
        assert result.tokens == sum(len(tokenizer(t)["input_ids"]) for t in texts)
    assert len(set(reference)) == len(reference)  # the samples really differ


def test_token_batches_fit_the_budget_in_ascending_length():
    assert [b.indices for b in token_batches([5, 1, 3, 3, 9], 9)] == [(1, 2, 3), (0,), (4,)]
    assert [b.width for b in token_batches([5, 1, 3, 3, 9], 9)] == [3, 5, 9]


def _judge(tmp_path: Path, model: Path, **keys) -> RewardService:
    return service(
        {"j": {"type": "judge", "path": str(model), "template": "{{ prompt }} {{ response }} , {{ label }} =", **keys}}
    )


def test_unparseable_verdicts_score_the_default_and_are_counted(example_model, tmp_path):
    """A random-init judge writes anything: a parser that never matches fails every sample, a file parser that takes
    even-length verdicts only fails exactly the others; neither raises."""
    never = _judge(tmp_path, example_model, parser="NEVER", default_score=-1.0, max_new_tokens=3)
    result = never.score(ScoreRequest(model="j", samples=SAMPLES))
    assert result.scores == (-1.0,) * 4 and result.parse_failed == (True,) * 4 and len(result.verdicts) == 4
    assert never.get_state().models[0].parse_failures == 4
    (tmp_path / "parse.py").write_text("def verdict(text):\n    return len(text) if len(text) % 2 == 0 else None\n")
    even = _judge(tmp_path, example_model, parser=f"{tmp_path}/parse.py:verdict", score_range=[0, 4], max_new_tokens=3)
    result = even.score(ScoreRequest(model="j", samples=SAMPLES))
    assert result.parse_failed == tuple(len(v) % 2 == 1 for v in result.verdicts)
    assert result.scores == tuple(0.0 if len(v) % 2 else min(4.0, len(v)) for v in result.verdicts)


def test_a_regex_parser_takes_its_first_group_and_clips_to_the_score_range(example_model, tmp_path):
    judge = _judge(tmp_path, example_model, parser=r"(\d)", score_range=[0, 5], default_score=0.5, max_new_tokens=4)
    result = judge.score(ScoreRequest(model="j", samples=SAMPLES))
    for verdict, score, failed in zip(result.verdicts, result.scores, result.parse_failed, strict=True):
        m = re.search(r"(\d)", verdict)
        assert failed == (m is None) and score == (0.5 if m is None else min(5.0, float(m.group(1))))


def test_parsers_and_votes():
    assert load_parser(r"score: (\d+)")("the score: 7 of 10") == 7.0
    assert load_parser(r"\d+")("x 42 y") == 42.0 and load_parser(r"(\d)")("none") is None
    assert load_parser(r"(\w+)")("nan") is None  # a parsed NaN is no score
    with pytest.raises(JudgeConfigError, match="neither module:function nor a regex"):
        load_parser("(unclosed")
    assert majority([1.0, 0.0, 1.0, None]) == (1.0, 0.5)
    assert majority([0.0, 1.0]) == (0.0, 0.5)  # a tie: the first drawn
    assert majority([None, None]) == (None, 0.0)


def test_votes_need_sampling(example_model, tmp_path):
    with pytest.raises(ValueError, match="votes need temperature > 0"):
        _judge(tmp_path, example_model, n=3)
    judge = _judge(tmp_path, example_model, n=3, temperature=1.0, parser=r"(\d)", max_new_tokens=2, seed=5)
    result = judge.score(ScoreRequest(model="j", samples=SAMPLES))
    assert all(v.count(" | ") == 2 for v in result.verdicts)  # the three votes' verdicts, kept
    assert all(a in (0.0, 1 / 3, 2 / 3, 1.0) for a in result.sub_scores["agreement"].values)


class FakeModel:
    """A fake reward model: scores len(response), holding the call `hold` seconds."""

    type, path = "classifier", "fake"

    def __init__(self, hold: float = 0.0):
        self.hold, self.calls = hold, 0

    def score(self, samples):
        self.calls += 1
        time.sleep(self.hold)
        return ScoreResult(scores=tuple(float(len(s.response)) for s in samples), tokens=len(samples))


def test_the_service_refuses_what_it_cannot_score_and_queues_calls_for_one_model():
    slow = FakeModel(hold=0.3)
    svc = RewardService(RewardParts(models={"a": slow, "b": FakeModel()}, device="cpu", max_request_samples=3))
    with pytest.raises(KeyError, match=r"no reward model named 'c' \(served: a, b\)"):
        svc.score(ScoreRequest(model="c", samples=SAMPLES[:1]))
    with pytest.raises(ValueError, match="no samples"):
        svc.score(ScoreRequest(model="a", samples=()))
    with pytest.raises(ValueError, match=r"more than rollout\.max_request_samples"):
        svc.score(ScoreRequest(model="a", samples=SAMPLES))
    results: list[ScoreResult] = []
    threads = [threading.Thread(target=lambda: results.append(svc.score(ScoreRequest("a", SAMPLES[:2])))) for _ in "xy"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.queue_s > 0.2 for r in results) == [False, True]  # the second waited for the first
    assert results[0].scores == (1.0, 39.0) and all(r.time_s >= 0.3 for r in results)
    assert [(m.name, m.samples_scored) for m in svc.get_state().models] == [("a", 4), ("b", 0)]

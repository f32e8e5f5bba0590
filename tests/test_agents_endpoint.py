"""The OpenAI-compatible endpoint of the rollout service (rollout.openai_api, services/rollout/agents/) with the
real native engine on the tiny model, the real uvicorn server and the real `openai` client; batches go to a real
redis-server and are read back as the trainer reads them."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.contracts.rollout_calls import GenerateRequest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402  (after the skips: the agents extra brings it)

from services.buffer.stream import RolloutBuffer, connect  # noqa: E402
from services.contracts.chat_messages import ChatMessage  # noqa: E402
from services.contracts.config import ConfigError  # noqa: E402
from services.contracts.config_loading import config_from_dict, load_config  # noqa: E402
from services.launcher import preflight  # noqa: E402
from services.rollout.agents.runner import AgentRollout  # noqa: E402
from services.rollout.builder import build_rollout  # noqa: E402
from services.rollout.prompts import model_inputs  # noqa: E402
from services.rollout.service import GenerateResult, PromptInput, RolloutService  # noqa: E402
from services.rpc.grpc_util import FailedPrecondition  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOKEN = "test-token"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def make_service(model: Path, redis_url: str, **rollout) -> RolloutService:
    config = config_from_dict(
        {
            "run_name": "agents-test",
            "model": {"path": str(model)},
            "data": {
                "train_path": "unused.jsonl",
                "chat_template": str(REPO / "examples/agent_tools/chat_template.jinja"),
            },
            "rollout": {
                "device": "cpu",
                "n_samples_per_prompt": 4,
                "openai_api": {
                    "enabled": True,
                    "tool_parser": str(REPO / "examples/agent_tools/tool_call.py") + ":parse",
                },
                "sampling": {"temperature": 1.0, "max_new_tokens": 1, "seed": 3},
                "reward": "exact_match",
                **rollout,
            },
            "services": {"auth_token": TOKEN},
            "redis": {"url": redis_url},
        }
    )
    return RolloutService(build_rollout(config, replica=0))


@pytest.fixture(scope="module")
def service(example_model: Path, redis_server) -> Iterator[RolloutService]:
    svc = make_service(example_model, redis_server.url)
    yield svc
    svc.close()


def agents(service: RolloutService) -> AgentRollout:
    assert service.agents is not None
    return service.agents


def client(service: RolloutService, path: str = "/v1", token: str = TOKEN):
    return openai.OpenAI(base_url=agents(service).server.url + path, api_key=token, max_retries=0)


def finish_agrees(tokens: int, finish: str | None, limit: int) -> bool:
    """An unseeded call samples anew: "length" only at the limit; "stop" at or below it (the end-of-text token that
    stops a call counts among its tokens, as OpenAI's and vLLM's usage count it)."""
    return (finish == "length" and tokens == limit) or (finish == "stop" and 1 <= tokens <= limit)


def lookup_prompts(n: int) -> list[PromptInput]:
    rows = [json.loads(line) for line in (REPO / "examples/tool_lookup/eval.jsonl").read_text().splitlines()][:n]
    return [
        PromptInput(
            messages=(ChatMessage("user", r["prompt"]),), label=r["label"], group_id=i, metadata={"table": r["table"]}
        )
        for i, r in enumerate(rows)
    ]


def read_batch(url: str, stream: str, entry_id: str):
    buf = RolloutBuffer(connect(url), stream, groups=("actor",), group="actor", consumer="actor-0")
    entry = buf.read([entry_id], timeout_s=10)[0]
    buf.ack([entry_id])
    return entry.batch


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"3": 5}}, "logit_bias"),
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
        ({"tool_choice": "required", "tools": TOOLS}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 0}, "n"),
        ({"temperature": 3.5}, "temperature"),
        ({"stop": ["x"] * 2}, "stop"),
        ({"extra_body": {"best_of": 3}}, "best_of"),
    ],
)
def test_parameters_it_cannot_honour_are_refused_by_name(service, extra, param):
    body = extra.pop("extra_body", {})
    with pytest.raises(openai.BadRequestError) as err:
        client(service).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "4 ="}], extra_body=body, **extra
        )
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error", err.value.body
    assert err.value.body["message"].startswith(f"{param}: ")


def test_a_body_that_is_not_json_or_a_message_of_an_unknown_role_is_refused_by_name(service):
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    url = agents(service).server.url + "/v1/chat/completions"
    reply = httpx.post(url, content=b"{not json", headers=headers)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "body"
    reply = httpx.post(url, json={"messages": [{"role": "robot", "content": "hi"}]}, headers=headers)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[0].role"
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    reply = httpx.post(url, json={"messages": [image]}, headers=headers)
    assert reply.json()["error"]["message"] == "messages[0].content[0]: only text parts are supported, got 'image_url'"


def test_the_endpoint_stops_with_the_service(example_model, redis_server):
    svc = make_service(example_model, redis_server.url)
    url = agents(svc).server.url
    assert httpx.get(url + "/health").status_code == 200
    svc.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")


def test_a_missing_or_wrong_token_is_refused_and_health_needs_none(service):
    with pytest.raises(openai.AuthenticationError):
        client(service, token="wrong").chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "4 ="}]
        )
    assert httpx.get(agents(service).server.url + "/health").json() == {"status": "ok"}


def test_chat_answers_tool_calls_logprobs_and_streams_the_same_shape(service):
    c = client(service)
    calls = 0
    for _ in range(3):  # the untrained model calls the tool (`(`) about one time in 25: 128 choices hold one
        r = c.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "4 ="}],
            tools=TOOLS,
            max_tokens=1,
            logprobs=True,
            n=128,
        )
        assert r.model_extra["prompt_token_ids"] == service.texts.chat_ids([{"role": "user", "content": "4 ="}])
        assert [choice.index for choice in r.choices] == list(range(128))
        for choice in r.choices:
            assert len(choice.logprobs.content) == 1 and choice.logprobs.content[0].logprob < 0
            if choice.message.tool_calls:
                calls += 1
                assert choice.finish_reason == "tool_calls" and choice.message.content is None
                assert choice.message.tool_calls[0].function.name == "lookup"
            else:
                assert choice.finish_reason in ("length", "stop") and choice.message.content is not None, choice
        if calls:
            break
    assert calls > 0
    chunks = list(
        c.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "4 ="}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    tokens = chunks[-1].usage.completion_tokens
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[:-1] == [None] * (len(finish) - 1) and finish_agrees(tokens, finish[-1], limit=3), (tokens, finish)
    assert chunks[0].choices[0].delta.role == "assistant" and len(text.split()) <= tokens <= 3


def test_completions_take_token_ids_as_they_are(service):
    ids = service.texts.encode_prompt_text("4 =")
    r = client(service).completions.create(model="policy", prompt=ids, max_tokens=2, logprobs=0)
    generated, finish = len(r.choices[0].logprobs.token_logprobs), r.choices[0].finish_reason
    assert r.model_extra["prompt_token_ids"] == ids and finish_agrees(generated, finish, limit=2), (generated, finish)
    streamed = list(client(service).completions.create(model="policy", prompt="4 =", max_tokens=2, stream=True))
    assert streamed[0].choices[0].finish_reason in ("stop", "length") and streamed[0].object == "text_completion"


def test_an_unknown_episode_is_404_and_a_training_episode_refuses_another_temperature(service):
    with pytest.raises(openai.NotFoundError, match="episode 'nope' is not open"):
        client(service, "/episodes/nope/v1").chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "4 ="}]
        )
    episode = agents(service).store.open(None, agents(service).endpoint.default_sampling.with_seed(1), timeout_s=60)
    try:
        # the episode named by a header instead of the path
        client(service).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "4 ="}], extra_headers={"X-Episode-Id": episode.id}
        )
        assert episode.turns == 1 and len(episode.training_samples(version=0)) == 1
        for kwargs, param in (({"temperature": 0.5}, "temperature"), ({"n": 2}, "n")):
            with pytest.raises(openai.BadRequestError) as err:
                client(service, f"/episodes/{episode.id}/v1").chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "4 ="}], **kwargs
                )
            assert err.value.body["param"] == param
    finally:
        agents(service).store.close([episode])


def test_an_agent_episode_is_one_sample_whose_tool_results_are_masked(example_model, redis_server, stream):
    """Two turns per episode through the openai client: prompt, the first answer (loss 1), the tool result and
    nothing else between (loss 0: `) v`), the second answer (loss 1): the generated ids reused, not re-encoded."""
    svc = make_service(example_model, redis_server.url, agent="tests/helpers/agents.py:call_then_answer")
    try:
        prompts = lookup_prompts(3)
        result = svc.generate(GenerateRequest(rollout_id=0, prompts=tuple(prompts), stream=stream))
    finally:
        svc.close()
    batch = read_batch(redis_server.url, stream, result.entry_id)
    data_path = model_inputs(svc.texts, prompts).ids
    assert batch.num_samples == 12 and list(batch.group_ids) == [0] * 4 + [1] * 4 + [2] * 4
    assert list(batch.rewards) == [0.0, 1.0] * 6  # the agent's own rewards, by sample index
    assert result.metrics["agent_samples_per_episode"] == 1.0 and result.metrics["agent_reused_turn_frac"] == 0.5
    assert result.metrics["agent_failed_episodes"] == 0.0 and result.metrics["agent_turns_mean"] == 2.0
    for i, (p_sl, r_sl, t_sl) in enumerate(batch.sample_slices()):
        prompt = prompts[i // 4]
        # the prompt exactly as the data path encodes the row (one chat template, services/rollout/chat_template.py)
        assert batch.tokens[p_sl].tolist() == data_path[i // 4]
        response = batch.tokens[r_sl].tolist()
        observation = svc.texts.encode_text(f") {prompt.label}")
        assert response[1:-1] == observation and len(response) == 2 + len(observation)
        assert batch.loss_mask[t_sl].tolist() == [1] + [0] * len(observation) + [1]
        log_probs = batch.rollout_log_probs[t_sl].tolist()
        assert log_probs[0] < 0 and log_probs[-1] < 0 and log_probs[1:-1] == [0.0] * len(observation)


def test_a_rewritten_history_makes_each_turn_its_own_sample(example_model, redis_server, stream):
    svc = make_service(example_model, redis_server.url, agent="tests/helpers/agents.py:rewrite_history")
    try:
        result = svc.generate(GenerateRequest(rollout_id=0, prompts=tuple(lookup_prompts(2)), stream=stream))
    finally:
        svc.close()
    batch = read_batch(redis_server.url, stream, result.entry_id)
    summary = svc.texts.chat_ids([{"role": "user", "content": "1 + 2 ="}])
    assert [batch.tokens[p].tolist() == summary for p, _, _ in batch.sample_slices()] == [False, True] * 8
    assert batch.num_samples == 16 and list(batch.group_ids) == [0] * 8 + [1] * 8  # 2 prompts x 4 episodes x 2
    assert list(batch.rewards) == [0.5] * 16 and list(batch.response_lengths) == [1] * 16
    assert result.metrics["agent_rewritten_turns"] == 8.0 and result.metrics["agent_samples_per_episode"] == 2.0
    assert result.metrics["agent_reused_turn_frac"] == 0.0


def test_crashing_and_hanging_agents_are_left_out_and_the_batch_still_forms(
    example_model, redis_server, stream, caplog
):
    svc = make_service(
        example_model, redis_server.url, agent="tests/helpers/agents.py:crash_hang_or_answer", agent_timeout_s=8
    )
    try:
        result = svc.generate(GenerateRequest(rollout_id=0, prompts=tuple(lookup_prompts(2)), stream=stream))
        assert len(agents(svc).store) == 0  # every episode closed: none can post into a later batch
    finally:
        svc.close()
    batch = read_batch(redis_server.url, stream, result.entry_id)
    assert batch.num_samples == 4 and list(batch.group_ids) == [0, 0, 1, 1]  # samples 2 and 3 of each prompt
    assert result.metrics["agent_failed_episodes"] == 4.0 and result.metrics["agent_episodes"] == 8.0
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert sum("the agent raised RuntimeError: the agent's own bug" in e for e in errors) == 2, errors
    assert sum("did not return within rollout.agent_timeout_s (8 s)" in e for e in errors) == 2, errors


def test_when_every_agent_fails_the_generate_fails_naming_why(example_model, redis_server, stream):
    svc = make_service(example_model, redis_server.url, agent="tests/helpers/agents.py:always_crash")
    try:
        with pytest.raises(FailedPrecondition, match=r"all 4 agent episodes failed.*KeyError: 'missing_tool'"):
            svc.generate(GenerateRequest(rollout_id=0, prompts=tuple(lookup_prompts(1)), stream=stream))
        never = make_service(example_model, redis_server.url, agent="tests/helpers/agents.py:never_calls")
        try:
            with pytest.raises(FailedPrecondition, match="finished without a single call to the endpoint"):
                never.generate(GenerateRequest(rollout_id=0, prompts=tuple(lookup_prompts(1)), stream=stream))
        finally:
            never.close()
    finally:
        svc.close()


def test_an_agent_spec_that_is_not_an_async_function_fails_the_start_and_the_preflight(example_model, redis_server):
    with pytest.raises(ValueError, match="must be an async function"):
        make_service(example_model, redis_server.url, agent="tests/helpers/agents.py:not_async")
    config = load_config(
        str(REPO / "examples/agent_tools.yaml"),
        ["rollout.agent=examples/agent_tools/agent.py:nope", "rollout.openai_api.tool_parser=hermes"],
    )
    with pytest.raises(ConfigError, match=r"rollout.agent '.*agent.py:nope': .*has no attribute 'nope'"):
        preflight._check_agents(config)


def test_an_external_agent_process_claims_episodes_drives_them_and_posts_rewards(example_model, redis_server, stream):
    """rollout.agent: external. A separate process (tests/helpers/external_agent.py) claims the episodes with `tandem
    ctl episodes`, chats through each one's base URL with the openai client and posts rewards with `tandem ctl
    reward`, except for one: that one fails at its deadline, and the batch forms from the other three."""
    svc = make_service(example_model, redis_server.url, agent="external", agent_timeout_s=45)
    out: dict[str, GenerateResult] = {}
    worker = threading.Thread(
        target=lambda: out.update(
            result=svc.generate(GenerateRequest(rollout_id=0, prompts=tuple(lookup_prompts(1)), stream=stream))
        )
    )
    worker.start()
    try:
        agent = subprocess.run(
            [sys.executable, str(REPO / "tests/helpers/external_agent.py"), agents(svc).server.url, TOKEN, "4"],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=REPO,
        )
        assert agent.returncode == 0, agent.stderr
        assert json.loads(agent.stdout) == [[lookup_prompts(1)[0].messages[0].as_dict()]] * 4
        worker.join(timeout=60)
    finally:
        worker.join(timeout=60)
        svc.close()
    result = out["result"]
    batch = read_batch(redis_server.url, stream, result.entry_id)
    assert batch.num_samples == 3 and sorted(batch.rewards.tolist()) == [0.0, 1.0, 2.0]
    assert result.metrics["agent_failed_episodes"] == 1.0


def test_a_reward_is_posted_once_and_an_unclaimed_episode_fails_naming_that(example_model, redis_server, stream):
    svc = make_service(example_model, redis_server.url, agent="external", agent_timeout_s=3)
    try:
        with pytest.raises(
            FailedPrecondition, match=r"no reward within rollout.agent_timeout_s \(3 s\); no external agent"
        ):
            svc.generate(GenerateRequest(rollout_id=0, prompts=tuple(lookup_prompts(1)), stream=stream))
        episode = agents(svc).store.open(None, None, timeout_s=60)
        headers = {"authorization": f"Bearer {TOKEN}"}
        url = f"{agents(svc).server.url}/episodes/{episode.id}"
        client(svc, f"/episodes/{episode.id}/v1").chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "4 ="}]
        )
        assert httpx.post(url + "/reward", json={"reward": 1}, headers=headers).json()["status"] == "finished"
        again = httpx.post(url + "/reward", json={"reward": 1}, headers=headers)
        assert again.status_code == 409 and "is finished" in again.json()["error"]["message"]
        bad = httpx.post(url + "/reward", json={"reward": "high"}, headers=headers)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward"
    finally:
        svc.close()

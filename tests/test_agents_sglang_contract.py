"""The agent endpoint with rollout.engine sglang: an episode's turns go to the SGLang contract test server (it answers
as SGLang 0.5.17: token ids in, token ids and log-probs out) through the same proxy as the native engine. The
contract server's next token is a function of the last input id, so the second turn's answer shows that the
engine was given the episode's token context (prompt, first answer, tool result), and the batch holds SGLang's own
ids and log-probs."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.contracts.rollout_calls import GenerateRequest

pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from helpers.sglang_contract_server import ContractServer

from services.buffer.stream import RolloutBuffer, connect
from services.contracts.chat_messages import ChatMessage
from services.contracts.config_loading import config_from_dict
from services.modelinit.init_model import init_model
from services.rollout.builder import build_rollout
from services.rollout.engines.sglang.engine import SGLangEngine
from services.rollout.service import PromptInput, RolloutService

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def test_an_agent_episode_through_sglang_keeps_sglangs_token_ids_and_log_probs(tmp_path: Path, redis_server, stream):
    model = init_model(tmp_path / "tiny", preset="tiny", seed=0)
    server = ContractServer("--profile", "0.5.17", "--model-path", str(model))
    config = config_from_dict(
        {
            "run_name": "agents-sglang",
            "model": {"path": str(model)},
            "data": {
                "train_path": "unused.jsonl",
                "chat_template": str(REPO / "examples/agent_tools/chat_template.jinja"),
            },
            "rollout": {
                "engine": "sglang",
                "n_samples_per_prompt": 2,
                "openai_api": {"enabled": True, "tool_parser": "none"},
                "agent": "tests/helpers/agents.py:call_then_answer",
                "sampling": {"temperature": 1.0, "max_new_tokens": 1},
                "sglang": {"urls": [server.url]},
            },
            "redis": {"url": redis_server.url},
        }
    )
    service = RolloutService(build_rollout(config, replica=0))
    try:
        assert isinstance(service.engine, SGLangEngine)
        prompt = PromptInput(messages=(ChatMessage("user", "3 ="),), label="7", group_id=5)
        result = service.generate(GenerateRequest(rollout_id=0, prompts=tuple([prompt]), stream=stream))
        buffer = RolloutBuffer(connect(redis_server.url), stream, groups=("actor",), group="actor", consumer="t")
        batch = buffer.read([result.entry_id], timeout_s=10)[0].batch
    finally:
        service.close()
        server.stop()
    prompt_ids = service.texts.chat_ids([{"role": "user", "content": "3 ="}])
    first = (prompt_ids[-1] + 1) % 22  # the contract server's rule: the last input id + 1
    observation = service.texts.encode_text(") 7")
    second = (observation[-1] + 1) % 22  # the second turn was given the token context, ending with the tool result
    assert batch.num_samples == 2 and batch.logprob_space == "tempered" and batch.metadata["engine"] == "sglang"
    assert batch.tokens.tolist() == [*prompt_ids, first, *observation, second] * 2
    assert batch.loss_mask.tolist() == [1, *[0] * len(observation), 1] * 2
    expected = [-(0.25 + 0.01 * first), *[0.0] * len(observation), -(0.25 + 0.01 * second)]
    assert batch.rollout_log_probs.tolist() == pytest.approx(expected * 2)
    assert result.metrics["agent_samples_per_episode"] == 1.0 and result.metrics["agent_reused_turn_frac"] == 0.5

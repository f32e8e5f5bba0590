"""Contract test of RolloutService with rollout.engine sglang: samples from the contract test server become the same
batch format as the native engine's (tokens, per-token rollout log-probs, finish reasons, sample versions) in Redis,
a weight sync through the service restamps later samples with the version SGLang reports, and every batch names
the distribution of its log-probs (tempered, what SGLang reports)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers.sglang_contract_server import ContractServer

from services.buffer.stream import RolloutBuffer, connect
from services.contracts.config import ProcessGroupWeights
from services.contracts.config_loading import config_from_dict
from services.contracts.rollout_calls import GenerateRequest, PrepareRequest, PrepareResult, ReceiveRequest
from services.modelinit.init_model import init_model
from services.rollout.builder import build_rollout
from services.rollout.engines.sglang.engine import SGLangEngine
from services.rollout.service import PromptInput, RolloutService
from services.weights import WeightPublisher, specs_from_tensors

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)


def test_sglang_contract_service_writes_the_native_batch_format(
    tmp_path: Path, redis_server, stream: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    model = init_model(tmp_path / "tiny", preset="tiny", seed=0)  # the tokenizer; the weights are synced below
    server = ContractServer("--profile", "0.5.23", "--model-path", str(model))
    config = config_from_dict(
        {
            "run_name": "sglang-contract",
            "model": {"path": str(model)},
            "data": {"train_path": "unused.jsonl"},
            "rollout": {
                "engine": "sglang",
                "n_samples_per_prompt": 2,
                "reward": "digit_task",
                "sampling": {"temperature": 1.0, "max_new_tokens": 3},
                "sglang": {"urls": [server.url]},
            },
            "weights": {"transport": "gloo", "timeout_s": 20},
            "redis": {"url": redis_server.url},
        }
    )
    service = RolloutService(build_rollout(config, replica=0))
    try:
        assert isinstance(service.engine, SGLangEngine)
        first = service.generate(
            GenerateRequest(rollout_id=1, prompts=(PromptInput(text="3 4 =", label="4", group_id=7),), stream=stream)
        )
        buffer = RolloutBuffer(connect(redis_server.url), stream, groups=("actor",), group="actor", consumer="t")
        batch = buffer.read([first.entry_id], timeout_s=10)[0].batch
        prompt = service.texts.tokenizer("3 4 =")["input_ids"]
        response = [(prompt[-1] + 1 + i) % 22 for i in range(3)]  # the contract server's rule
        assert batch.tokens.tolist() == (prompt + response) * 2 and batch.response_lengths.tolist() == [3, 3]
        assert batch.rollout_log_probs.tolist() == pytest.approx([-(0.25 + 0.01 * t) for t in response] * 2)
        assert list(batch.finish_reasons) == ["length", "length"] and batch.loss_mask.tolist() == [1] * 6
        assert batch.sample_versions.tolist() == [0, 0] and batch.policy_version == 0
        assert batch.metadata["engine"] == "sglang" and batch.group_ids.tolist() == [7, 7]
        assert batch.logprob_space == "tempered"  # SGLang reports log_softmax(logits / T): the trainer scores that

        from transformers import AutoModelForCausalLM

        named = [(n, p.detach()) for n, p in AutoModelForCausalLM.from_pretrained(model).named_parameters()]
        pub = WeightPublisher(config=ProcessGroupWeights(timeout_s=20), run_dir=tmp_path, trainer_id="a")
        plan = pub.prepare(specs_from_tensors(named), version=3, engine_world_size=1)
        assert service.prepare_weight_sync(PrepareRequest(version=3)) == PrepareResult(ready=True, engine_ranks=1)
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(service.receive_weights, ReceiveRequest(plan=plan, rank_offset=1))
            pub.publish(plan, named)
            result = received.result(timeout=30)
        service.resume()
        assert result.version == 3 and result.bytes_received == plan.total_bytes and result.checksums == {}
        second = service.generate(
            GenerateRequest(rollout_id=2, prompts=(PromptInput(text="1 2 =", label="2", group_id=8),), stream=stream)
        )
        batch = buffer.read([second.entry_id], timeout_s=10)[0].batch
        assert second.weight_version == 3 and batch.sample_versions.tolist() == [3, 3]
        assert len(server.weights()) == len(named)
        pub.close()
    finally:
        service.close()
        server.stop()

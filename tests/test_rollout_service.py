"""RolloutService in-process against a real redis-server: batches, rewards, metrics, validation, Evaluate."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from services.buffer.stream import RolloutBuffer, connect
from services.contracts.config_loading import config_from_dict
from services.contracts.rollout_calls import EvaluateRequest, GenerateRequest, PrepareRequest, ReceiveRequest
from services.contracts.sampling_spec import SamplingSpec
from services.modelinit.init_model import init_model
from services.rollout.builder import build_rollout
from services.rollout.engines.interface import SampleOutput
from services.rollout.engines.native.engine import NativeEngine
from services.rollout.metrics import pass_at_k, version_metrics
from services.rollout.rewards import RewardSpecError, digit_task
from services.rollout.service import PromptInput, RolloutService

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, redis_server) -> Iterator[RolloutService]:
    model = init_model(tmp_path_factory.mktemp("m") / "tiny", preset="tiny", seed=0)
    config = config_from_dict(
        {
            "run_name": "svc-test",
            "model": {"path": str(model)},
            "data": {"train_path": "unused.jsonl"},
            "rollout": {
                "device": "cpu",
                "n_samples_per_prompt": 4,
                "reward": "digit_task",
                "sampling": {"temperature": 1.0, "max_new_tokens": 3, "seed": 7},
            },
            "redis": {"url": redis_server.url},
        }
    )
    svc = RolloutService(build_rollout(config, replica=0))
    yield svc
    svc.close()


def prompts(n: int = 3, start_group: int = 0) -> list[PromptInput]:
    return [
        PromptInput(
            text=f"{i % 10} {(i * 3) % 10} =",
            label=str(max(i % 10, (i * 3) % 10)),
            group_id=start_group + i,
            metadata={"i": str(i)},
        )
        for i in range(n)
    ]


def consume(url: str, stream: str, entry_id: str):
    buf = RolloutBuffer(connect(url), stream, groups=("actor",), group="actor", consumer="actor-0")
    entry = buf.read([entry_id], timeout_s=10)[0]
    buf.ack([entry_id])
    return entry


def test_generate_writes_one_decodable_batch(service: RolloutService, redis_server, stream: str):
    ps = prompts(3, start_group=100)
    result = service.generate(GenerateRequest(rollout_id=5, prompts=tuple(ps), stream=stream))
    assert result.num_samples == 12 and result.producer == "rollout-0" and result.weight_version == 0
    entry = consume(redis_server.url, stream, result.entry_id)
    batch = entry.batch
    assert (entry.rollout_id, entry.policy_version, batch.num_samples) == (5, 0, 12)
    assert batch.group_ids.tolist() == [100] * 4 + [101] * 4 + [102] * 4
    assert list(batch.labels) == [p.label for p in ps for _ in range(4)]
    assert batch.sample_versions.tolist() == [0] * 12 and batch.versions.tolist() == [0] * batch.num_response_tokens
    # the distribution the samples were drawn from travels with them (the trainer scores them under it)
    assert (batch.sampling_temperature.tolist(), batch.sampling_top_p.tolist(), batch.sampling_top_k.tolist()) == (
        [1.0] * 12,
        [1.0] * 12,
        [0] * 12,
    )
    assert batch.loss_mask.tolist() == [1] * batch.num_response_tokens
    assert batch.rollout_log_probs.shape == (batch.num_response_tokens,) and (batch.rollout_log_probs <= 0).all()
    assert result.num_response_tokens == batch.num_response_tokens
    assert result.num_prompt_tokens == int(batch.prompt_lengths.sum()) == 12 * 4  # "<s> a b =" is 4 tokens
    assert batch.metadata["reward"] == "digit_task" and batch.producer == "rollout-0"
    # The rewards are those of the decoded responses under the configured reward.
    for i, (p_sl, r_sl, _) in enumerate(batch.sample_slices()):
        assert service.texts.decode(batch.tokens[p_sl].tolist()) == ps[i // 4].text
        response = service.texts.decode(batch.tokens[r_sl].tolist())
        assert batch.rewards[i] == digit_task(ps[i // 4].text, response, ps[i // 4].label, {})
        assert batch.finish_reasons[i] in ("stop", "length")
    m = result.metrics
    assert m["reward_mean"] == pytest.approx(float(batch.rewards.mean()))
    assert m["response_len_mean"] == pytest.approx(batch.num_response_tokens / 12)
    assert m["finish_stop_frac"] + m["finish_length_frac"] == pytest.approx(1.0)
    assert 0.0 <= m["zero_std_group_frac"] <= 1.0 and m["tokens_per_s"] > 0
    assert (m["version_spread_mean"], m["version_spread_max"], m["inflight_token_frac"]) == (0.0, 0.0, 0.0)


def test_a_prompts_own_max_new_tokens_caps_its_samples(service: RolloutService, redis_server, stream: str):
    ps = [
        PromptInput(text="1 2 =", label="2", group_id=300, metadata={"max_new_tokens": "1"}),
        PromptInput(text="3 4 =", label="4", group_id=301),
    ]
    opts = SamplingSpec(max_new_tokens=5, ignore_eos=True, seed=3)
    result = service.generate(GenerateRequest(rollout_id=30, prompts=tuple(ps), sampling=opts.params(), stream=stream))
    lengths = consume(redis_server.url, stream, result.entry_id).batch.response_lengths.tolist()
    assert lengths == [1] * 4 + [5] * 4
    bad = [PromptInput(text="1 2 =", group_id=302, metadata={"max_new_tokens": "0"})]
    with pytest.raises(ValueError, match="prompt of group 302: max_new_tokens must be a whole number >= 1, got '0'"):
        service.generate(GenerateRequest(rollout_id=31, prompts=tuple(bad), stream=stream))


def test_version_metrics_measure_how_far_updates_reached_into_samples():
    outs = [
        SampleOutput(
            token_ids=(1, 2, 3, 4),
            log_probs=(0.0,) * 4,
            finish_reason="stop",
            weight_version=2,
            token_versions=(2, 2, 3, 4),
        ),
        SampleOutput(token_ids=(5, 6), log_probs=(0.0,) * 2, finish_reason="stop", weight_version=3),
        SampleOutput(token_ids=(), log_probs=(), finish_reason="length", weight_version=3),
    ]
    assert version_metrics(outs) == {
        "version_spread_mean": 1.0,
        "version_spread_max": 2.0,
        "inflight_token_frac": 2 / 6,
    }


def test_token_id_prompts_and_request_overrides(service: RolloutService, redis_server, stream: str):
    ids = service.texts.tokenizer("4 2 =")["input_ids"]
    result = service.generate(
        GenerateRequest(
            rollout_id=1,
            prompts=(PromptInput(token_ids=tuple(ids), label="4", group_id=9),),
            n_samples_per_prompt=2,
            sampling=SamplingSpec(temperature=0.0, max_new_tokens=2).params(),
            stream=stream,
            reward="exact_match",
        )
    )
    batch = consume(redis_server.url, stream, result.entry_id).batch
    assert batch.num_samples == 2 and batch.metadata["reward"] == "exact_match"
    assert batch.sampling_temperature.tolist() == [0.0, 0.0]  # the request's sampling, not the config's
    assert batch.tokens[: len(ids)].tolist() == ids
    first, second = batch.sample_slices()
    assert batch.tokens[first[1]].tolist() == batch.tokens[second[1]].tolist()  # greedy: identical


def test_stop_strings_reach_the_batch(service: RolloutService, redis_server, stream: str):
    """A request's stop string ends the sample at the token that completes it; the batch holds the tokens and
    log-probs as generated up to there, every one of them trained on, and finish reason stop."""
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    prompt = [PromptInput(text="3 1 =", label="3", group_id=40)]

    def one(rollout_id: int, sampling: SamplingSpec):
        result = service.generate(
            GenerateRequest(
                rollout_id=rollout_id,
                prompts=tuple(prompt),
                n_samples_per_prompt=1,
                sampling=sampling.params(),
                stream=stream,
            )
        )
        batch = consume(redis_server.url, stream, result.entry_id).batch
        return batch, batch.tokens[batch.sample_slices()[0][1]].tolist()

    free, response = one(20, greedy)
    stop = service.texts.decode_raw([response[2:4]])[0]
    cut = next(p for p in range(len(response)) if stop in service.texts.decode_raw([response[: p + 1]])[0])
    batch, tokens = one(21, replace(greedy, stop=(stop,)))
    assert tokens == response[: cut + 1] and batch.finish_reasons == ("stop",) and cut < 7
    assert batch.loss_mask.tolist() == [1] * (cut + 1)
    assert batch.rollout_log_probs.tolist() == pytest.approx(free.rollout_log_probs[: cut + 1].tolist(), abs=1e-5)
    assert service.texts.decode_raw([tokens])[0].endswith(stop)  # one-character tokens: nothing after it


def test_seeded_steps_differ_but_replay_exactly(service: RolloutService, redis_server, stream: str):
    a = consume(
        redis_server.url,
        stream,
        service.generate(GenerateRequest(rollout_id=2, prompts=tuple(prompts(4)), stream=stream)).entry_id,
    )
    b = consume(
        redis_server.url,
        stream,
        service.generate(GenerateRequest(rollout_id=3, prompts=tuple(prompts(4)), stream=stream)).entry_id,
    )
    assert a.batch.tokens.tolist() != b.batch.tokens.tolist()  # config seed is mixed with the rollout id
    again = consume(
        redis_server.url,
        stream + "x",
        service.generate(GenerateRequest(rollout_id=2, prompts=tuple(prompts(4)), stream=stream + "x")).entry_id,
    )
    assert again.batch.tokens.tolist() == a.batch.tokens.tolist()


def test_a_retried_generate_returns_the_recorded_entry(service: RolloutService, redis_client, stream: str):
    first = service.generate(GenerateRequest(rollout_id=11, prompts=tuple(prompts(2)), stream=stream))
    retry = service.generate(GenerateRequest(rollout_id=11, prompts=tuple(prompts(2)), stream=stream))
    assert retry == first and redis_client.xlen(stream) == 1


@pytest.mark.parametrize(
    "bad,fragment",
    [
        ([], "no prompts given"),
        ([PromptInput(text="", group_id=0)], "prompt 0 .* is empty"),
        (
            [PromptInput(text="1 2 =", group_id=0), PromptInput(text="1 " * 200, group_id=1)],
            "prompt 1 has 201 tokens; the model's context holds 128",
        ),
        ([PromptInput(text="1 =", group_id=3), PromptInput(text="2 =", group_id=3)], "share group_id 3"),
    ],
)
def test_bad_requests_are_value_errors(service: RolloutService, stream: str, bad, fragment: str):
    with pytest.raises(ValueError, match=fragment):
        service.generate(GenerateRequest(rollout_id=0, prompts=bad, stream=stream))


def test_unknown_reward_per_request(service: RolloutService, stream: str, redis_client):
    with pytest.raises(RewardSpecError, match="no_such_module_q"):
        service.generate(
            GenerateRequest(rollout_id=0, prompts=tuple(prompts(1)), stream=stream, reward="no_such_module_q:fn")
        )
    assert redis_client.xlen(stream) == 0


def test_unknown_reward_in_config_fails_construction(service: RolloutService):
    config = service.config.model_copy(
        update={"rollout": service.config.rollout.model_copy(update={"reward": "nowhere.mod:score"})}
    )
    with pytest.raises(RewardSpecError, match="module 'nowhere' not found"):
        build_rollout(config, engine=service.engine, tokenizer=service.texts.tokenizer)


def test_evaluate_greedy_and_pass_at_k(service: RolloutService, redis_client):
    ps = prompts(10)
    keys_before = set(redis_client.keys("*"))
    greedy = service.evaluate(
        EvaluateRequest(
            name="digits", prompts=tuple(ps), sampling=SamplingSpec(temperature=0.0, max_new_tokens=2).params()
        )
    )
    m = greedy.metrics
    assert m["digits/num_prompts"] == 10 and m["digits/num_samples"] == 10
    assert m["digits/pass@1"] == pytest.approx(m["digits/reward_mean"])  # binary reward, one sample
    sampled = service.evaluate(
        EvaluateRequest(
            name="s",
            prompts=tuple(ps),
            n_samples_per_prompt=4,
            sampling=SamplingSpec(temperature=1.0, max_new_tokens=2, seed=3).params(),
        )
    )
    m = sampled.metrics
    assert {"s/pass@1", "s/pass@2", "s/pass@4", "s/reward_mean", "s/response_len_mean"} <= set(m)
    assert m["s/pass@1"] <= m["s/pass@2"] <= m["s/pass@4"] and m["s/num_samples"] == 40
    assert m["s/pass@1"] == pytest.approx(m["s/reward_mean"])
    assert sampled.weight_version == 0 and sampled.time_s > 0
    assert set(redis_client.keys("*")) == keys_before  # evaluation writes nothing
    with pytest.raises(ValueError, match="no prompts"):
        service.evaluate(EvaluateRequest(prompts=()))


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 3, 2) == 1.0
    assert np.isclose(pass_at_k(10, 3, 5), 1 - (7 * 6 * 5 * 4 * 3) / (10 * 9 * 8 * 7 * 6))


def test_state_pause_and_weight_version(service: RolloutService, redis_server, stream: str):
    engine = service.engine
    assert isinstance(engine, NativeEngine)
    service.prepare_weight_sync(PrepareRequest(version=1, pause_mode="drain"))
    assert service.get_state().engine.paused
    params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.update_weights_from_tensors(params.items(), version=1)
    service.resume()
    result = service.generate(GenerateRequest(rollout_id=20, prompts=tuple(prompts(1)), stream=stream))
    assert result.weight_version == 1
    assert consume(redis_server.url, stream, result.entry_id).batch.sample_versions.tolist() == [1] * 4
    state = service.get_state()
    assert not state.engine.paused and state.engine.weight_version == 1 and state.producer == "rollout-0"
    assert state.engine.generated_samples > 0


def test_receive_weights_through_the_weight_receiver(service: RolloutService, tmp_path: Path):
    """The documented path: trainer-side WeightPublisher (disk transport) -> RolloutService.receive_weights ->
    WeightReceiver copying in place into the engine's parameters, then the engine serves the new version."""
    weights = pytest.importorskip("services.weights")
    from transformers import AutoModelForCausalLM

    from services.contracts.config import DiskWeights

    other = init_model(tmp_path / "other", preset="tiny", seed=5)
    policy = AutoModelForCausalLM.from_pretrained(other).eval()
    named = [(n, p.detach()) for n, p in policy.named_parameters()]
    receiver_side = RolloutService(build_rollout(service.config, replica=1))
    assert isinstance(receiver_side.engine, NativeEngine)
    ptrs = {n: p.data_ptr() for n, p in receiver_side.engine.model.named_parameters()}
    publisher = weights.WeightPublisher(
        config=DiskWeights(disk_dir=str(tmp_path / "w")), run_dir=tmp_path, trainer_id="actor-0"
    )
    plan = publisher.prepare(weights.specs_from_tensors(named), version=7, engine_world_size=1, verify=True)
    publisher.publish(plan, named)
    result = receiver_side.receive_weights(ReceiveRequest(plan=plan, rank_offset=1))
    assert result.version == 7 and receiver_side.get_state().engine.weight_version == 7
    assert result.bytes_received == plan.total_bytes
    assert result.checksums == {n: weights.tensor_checksum(t) for n, t in named}
    assert {n: p.data_ptr() for n, p in receiver_side.engine.model.named_parameters()} == ptrs  # in place
    ids = receiver_side.texts.tokenizer("3 8 =")["input_ids"]
    out = receiver_side.engine.generate([ids], SamplingSpec(temperature=0.0, max_new_tokens=4))[0]
    ref = policy.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=4)[0, len(ids) :].tolist()
    assert list(out.token_ids) == ref[: len(out.token_ids)] and out.weight_version == 7
    publisher.close()
    receiver_side.close()

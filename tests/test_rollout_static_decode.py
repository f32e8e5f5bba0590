"""The static-shape decode path (static_decode.py) on CPU, without CUDA graphs: its prefill/decode logits
match the model's own forward, and the engine's decode="static" returns log-probs of a teacher-forced
forward, greedy tokens of the dynamic path, stops at EOS and stop tokens, and reuses its cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.contracts.sampling import SamplingSpec
from services.rollout.engines.native import NativeEngine
from services.rollout.engines.sampling import sampling_log_probs
from services.rollout.engines.static_decode import StaticDecoder
from services.rollout.model_init import init_model

torch.set_num_threads(1)

PROMPTS = [[1, 7, 11, 18], [1, 3, 18], [1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 18]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("m") / request.param, preset="tiny", arch=request.param, seed=0)


def test_static_decode_logits_match_full_forward(model_dir: Path):
    engine = NativeEngine(model_dir, device="cpu", decode="static")
    model = engine.model
    prompt, extra = PROMPTS[2], [5, 6, 7]
    decoder = StaticDecoder(model)
    kv = decoder.new_cache(2, 32)
    ids = torch.tensor([prompt, [0] * 3 + prompt[3:]])            # row 1 left-padded by 3
    mask = torch.tensor([[1] * len(prompt), [0] * 3 + [1] * (len(prompt) - 3)])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = [decoder.prefill(kv, ids, positions, mask)]
        pos = positions[:, -1] + 1
        for i, tok in enumerate(extra):
            got.append(decoder.decode(kv, torch.tensor([tok, tok]), pos, torch.tensor([len(prompt) + i])))
            pos = pos + 1
        for row, seq in enumerate([prompt, prompt[3:]]):
            ref = model(torch.tensor([seq + extra])).logits[0, len(seq) - 1:]
            worst = max(float((g[row] - r).abs().max()) for g, r in zip(got, ref, strict=True))
            assert worst < 1e-4, (row, worst)


@pytest.mark.parametrize("opts", [SamplingSpec(temperature=0.8, top_p=0.9, max_new_tokens=10, seed=3),
                                  SamplingSpec(temperature=0.7, max_new_tokens=10, seed=4)],
                         ids=["top_p", "plain"])       # plain: the race runs on the logits (no log-prob tensor)
def test_static_engine_log_probs_greedy_and_stops(model_dir: Path, opts: SamplingSpec):
    static = NativeEngine(model_dir, device="cpu", decode="static")
    dynamic = NativeEngine(model_dir, device="cpu", decode="dynamic")
    prompts = PROMPTS * 2
    outs = static.generate(prompts, opts)
    assert outs == static.generate(prompts, opts)                  # seeded: same samples, cache reused
    assert len(static._runners) == 1
    with torch.no_grad():
        for prompt, o in zip(prompts, outs, strict=True):
            ids = torch.tensor([prompt + list(o.token_ids)])
            logits = static.model(ids).logits[0, len(prompt) - 1:-1]
            ref = sampling_log_probs(logits, opts).gather(-1, torch.tensor(o.token_ids)[:, None]).squeeze(-1)
            assert torch.allclose(ref, torch.tensor(o.log_probs), atol=1e-4)
            assert (o.finish_reason == "stop") == (o.token_ids[-1] in static.eos_token_ids)
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=8)
    for a, b in zip(static.generate(PROMPTS, greedy), dynamic.generate(PROMPTS, greedy), strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) < 1e-4
    stop = outs[0].token_ids[0]
    stopped = static.generate(PROMPTS[:1], SamplingSpec(temperature=opts.temperature, top_p=opts.top_p,
                                                          max_new_tokens=10, seed=opts.seed, stop_token_ids=(stop,)))
    assert stopped[0].token_ids == (stop,) and stopped[0].finish_reason == "stop"


def test_flatten_parameters_keeps_values_and_outputs(model_dir: Path):
    from services.weights.layout import plan_layout, specs_from_tensors

    engine = NativeEngine(model_dir, device="cpu", decode="static")
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=6)
    before = engine.generate(PROMPTS, greedy)
    values = {n: p.detach().clone() for n, p in engine.named_parameters().items()}
    layout = plan_layout(specs_from_tensors(engine.model.named_parameters()), bucket_bytes=16 * 1024)
    assert engine.flatten_parameters(layout) == len(layout.order)
    assert engine.flatten_parameters(layout) == 0                  # same layout: nothing to do
    storages = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    assert len(storages) == 1
    assert all(torch.equal(values[n], p) for n, p in engine.named_parameters().items())
    assert engine.generate(PROMPTS, greedy) == before

"""The static-shape decode path (static_decode.py) on CPU, without CUDA graphs: its prefill/decode logits
match the model's own forward, and the engine's decode="static" returns log-probs of a teacher-forced
forward, greedy tokens of the dynamic path, stops at EOS and stop tokens, and reuses its cache."""

from __future__ import annotations

import gc
import re
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from services.contracts.sampling_spec import SamplingSpec
from services.modelinit.init_model import init_model
from services.rollout.engines.native.engine import NativeEngine
from services.rollout.engines.native.sampler import sampling_log_probs
from services.rollout.engines.native.static_decode import StaticDecoder

torch.set_num_threads(1)

PROMPTS = [[1, 7, 11, 18], [1, 3, 18], [1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 18]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("m") / request.param, preset="tiny", arch=request.param, seed=0)


def assert_static_matches_forward(model, prompt: list[int], extra: list[int], *, offset: int = 0) -> None:
    """Prefill + decode through StaticDecoder give the logits of the model's own forward, for a row and a copy of it
    left-padded by 3 (rotary positions start at `offset`)."""
    decoder = StaticDecoder(model)
    kv = decoder.new_cache(2, 32)
    ids = torch.tensor([prompt, [0] * 3 + prompt[3:]])  # row 1 left-padded by 3
    mask = torch.tensor([[1] * len(prompt), [0] * 3 + [1] * (len(prompt) - 3)])
    positions = (mask.cumsum(-1) - 1).clamp(min=0) + offset
    with torch.no_grad():
        got = [decoder.prefill(kv, ids, positions, mask)]
        pos = positions[:, -1] + 1
        for i, tok in enumerate(extra):
            got.append(decoder.decode(kv, torch.tensor([tok, tok]), pos, torch.tensor([len(prompt) + i] * 2)))
            pos = pos + 1
        for row, seq in enumerate([prompt, prompt[3:]]):
            full = torch.tensor([seq + extra])
            ref = model(full, position_ids=torch.arange(full.shape[1])[None] + offset).logits[0, len(seq) - 1 :]
            worst = max(float((g[row] - r).abs().max()) for g, r in zip(got, ref, strict=True))
            assert worst < 1e-4, (row, worst)


def test_static_decode_logits_match_full_forward(model_dir: Path):
    engine = NativeEngine(model_dir, device="cpu", decode="static")
    assert_static_matches_forward(engine.model, PROMPTS[2], [5, 6, 7])


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "qwen3-0.6b", "llama3.2-1b"])
def test_static_decode_runs_the_real_architectures(preset: str):
    """The real presets over a tiny body (their vocabulary, rope and its scaling, Qwen3's q/k norms, tying, head
    size): the static path is chosen for them and its logits match the model's forward, far into the context too,
    where Llama-3's rope scaling changes the low frequencies."""
    from transformers import AutoModelForCausalLM

    from services.modelinit.init_model import build_family_config
    from services.rollout.engines.native.static_decode import supported

    config = build_family_config(preset, body="tiny", dtype="float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert supported(model) is None
    if preset == "llama3.2-1b":
        rotary, head_dim = model.model.rotary_emb, config.head_dim
        plain = 1.0 / (500_000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        assert torch.allclose(rotary.inv_freq[:8], plain[:8])  # high frequencies kept
        assert torch.allclose(rotary.inv_freq[-4:], plain[-4:] / 32.0)  # low ones divided by the factor
    prompt = [151_000 % config.vocab_size, 17, 2048, 99_999, 5, 6, 7, 8]
    for offset in (0, 20_000):
        assert_static_matches_forward(model, prompt, [42, 4242, 1], offset=offset)


def test_static_decode_refuses_other_architectures_by_name():
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    from services.rollout.engines.native.static_decode import supported

    small: dict[str, Any] = dict(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    cases = [
        (
            GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2),
            "model type 'gpt2' (static decode knows llama, qwen2, qwen3)",
        ),
        (Qwen2Config(**small, use_sliding_window=True, sliding_window=8, max_window_layers=1), "sliding-window layers"),
        (
            LlamaConfig(**small, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0}),
            "rope type 'dynamic' (its frequencies follow the sequence length)",
        ),
    ]
    for config, why in cases:
        model = AutoModelForCausalLM.from_config(config)
        assert supported(model) == why
        with pytest.raises(ValueError, match=re.escape(f"static decode does not support {why}")):
            StaticDecoder(model)


@pytest.mark.parametrize(
    "opts",
    [
        SamplingSpec(temperature=0.8, top_p=0.9, max_new_tokens=10, seed=3),
        SamplingSpec(temperature=0.7, max_new_tokens=10, seed=4),
    ],
    ids=["top_p", "plain"],
)  # plain: the race runs on the logits (no log-prob tensor)
def test_static_engine_log_probs_greedy_and_stops(model_dir: Path, opts: SamplingSpec):
    static = NativeEngine(model_dir, device="cpu", decode="static")
    dynamic = NativeEngine(model_dir, device="cpu", decode="dynamic")
    prompts = PROMPTS * 2
    outs = static.generate(prompts, opts)
    assert outs == static.generate(prompts, opts)  # seeded: same samples, cache reused
    assert static._runners is not None and len(static._runners) == 1
    with torch.no_grad():
        for prompt, o in zip(prompts, outs, strict=True):
            ids = torch.tensor([prompt + list(o.token_ids)])
            logits = static.model(ids).logits[0, len(prompt) - 1 : -1]
            ref = sampling_log_probs(logits, opts).gather(-1, torch.tensor(o.token_ids)[:, None]).squeeze(-1)
            assert torch.allclose(ref, torch.tensor(o.log_probs), atol=1e-4)
            assert (o.finish_reason == "stop") == (o.token_ids[-1] in static.eos_token_ids)
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=8)
    for a, b in zip(static.generate(PROMPTS, greedy), dynamic.generate(PROMPTS, greedy), strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) < 1e-4
    stop = outs[0].token_ids[0]
    stopped = static.generate(
        PROMPTS[:1],
        SamplingSpec(
            temperature=opts.temperature, top_p=opts.top_p, max_new_tokens=10, seed=opts.seed, stop_token_ids=(stop,)
        ),
    )
    assert stopped[0].token_ids == (stop,) and stopped[0].finish_reason == "stop"


def test_static_steps_attend_over_windows_that_grow_with_the_tokens(model_dir: Path):
    """90 new tokens in a 128-slot cache: the steps run over views of its first 32, 64, 96 and 128 slots (as far as
    the rows have written), and the samples are the dynamic path's, token for token."""
    static = NativeEngine(model_dir, device="cpu", decode="static")
    dynamic = NativeEngine(model_dir, device="cpu", decode="dynamic")
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=90, ignore_eos=True)
    got, want = static.generate(PROMPTS, greedy), dynamic.generate(PROMPTS, greedy)
    assert static._runners is not None and len(static._runners) == 1
    (runner,) = static._runners._runners.values()
    assert runner.length == 128 and sorted(slots for _, slots in runner.views) == [32, 64, 96]  # 128: the cache
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 90
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) < 1e-4
    # dropping the runners frees the cache at once, views and all (a reference cycle would hold a GPU's cache and
    # captured weights until the garbage collector ran: release_memory would free nothing)
    gone = weakref.ref(runner)
    del runner
    gc.disable()
    try:
        static._drop_runners()
        assert gone() is None
    finally:
        gc.enable()


def test_a_view_that_cannot_be_made_steps_the_whole_cache(model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """A view whose capture fails (here: making its cache view raises) is logged once and the step runs over the
    whole cache: the same samples, and no view kept (so nothing refers back to the runner)."""
    from services.rollout.engines.native import static_decode

    def broken(self, rows: int, slots: int):
        raise RuntimeError("no view")

    monkeypatch.setattr(static_decode.StaticKV, "window", broken)
    static = NativeEngine(model_dir, device="cpu", decode="static")
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    got = static.generate(PROMPTS, greedy)
    assert static._runners is not None
    (runner,) = static._runners._runners.values()
    assert runner.views == {} and runner._no_view == {(runner.batch, 32), (runner.batch, 64)}  # 51 slots reached
    want = NativeEngine(model_dir, device="cpu", decode="dynamic").generate(PROMPTS, greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_flatten_parameters_keeps_values_and_outputs(model_dir: Path):
    from services.weights.layout import plan_layout, specs_from_tensors

    engine = NativeEngine(model_dir, device="cpu", decode="static")
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=6)
    before = engine.generate(PROMPTS, greedy)
    values = {n: p.detach().clone() for n, p in engine.named_parameters().items()}
    layout = plan_layout(specs_from_tensors(engine.model.named_parameters()), bucket_bytes=16 * 1024)
    assert engine.flatten_parameters(layout) == len(layout.order)
    assert engine.flatten_parameters(layout) == 0  # same layout: nothing to do
    storages = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    assert len(storages) == 1
    assert all(torch.equal(values[n], p) for n, p in engine.named_parameters().items())
    assert engine.generate(PROMPTS, greedy) == before

"""Continuous batching in the native engine (rollout.continuous_batching) on a tiny random-init model (CPU): the
samples of concurrent calls decode as one batch, rows pass from finished samples to waiting ones, and every sample
is still exactly what the model computes for it alone (greedy tokens and log-probs of a teacher-forced forward).
Every test runs on both row stores (row_kv.py): the dynamic path's DynamicCache and the static cache ("static": the
graph path's decode step, eager on a CPU; tests/test_rollout_gpu.py replays it as a CUDA graph)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from test_rollout_engine import LOGPROB_ATOL
from test_rollout_engine import PROMPTS as SHORT

from services.contracts.sampling_spec import SamplingSpec
from services.rollout.engines.native.engine import NativeEngine
from services.rollout.engines.native.sampler import sampling_log_probs


@pytest.fixture(params=["dynamic", "static"])
def decode(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def hf(model_dirs: tuple[Path, Path]):
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(d).eval() for d in model_dirs]


def teacher_forced(model, prompt: list[int], response: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt + list(response)])).logits[0, len(prompt) - 1 : -1]


def assert_model_output(
    model, prompt: list[int], out, opts: SamplingSpec, *, start: int = 0, end: int | None = None
) -> None:
    """Tokens start..end of `out` are `model`'s: its greedy choices (at T = 0) and its log-probs."""
    logits = teacher_forced(model, prompt, out.token_ids)[start:end]
    tokens = torch.tensor(out.token_ids[start:end])
    expected = sampling_log_probs(logits, opts).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(expected, torch.tensor(out.log_probs[start:end]), atol=LOGPROB_ATOL)
    if opts.greedy:
        assert logits.argmax(-1).tolist() == tokens.tolist()


def assert_model_samples(model, prompts: list[list[int]], outs, opts: SamplingSpec, *, length: int) -> None:
    """Every sample has `length` tokens and is `model`'s own (assert_model_output)."""
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) == length
        assert_model_output(model, prompt, out, opts)


def in_thread(engine: NativeEngine, prompts: list[list[int]], opts: SamplingSpec, finished: list[str], name: str):
    result: list = []

    def work() -> None:
        result.append(engine.generate(prompts, opts))
        finished.append(name)

    thread = threading.Thread(target=work)
    thread.start()
    return thread, result


def wait_in_flight(engine: NativeEngine, calls: int) -> None:
    deadline = time.monotonic() + 10
    while engine.get_state().in_flight < calls and time.monotonic() < deadline:
        time.sleep(0.001)


Call = tuple[str, list[list[int]], SamplingSpec]


def joined_call(engine: NativeEngine, first: Call, second: Call) -> tuple[list[str], list, list]:
    """`first` starts; once it is in flight `second` joins it; both run to the end. The calls' names in the order
    they finished, and each call's outputs (a list holding them once the call returned)."""
    finished: list[str] = []
    (name_a, prompts_a, opts_a), (name_b, prompts_b, opts_b) = first, second
    thread_a, out_a = in_thread(engine, prompts_a, opts_a, finished, name_a)
    wait_in_flight(engine, 1)
    thread_b, out_b = in_thread(engine, prompts_b, opts_b, finished, name_b)
    thread_a.join(30)
    thread_b.join(30)
    return finished, out_a, out_b


def test_rows_of_finished_samples_go_to_waiting_ones_and_a_short_call_returns_first(decode, model_dirs, hf):
    """8 rows: a call of 4 long samples starts, then a call of 12 short ones; the short ones pass through the other
    4 rows in waves while the long ones run, so the short call returns first. Every sample (prompts of different
    lengths joined at different steps) is the model's own greedy continuation."""
    engine = NativeEngine(model_dirs[0], device="cpu", decode=decode, continuous_batching=True, max_batch_size=8)
    long_opts = SamplingSpec(temperature=0.0, max_new_tokens=90, ignore_eos=True)
    short_opts = SamplingSpec(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    finished, long_out, short_out = joined_call(engine, ("long", SHORT, long_opts), ("short", SHORT * 3, short_opts))
    assert finished == ["short", "long"]
    assert engine._batcher is not None and engine._batcher.peak_rows == 8  # never more rows than max_batch_size
    for prompt, out in zip(SHORT, long_out[0], strict=True):
        assert len(out.token_ids) == 90 and out.finish_reason == "length"
        assert_model_output(hf[0], prompt, out, long_opts)
    assert_model_samples(hf[0], SHORT * 3, short_out[0], short_opts, length=4)


def test_sampled_tokens_carry_the_log_probs_of_their_distribution_and_other_distributions_wait(decode, model_dirs, hf):
    """A call sampling at T = 0.8 / top-p 0.9 shares the batch with calls of its distribution; a greedy call waits
    until that batch is done and then decodes on its own."""
    engine = NativeEngine(model_dirs[0], device="cpu", decode=decode, continuous_batching=True, max_batch_size=16)
    sampled = SamplingSpec(temperature=0.8, top_p=0.9, max_new_tokens=30, seed=3)
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    finished: list[str] = []
    first, out_a = in_thread(engine, SHORT * 2, sampled, finished, "a")
    wait_in_flight(engine, 1)
    second, out_g = in_thread(engine, SHORT, greedy, finished, "greedy")
    third, out_b = in_thread(engine, SHORT, sampled, finished, "b")
    for t in (first, second, third):
        t.join(30)
    for prompt, out in zip(SHORT * 2 + SHORT, out_a[0] + out_b[0], strict=True):
        assert_model_output(hf[0], prompt, out, sampled)
    for prompt, out in zip(SHORT, out_g[0], strict=True):
        assert_model_output(hf[0], prompt, out, greedy)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_weight_update_lands_in_the_shared_batch(decode, model_dirs, hf, mode: str):
    """rollout.inflight_update with continuous batching: the update lands between two steps of the shared batch;
    each token carries the version that sampled it, and after retract every row's rest is model B's continuation."""
    from safetensors.torch import load_file

    engine = NativeEngine(model_dirs[0], device="cpu", decode=decode, continuous_batching=True, max_batch_size=8)
    opts = SamplingSpec(temperature=0.0, max_new_tokens=70, ignore_eos=True)
    finished: list[str] = []
    calls = [in_thread(engine, SHORT, opts, finished, "a")]
    wait_in_flight(engine, 1)
    calls.append(in_thread(engine, SHORT * 2, opts, finished, "b"))
    wait_in_flight(engine, 2)
    engine.pause(mode, timeout_s=30)
    engine.update_weights_from_tensors(load_file(str(model_dirs[1] / "model.safetensors")).items(), version=1)
    engine.resume()
    for thread, _ in calls:
        thread.join(30)
    outs = [o for _, result in calls for o in result[0]]
    switched = 0
    for prompt, out in zip(SHORT + SHORT * 2, outs, strict=True):
        k = out.token_versions.index(1) if 1 in out.token_versions else len(out.token_ids)
        assert out.token_versions == (0,) * k + (1,) * (70 - k)
        assert_model_output(hf[0], prompt, out, opts, end=k)
        if mode == "retract" and k < 70:
            assert_model_output(hf[1], prompt, out, opts, start=k)
        switched += k < 70
    assert switched >= 4  # the first call's samples, at least, were running when the update landed


def test_abort_ends_the_batch_and_the_waiting_samples_then_generation_goes_on(decode, model_dirs):
    engine = NativeEngine(model_dirs[0], device="cpu", decode=decode, continuous_batching=True, max_batch_size=4)
    opts = SamplingSpec(temperature=1.0, max_new_tokens=100, ignore_eos=True, seed=1)
    finished: list[str] = []
    thread, result = in_thread(engine, SHORT * 3, opts, finished, "a")  # 12 samples, 4 rows: 8 wait
    wait_in_flight(engine, 1)
    time.sleep(0.02)
    engine.pause("abort", timeout_s=30)
    thread.join(30)
    engine.resume()
    outs = result[0]
    assert all(o.finish_reason == "abort" for o in outs)
    assert sum(len(o.token_ids) == 0 for o in outs) >= 8 and sum(len(o.token_ids) > 0 for o in outs) >= 1
    again = engine.generate(SHORT, SamplingSpec(temperature=1.0, max_new_tokens=5, ignore_eos=True, seed=2))
    assert [len(o.token_ids) for o in again] == [5] * 4 and all(o.finish_reason == "length" for o in again)


def test_each_prompt_may_cap_its_own_new_tokens(decode, model_dirs):
    engine = NativeEngine(model_dirs[0], device="cpu", decode=decode, continuous_batching=True, max_batch_size=2)
    outs = engine.generate(SHORT, SamplingSpec(max_new_tokens=9, ignore_eos=True, seed=4), max_new_tokens=[3, 20, 1, 9])
    assert [len(o.token_ids) for o in outs] == [3, 9, 1, 9]


def test_a_call_the_engine_cannot_serve_leaves_nothing_behind(decode, model_dirs):
    from services.rollout.engines.engine_errors import EngineUnavailable

    engine = NativeEngine(model_dirs[0], device="cpu", decode=decode, continuous_batching=True)
    opts = SamplingSpec(max_new_tokens=3, ignore_eos=True, seed=1)
    engine.release_memory(("kv_cache",))
    with pytest.raises(EngineUnavailable, match="memory is released"):
        engine.generate(SHORT, opts)
    engine.resume_memory(("kv_cache",))
    assert engine._batcher is not None and not engine._batcher._queue  # its samples are not generated for nobody
    assert [len(o.token_ids) for o in engine.generate(SHORT[:2], opts)] == [3, 3]


def test_the_static_cache_grows_for_a_longer_sample_and_gives_every_row_back(tmp_path):
    """Static rows: a call whose samples need more slots joins a running batch (the cache grows from 128 to 256
    slots, the running rows' keys and values copied over); both stay the model's own; afterwards every row is free
    again. The `small` preset: the tiny one's 128 positions are one cache bucket."""
    from transformers import AutoModelForCausalLM

    from services.modelinit.init_model import init_model

    model_dir = init_model(tmp_path / "small", preset="small", seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    engine = NativeEngine(model_dir, device="cpu", decode="static", continuous_batching=True, max_batch_size=8)
    short_opts = SamplingSpec(temperature=0.0, max_new_tokens=60, ignore_eos=True)
    long_opts = SamplingSpec(temperature=0.0, max_new_tokens=200, ignore_eos=True)
    finished: list[str] = []
    first, short_out = in_thread(engine, SHORT, short_opts, finished, "short")
    wait_in_flight(engine, 1)
    store = engine._row_store
    assert store is not None
    deadline = time.monotonic() + 10
    while store.runner is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert store.runner is not None and store.runner.length == 128
    second, long_out = in_thread(engine, SHORT, long_opts, finished, "long")
    first.join(60)
    second.join(60)
    assert finished == ["short", "long"] and store.runner is not None and store.runner.length == 256
    assert_model_samples(model, SHORT, short_out[0], short_opts, length=60)
    assert_model_samples(model, SHORT, long_out[0], long_opts, length=200)
    assert sorted(store._free) == list(range(8))


def test_static_rows_are_prefilled_again_when_the_engine_drops_its_cache(model_dirs, hf):
    """Memory released and resumed while the batch is parked: the static cache is gone, so the rows are prefilled
    again into a new one, and every sample is still the model's own greedy continuation."""
    engine = NativeEngine(model_dirs[0], device="cpu", decode="static", continuous_batching=True, max_batch_size=8)
    opts = SamplingSpec(temperature=0.0, max_new_tokens=80, ignore_eos=True)
    finished: list[str] = []
    thread, result = in_thread(engine, SHORT * 2, opts, finished, "a")
    wait_in_flight(engine, 1)
    engine.pause("in_place", timeout_s=30)
    store = engine._row_store
    assert store is not None and store.runner is not None
    engine.release_memory(("kv_cache",))
    assert store.stale() and store.runner is not None  # the rows still hold it until they are prefilled again
    engine.resume_memory(("kv_cache",))
    engine.resume()
    thread.join(30)
    assert finished == ["a"] and not store.stale()
    assert_model_samples(hf[0], SHORT * 2, result[0], opts, length=80)


def test_a_static_cache_that_cannot_fit_is_refused_with_one_clear_message(model_dirs, monkeypatch):
    """The static cache's bytes are checked against the device's free memory before it is allocated (on a GPU;
    here the free memory is faked): the call fails with what to change, and the engine serves once it fits."""
    from services.rollout.engines.engine_errors import EngineUnavailable
    from services.rollout.engines.native import static_decode

    engine = NativeEngine(model_dirs[0], device="cpu", decode="static", continuous_batching=True, max_batch_size=8)
    opts = SamplingSpec(max_new_tokens=3, ignore_eos=True, seed=1)
    monkeypatch.setattr(static_decode, "free_device_bytes", lambda device: 1024)
    with pytest.raises(EngineUnavailable, match=r"static KV cache of 8 rows x 128 slots needs .* GiB is free on cpu: "):
        engine.generate(SHORT, opts)
    monkeypatch.undo()
    assert [len(o.token_ids) for o in engine.generate(SHORT, opts)] == [3] * 4


def test_a_static_step_computes_only_the_rows_in_use(model_dirs, hf):
    """32 rows, 4 samples: the step runs over the cache's first 8 rows; 12 more join and it runs over 16. Rows of a
    view are the cache's own (each sample stays the model's greedy continuation), no step ran over all 32, and
    steps attended over the slots their rows had reached: windows growing with them, never the whole cache."""
    engine = NativeEngine(model_dirs[0], device="cpu", decode="static", continuous_batching=True, max_batch_size=32)
    opts = SamplingSpec(temperature=0.0, max_new_tokens=60, ignore_eos=True)
    _, out_a, out_b = joined_call(engine, ("a", SHORT, opts), ("b", SHORT * 3, opts))
    store = engine._row_store
    assert store is not None and store.runner is not None
    views = store.runner.views
    assert sorted({rows for rows, _ in views}) == [8, 16]
    assert len({slots for _, slots in views}) > 1 and max(slots for _, slots in views) < store.runner.length
    cache = store.runner.kv.k[0].data_ptr()
    assert all(view.kv.k[0].data_ptr() == cache for view in views.values())  # views of the one cache
    assert_model_samples(hf[0], SHORT + SHORT * 3, out_a[0] + out_b[0], opts, length=60)

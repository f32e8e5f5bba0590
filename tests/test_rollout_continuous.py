"""Continuous batching in the native engine (rollout.continuous_batching) on a tiny random-init model (CPU): the
samples of concurrent calls decode as one batch, rows pass from finished samples to waiting ones, and every sample
is still exactly what the model computes for it alone (greedy tokens and log-probs of a teacher-forced forward)."""

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


def test_rows_of_finished_samples_go_to_waiting_ones_and_a_short_call_returns_first(model_dirs, hf):
    """8 rows: a call of 4 long samples starts, then a call of 12 short ones; the short ones pass through the other
    4 rows in waves while the long ones run, so the short call returns first. Every sample (prompts of different
    lengths joined at different steps) is the model's own greedy continuation."""
    engine = NativeEngine(model_dirs[0], device="cpu", continuous_batching=True, max_batch_size=8)
    long_opts = SamplingSpec(temperature=0.0, max_new_tokens=90, ignore_eos=True)
    short_opts = SamplingSpec(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    finished: list[str] = []
    long_thread, long_out = in_thread(engine, SHORT, long_opts, finished, "long")
    wait_in_flight(engine, 1)
    short_thread, short_out = in_thread(engine, SHORT * 3, short_opts, finished, "short")
    short_thread.join(30)
    long_thread.join(30)
    assert finished == ["short", "long"]
    assert engine._batcher is not None and engine._batcher.peak_rows == 8  # never more rows than max_batch_size
    for prompt, out in zip(SHORT, long_out[0], strict=True):
        assert len(out.token_ids) == 90 and out.finish_reason == "length"
        assert_model_output(hf[0], prompt, out, long_opts)
    for prompt, out in zip(SHORT * 3, short_out[0], strict=True):
        assert len(out.token_ids) == 4
        assert_model_output(hf[0], prompt, out, short_opts)


def test_sampled_tokens_carry_the_log_probs_of_their_distribution_and_other_distributions_wait(model_dirs, hf):
    """A call sampling at T = 0.8 / top-p 0.9 shares the batch with calls of its distribution; a greedy call waits
    until that batch is done and then decodes on its own."""
    engine = NativeEngine(model_dirs[0], device="cpu", continuous_batching=True, max_batch_size=16)
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
def test_a_weight_update_lands_in_the_shared_batch(model_dirs, hf, mode: str):
    """rollout.inflight_update with continuous batching: the update lands between two steps of the shared batch;
    each token carries the version that sampled it, and after retract every row's rest is model B's continuation."""
    from safetensors.torch import load_file

    engine = NativeEngine(model_dirs[0], device="cpu", continuous_batching=True, max_batch_size=8)
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


def test_abort_ends_the_batch_and_the_waiting_samples_then_generation_goes_on(model_dirs):
    engine = NativeEngine(model_dirs[0], device="cpu", continuous_batching=True, max_batch_size=4)
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


def test_each_prompt_may_cap_its_own_new_tokens(model_dirs):
    engine = NativeEngine(model_dirs[0], device="cpu", continuous_batching=True, max_batch_size=2)
    outs = engine.generate(SHORT, SamplingSpec(max_new_tokens=9, ignore_eos=True, seed=4), max_new_tokens=[3, 20, 1, 9])
    assert [len(o.token_ids) for o in outs] == [3, 9, 1, 9]


def test_a_call_the_engine_cannot_serve_leaves_nothing_behind(model_dirs):
    from services.rollout.engines.engine_errors import EngineUnavailable

    engine = NativeEngine(model_dirs[0], device="cpu", continuous_batching=True)
    opts = SamplingSpec(max_new_tokens=3, ignore_eos=True, seed=1)
    engine.release_memory(("kv_cache",))
    with pytest.raises(EngineUnavailable, match="memory is released"):
        engine.generate(SHORT, opts)
    engine.resume_memory(("kv_cache",))
    assert engine._batcher is not None and not engine._batcher._queue  # its samples are not generated for nobody
    assert [len(o.token_ids) for o in engine.generate(SHORT[:2], opts)] == [3, 3]


def test_continuous_batching_needs_the_dynamic_decode_path(model_dirs):
    with pytest.raises(ValueError, match="continuous batching runs on the dynamic decode path, not decode='static'"):
        NativeEngine(model_dirs[0], device="cpu", continuous_batching=True, decode="static")

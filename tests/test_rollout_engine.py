"""The native engine on a tiny random-init model (CPU): shapes, EOS / stop handling, log-prob agreement with
a teacher-forced forward pass, greedy parity with HF generate, seeding, in-place weight loads, pause modes,
memory release."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from services.contracts.sampling_spec import SamplingSpec
from services.rollout.engines.engine_errors import EngineUnavailable
from services.rollout.engines.native.engine import NativeEngine
from services.rollout.engines.native.sampler import draw, sampling_log_probs

torch.set_num_threads(1)

# Rollout log-probs and a teacher-forced forward pass run the same float32 weights through different
# kernels (KV-cached, left-padded decode vs one full forward), so they agree to rounding, not bitwise.
LOGPROB_ATOL = 1e-4

PROMPTS = [[1, 7, 11, 18], [1, 3, 18], [1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 18], [1, 9, 9, 18]]


@pytest.fixture(scope="module")
def engine(model_dirs: tuple[Path, Path]) -> NativeEngine:
    return NativeEngine(model_dirs[0], device="cpu")


@pytest.fixture(scope="module")
def hf_model(model_dirs: tuple[Path, Path]):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dirs[0]).eval()


def teacher_forced(model, prompt: list[int], response: tuple[int, ...], opts: SamplingSpec) -> torch.Tensor:
    ids = torch.tensor([prompt + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return sampling_log_probs(logits, opts).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_generation_shapes(engine: NativeEngine):
    opts = SamplingSpec(temperature=1.0, max_new_tokens=6, seed=1)
    outs = engine.generate(PROMPTS * 3, opts)
    assert len(outs) == len(PROMPTS) * 3
    for o in outs:
        assert 1 <= len(o.token_ids) <= 6 and len(o.log_probs) == len(o.token_ids)
        assert o.finish_reason in ("stop", "length") and o.weight_version == 0
        assert all(lp <= 0.0 and lp > -1e9 for lp in o.log_probs)
        assert all(0 <= t < engine.vocab_size for t in o.token_ids)
    assert engine.generate([], opts) == []


def _check_stop_semantics(outs, stop_ids: set[int], max_new: int) -> None:
    for o in outs:
        body = o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids
        assert not stop_ids & set(body), "generation continued past a stop token"
        if o.finish_reason == "stop":
            assert o.token_ids[-1] in stop_ids  # the stop token is kept (the policy must learn it)
        else:
            assert len(o.token_ids) == max_new


def test_eos_ends_a_sample_and_is_kept(engine: NativeEngine):
    eos = set(engine.eos_token_ids)
    outs = engine.generate([[1, 5, 18]] * 64, SamplingSpec(temperature=1.0, max_new_tokens=12, seed=3))
    _check_stop_semantics(outs, eos, 12)
    reasons = {o.finish_reason for o in outs}
    assert reasons == {"stop", "length"}, reasons  # fixed seed: both occur in 64 samples
    lengths = {len(o.token_ids) for o in outs if o.finish_reason == "stop"}
    assert len(lengths) > 1  # rows finish at different steps (compaction path)


def test_stop_tokens_and_ignore_eos(engine: NativeEngine):
    stop = {7, 8}  # the digits 3 and 4
    outs = engine.generate([[1, 5, 18]] * 64, SamplingSpec(max_new_tokens=12, stop_token_ids=tuple(stop), seed=4))
    _check_stop_semantics(outs, stop | set(engine.eos_token_ids), 12)
    assert any(o.finish_reason == "stop" and o.token_ids[-1] in stop for o in outs)
    outs = engine.generate([[1, 5, 18]] * 16, SamplingSpec(max_new_tokens=10, ignore_eos=True, seed=5))
    assert all(len(o.token_ids) == 10 and o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize(
    "opts",
    [
        SamplingSpec(temperature=1.0, max_new_tokens=10, seed=11),
        SamplingSpec(temperature=0.7, top_k=5, top_p=0.8, max_new_tokens=10, seed=12),
        SamplingSpec(temperature=1.3, top_p=0.95, max_new_tokens=10, seed=13),
        SamplingSpec(temperature=0.0, max_new_tokens=10),
    ],
    ids=["plain", "topk-topp", "hot-topp", "greedy"],
)
def test_log_probs_match_teacher_forced_forward(engine: NativeEngine, hf_model, opts: SamplingSpec):
    # Mixed prompt lengths exercise left padding; 8 samples per prompt exercise mid-decode compaction.
    prompts = [p for p in PROMPTS for _ in range(8)]
    outs = engine.generate(prompts, opts)
    worst = 0.0
    for prompt, o in zip(prompts, outs, strict=True):
        ref = teacher_forced(hf_model, prompt, o.token_ids, opts)
        worst = max(worst, float((ref - torch.tensor(o.log_probs)).abs().max()))
        if opts.temperature == 1.0 and opts.top_p == 1.0:  # independent of sampling_log_probs
            with torch.no_grad():
                raw = torch.log_softmax(hf_model(torch.tensor([prompt + list(o.token_ids)])).logits[0].float(), -1)
            plain = raw[len(prompt) - 1 : -1].gather(-1, torch.tensor(o.token_ids)[:, None]).squeeze(-1)
            assert torch.allclose(plain, torch.tensor(o.log_probs), atol=LOGPROB_ATOL)
    assert worst < LOGPROB_ATOL, f"max |rollout - teacher-forced| log-prob difference {worst:.2e}"


def test_greedy_matches_hf_generate(engine: NativeEngine, hf_model):
    outs = engine.generate(PROMPTS, SamplingSpec(temperature=0.0, max_new_tokens=12))
    for prompt, o in zip(PROMPTS, outs, strict=True):
        ref = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
        )[0, len(prompt) :].tolist()
        assert list(o.token_ids) == ref[: len(o.token_ids)]


def test_sampling_distribution_definition():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    lp = sampling_log_probs(logits, SamplingSpec(top_p=0.7)).exp()
    assert torch.allclose(lp, torch.tensor([[0.625, 0.375, 0.0]]), atol=1e-6)  # nucleus of mass >= 0.7
    lp = sampling_log_probs(logits, SamplingSpec(top_k=1))
    assert lp[0, 0] == 0.0 and torch.isinf(lp[0, 1:]).all()
    lp = sampling_log_probs(logits, SamplingSpec(temperature=0.5)).exp()
    expected = torch.tensor([0.25, 0.09, 0.04]) / 0.38  # p^(1/T), renormalised
    assert torch.allclose(lp[0], expected, atol=1e-6)
    assert torch.allclose(sampling_log_probs(logits, SamplingSpec(temperature=0.0)), torch.log_softmax(logits, -1))


def test_the_cpu_draw_follows_each_rows_distribution_and_never_draws_a_zero():
    """The inverse-CDF draw: 40,000 rows of two distributions (one unnormalised) land within 1.5 points of each
    probability (4 standard errors), a zero-probability token never comes, and a seed replays the draw."""
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 2.0, 1.0, 1.0]]).repeat(20_000, 1)
    tokens = draw(probs, torch.Generator().manual_seed(0))
    for row, expected in ((0, [0.5, 0.0, 0.3, 0.2]), (1, [0.0, 0.5, 0.25, 0.25])):
        freq = torch.bincount(tokens[row::2], minlength=4).double() / 20_000
        assert torch.allclose(freq, torch.tensor(expected, dtype=torch.float64), atol=0.015), (row, freq)
        assert freq[expected.index(0.0)] == 0.0
    assert torch.equal(tokens, draw(probs, torch.Generator().manual_seed(0)))


def test_seeded_sampling_is_reproducible(engine: NativeEngine):
    a = engine.generate(PROMPTS * 4, SamplingSpec(max_new_tokens=8, seed=42))
    b = engine.generate(PROMPTS * 4, SamplingSpec(max_new_tokens=8, seed=42))
    c = engine.generate(PROMPTS * 4, SamplingSpec(max_new_tokens=8, seed=43))
    assert a == b
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_unseeded_sampling_differs_between_processes(tmp_path):
    """seed None means nondeterministic: two fresh processes must not replay torch's fixed default stream."""
    import subprocess
    import sys

    script = (
        "import sys, torch; from services.rollout.engines.native.sampler import make_generator; "
        "print(torch.rand(8, generator=make_generator(None, torch.device('cpu'))).tolist())"
    )
    runs = {
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert len(runs) == 2


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_each_prompt_may_cap_its_own_new_tokens(model_dirs: tuple[Path, Path], decode: str):
    """A data row's max_new_tokens: caps below sampling.max_new_tokens stop each sample at its own length (the
    long-tailed lengths of issue 33's tasks), in one batch."""
    engine = NativeEngine(model_dirs[0], device="cpu", decode=decode)
    opts = SamplingSpec(max_new_tokens=9, ignore_eos=True, seed=4)
    outs = engine.generate(PROMPTS, opts, max_new_tokens=[3, 20, 1, 9])
    assert [len(o.token_ids) for o in outs] == [3, 9, 1, 9] and {o.finish_reason for o in outs} == {"length"}
    with pytest.raises(ValueError, match="max_new_tokens: expected 4 caps >= 1"):
        engine.generate(PROMPTS, opts, max_new_tokens=[3, 0, 1, 9])


def test_bad_prompts(engine: NativeEngine):
    opts = SamplingSpec(max_new_tokens=4)
    ctx = engine.max_context_length
    with pytest.raises(ValueError, match=f"prompt 1 has {ctx + 5} tokens; the model's context holds {ctx}"):
        engine.generate([[1, 5], [1] * (ctx + 5)], opts)
    with pytest.raises(ValueError, match="prompt 0 has no tokens"):
        engine.generate([[]], opts)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 10_000]], opts)
    with pytest.raises(ValueError, match="top_p"):
        SamplingSpec(top_p=1.5)


def test_context_limit_truncates_with_length(engine: NativeEngine):
    ctx = engine.max_context_length
    outs = engine.generate([[1] * (ctx - 3), [1, 5, 18]], SamplingSpec(max_new_tokens=10, ignore_eos=True, seed=1))
    assert len(outs[0].token_ids) == 3 and outs[0].finish_reason == "length"
    assert len(outs[1].token_ids) == 10


def test_in_place_weight_loads(model_dirs: tuple[Path, Path]):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    engine = NativeEngine(model_dirs[0], device="cpu")
    other = AutoModelForCausalLM.from_pretrained(model_dirs[1]).eval()
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    state = {k: v.clone() for k, v in other.state_dict().items()}
    names = list(state)
    # Two named buckets: the version changes only with the one that completes the update.
    engine.update_weights_from_tensors([(n, state[n]) for n in names[:5]])
    assert engine.weight_version == 0
    stats = engine.update_weights_from_tensors([(n, state[n]) for n in names[5:]], version=3)
    assert (engine.weight_version, stats.version, stats.tensors) == (3, 3, len(names) - 5)
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == ptrs  # copied in place
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=8)
    out = engine.generate(PROMPTS[:1], greedy)[0]
    ref = other.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=8)[0, len(PROMPTS[0]) :]
    assert list(out.token_ids) == ref.tolist()[: len(out.token_ids)] and out.weight_version == 3
    # Full state dict and disk.
    engine.load_state_dict(load_file(str(model_dirs[0] / "model.safetensors")), version=4)
    assert engine.generate(PROMPTS[:1], greedy)[0].token_ids != out.token_ids
    assert engine.update_weights_from_disk(model_dirs[1], version=5).version == 5
    assert engine.generate(PROMPTS[:1], greedy)[0].token_ids == out.token_ids
    with pytest.raises(KeyError, match="not a parameter"):
        engine.update_weights_from_tensors([("no.such.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="does not match"):
        engine.update_weights_from_tensors([(names[0], torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="lacks"):
        engine.load_state_dict({names[0]: state[names[0]]}, version=6)
    assert engine.weight_version == 5


def _start(
    engine: NativeEngine, opts: SamplingSpec, n: int = 128, wait_running: bool = True
) -> tuple[threading.Thread, list]:
    return _start_prompts(engine, [[1, 5, 18]] * n, opts, wait_running=wait_running)


def _start_prompts(
    engine: NativeEngine, prompts: list[list[int]], opts: SamplingSpec, *, wait_running: bool = True
) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(engine.generate(prompts, opts)))
    thread.start()
    deadline = time.monotonic() + 10
    while wait_running and engine.get_state().in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    return thread, result


LONG = SamplingSpec(max_new_tokens=120, ignore_eos=True, seed=9)


def test_pause_drain_waits_for_running_and_holds_new_calls(engine: NativeEngine):
    thread, result = _start(engine, LONG)
    engine.pause("drain", timeout_s=30)
    assert result and all(o.finish_reason == "length" and len(o.token_ids) == 120 for o in result[0])
    assert engine.get_state().paused
    with pytest.raises(EngineUnavailable, match="paused"):
        engine.generate([[1, 5, 18]], LONG, wait_timeout_s=0.05)
    waiting, later = _start(engine, SamplingSpec(max_new_tokens=2, seed=1), n=1, wait_running=False)
    time.sleep(0.05)
    assert waiting.is_alive() and not later
    engine.resume()
    waiting.join(10)
    thread.join(10)
    assert later and len(later[0]) == 1 and not engine.get_state().paused


def test_pause_abort_ends_running_samples(engine: NativeEngine):
    thread, result = _start(engine, LONG)
    engine.pause("abort", timeout_s=30)
    thread.join(10)
    engine.resume()
    outs = result[0]
    assert all(o.finish_reason == "abort" and len(o.token_ids) < 120 for o in outs)


def test_pause_in_place_parks_and_continues_after_a_weight_update(engine: NativeEngine):
    thread, result = _start(engine, LONG)
    engine.pause("in_place", timeout_s=30)
    time.sleep(0.05)
    assert thread.is_alive() and not result  # parked at a token boundary, KV cache kept
    params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.update_weights_from_tensors(params.items(), version=engine.weight_version + 1)  # allowed while parked
    engine.resume()
    thread.join(10)
    outs = result[0]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 120 for o in outs)
    assert outs[0].weight_version == engine.weight_version - 1  # the version generation started with
    # every token carries the version that sampled it: the old one up to where the call was parked, then the new
    old, new = engine.weight_version - 1, engine.weight_version
    switch = outs[0].token_versions.index(new)
    assert 0 < switch < 120
    assert all(o.token_versions == (old,) * switch + (new,) * (120 - switch) for o in outs)


def _teacher_forced_logits(model, prompt: list[int], response: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt + list(response)])).logits[0, len(prompt) - 1 : -1]


def _update_while_parked(
    engine: NativeEngine, mode: str, state: dict[str, torch.Tensor], *, version: int, while_parked=None
) -> list:
    """Greedy generation of PROMPTS x 8 with a weight update that lands between two decode steps."""
    thread, result = _start_prompts(
        engine, PROMPTS * 8, SamplingSpec(temperature=0.0, max_new_tokens=80, ignore_eos=True)
    )
    engine.pause(mode, timeout_s=30)
    if while_parked is not None:
        while_parked()
    engine.update_weights_from_tensors(state.items(), version=version)
    engine.resume()
    thread.join(30)
    return result[0]


@pytest.mark.parametrize("decode", ["dynamic", "static"])
@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_weight_update_lands_between_two_decode_steps(model_dirs: tuple[Path, Path], decode: str, mode: str):
    """rollout.inflight_update: the tokens before the update are model A's greedy choices, the ones after are sampled
    by model B and say so (token_versions). retract (recompute) refills the KV cache under B, so the rest is exactly
    B's continuation of the prompt and the tokens so far (B's teacher-forced argmax and log-probs); in_place (keep)
    goes on with A's KV cache, so B's log-probs of the later tokens differ from a fresh B forward."""
    from transformers import AutoModelForCausalLM

    engine = NativeEngine(model_dirs[0], device="cpu", decode=decode)
    a = AutoModelForCausalLM.from_pretrained(model_dirs[0]).eval()
    b = AutoModelForCausalLM.from_pretrained(model_dirs[1]).eval()
    outs = _update_while_parked(engine, mode, {k: v.clone() for k, v in b.state_dict().items()}, version=1)
    stale_kv = []
    for prompt, o in zip(PROMPTS * 8, outs, strict=True):
        switch = o.token_versions.index(1)
        assert 0 < switch < 80 and o.token_versions == (0,) * switch + (1,) * (80 - switch)
        before, after = _teacher_forced_logits(a, prompt, o.token_ids), _teacher_forced_logits(b, prompt, o.token_ids)
        lp_a, lp_b = before.log_softmax(-1), after.log_softmax(-1)
        tokens = torch.tensor(o.token_ids)
        assert before[:switch].argmax(-1).tolist() == list(o.token_ids[:switch])
        assert torch.allclose(
            lp_a[:switch].gather(-1, tokens[:switch, None]).squeeze(-1),
            torch.tensor(o.log_probs[:switch]),
            atol=LOGPROB_ATOL,
        )
        fresh = lp_b[switch:].gather(-1, tokens[switch:, None]).squeeze(-1)
        gap = float((fresh - torch.tensor(o.log_probs[switch:])).abs().max())
        if mode == "retract":
            assert after[switch:].argmax(-1).tolist() == list(o.token_ids[switch:]) and gap < LOGPROB_ATOL
        stale_kv.append(gap)
    if mode == "in_place":
        assert max(stale_kv) > 1e-2  # the KV of the tokens before the update is A's


def test_a_runner_whose_parameters_moved_while_parked_refills_its_cache(model_dirs: tuple[Path, Path]):
    """decode="static" (CUDA graphs capture parameter addresses): a first cuda_ipc sync re-points the parameters
    into flat buffers while a call is parked in place; the call then needs a new runner, whose cache it refills."""
    from transformers import AutoModelForCausalLM

    from services.weights.layout import plan_layout, specs_from_tensors

    engine = NativeEngine(model_dirs[0], device="cpu", decode="static")
    b = AutoModelForCausalLM.from_pretrained(model_dirs[1]).eval()
    layout = plan_layout(specs_from_tensors(engine.model.named_parameters()), bucket_bytes=16 * 1024)
    outs = _update_while_parked(
        engine,
        "in_place",
        {k: v.clone() for k, v in b.state_dict().items()},
        version=1,
        while_parked=lambda: engine.flatten_parameters(layout),
    )
    for prompt, o in zip(PROMPTS * 8, outs, strict=True):
        switch = o.token_versions.index(1)
        after = _teacher_forced_logits(b, prompt, o.token_ids)
        assert after[switch:].argmax(-1).tolist() == list(o.token_ids[switch:])  # B's own continuation


def test_release_and_resume_memory_on_cpu(model_dirs: tuple[Path, Path]):
    engine = NativeEngine(model_dirs[0], device="cpu")
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=6)
    before = engine.generate(PROMPTS, greedy)
    engine.release_memory(["kv_cache"])
    assert engine.get_state().released_memory == ("kv_cache",)
    with pytest.raises(EngineUnavailable, match="kv_cache"):
        engine.generate(PROMPTS, greedy)
    engine.resume_memory(["kv_cache"])
    assert engine.generate(PROMPTS, greedy) == before
    engine.release_memory()  # all tags: weights dropped (CPU has no cheaper place)
    assert all(p.numel() == 0 for p in engine.model.parameters())
    with pytest.raises(EngineUnavailable, match="ResumeMemory before loading"):
        engine.update_weights_from_disk(model_dirs[0], version=1)
    engine.resume_memory()
    with pytest.raises(EngineUnavailable, match="no values"):
        engine.generate(PROMPTS, greedy)
    engine.update_weights_from_disk(model_dirs[0], version=1)
    after = engine.generate(PROMPTS, greedy)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    with pytest.raises(ValueError, match="unknown memory tag"):
        engine.release_memory(["gpu_magic"])


def test_the_engines_busy_time_counts_forward_passes_not_idle_time(engine: NativeEngine):
    from services.rollout.engines.gate import DecodeGate

    gate = DecodeGate(engine="test")
    with gate.computing():
        time.sleep(0.05)
    busy = gate.busy_s
    time.sleep(0.05)
    assert 0.04 < busy < 1.0 and gate.busy_s == busy  # idle: no growth
    before = engine.get_state().busy_s
    engine.generate(PROMPTS, SamplingSpec(max_new_tokens=4, seed=1))
    assert engine.get_state().busy_s > before

"""The native engine on a CUDA device (skipped without one): log-prob agreement in float32 and bfloat16 (continuous
batching's graph replay included), greedy parity with HF generate, and releasing / resuming GPU memory with the
weights kept on the host."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.contracts.sampling_spec import SamplingSpec
from services.contracts.untyped import HFCausalLM
from services.modelinit.init_model import init_model
from services.rollout.engines.native.engine import NativeEngine
from services.rollout.engines.native.sampler import sampling_log_probs
from services.weights.transports.cuda_ipc import CudaIpcReceiver

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# float32 decode and a full forward agree to rounding; bfloat16 keeps ~3 significant digits, and the
# cached decode and the full forward round differently, so the bound is per-token and loose.
ATOL = {"float32": 1e-3, "bfloat16": 0.1}
PROMPTS = [[1, 7, 11, 18], [1, 3, 18], [1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 18]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("m") / "small", preset="small", seed=0)


def _worst_log_prob_gap(engine: NativeEngine, opts: SamplingSpec) -> float:
    prompts = [p for p in PROMPTS for _ in range(8)]
    outs = engine.generate(prompts, opts)
    worst = 0.0
    with torch.no_grad():
        for prompt, o in zip(prompts, outs, strict=True):
            ids = torch.tensor([prompt + list(o.token_ids)], device="cuda")
            logits = engine.model(ids).logits[0, len(prompt) - 1 : -1]
            ref = sampling_log_probs(logits, opts).gather(-1, torch.tensor(o.token_ids, device="cuda")[:, None])
            worst = max(worst, float((ref.squeeze(-1).cpu() - torch.tensor(o.log_probs)).abs().max()))
    return worst


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_log_probs_match_teacher_forced_forward_on_gpu(model_dir: Path, dtype: str):
    engine = NativeEngine(model_dir, device="cuda", dtype=dtype)
    worst = _worst_log_prob_gap(engine, SamplingSpec(temperature=0.8, top_p=0.9, max_new_tokens=24, seed=3))
    print(f"{dtype}: max |rollout - teacher-forced| = {worst:.2e}")
    assert worst < ATOL[dtype]


def test_fused_kernels_in_the_graph_decode_keep_log_probs_matching(model_dir: Path):
    """model.fused_kernels in the engine: its decode (CUDA graph) and its teacher-forced forward both run the fused
    RMSNorm/SwiGLU, and they agree as closely as the eager ones do."""
    from services.tensors import fused

    if not fused.available():
        pytest.skip("needs triton")
    engine = NativeEngine(model_dir, device="cuda", dtype="bfloat16", fused_kernels="on")
    assert any(hasattr(m, "_unfused_forward") for m in engine.model.modules())
    worst = _worst_log_prob_gap(engine, SamplingSpec(temperature=0.8, top_p=0.9, max_new_tokens=24, seed=3))
    assert worst < ATOL["bfloat16"]


def test_compiled_decode_and_sampler_log_probs_match_teacher_forced(model_dir: Path):
    engine = NativeEngine(model_dir, device="cuda", dtype="bfloat16", decode="compile")
    worst = _worst_log_prob_gap(engine, SamplingSpec(temperature=1.0, max_new_tokens=16, seed=3))
    assert engine._runners is not None and engine._runners.compiled and engine._runners._sampler is not None
    assert worst < ATOL["bfloat16"]


@pytest.mark.parametrize("decode", ["graph", "compile"])
def test_continuous_batching_replays_the_graph_and_keeps_log_probs_matching(model_dir: Path, decode: str):
    """continuous_batching on the static path (CUDA graph replay, per-row slots): 24 samples through 8 rows, each
    joining when rows free up (different prompt lengths at different steps), and every log-prob matches the
    teacher-forced forward as the one-call path does."""
    engine = NativeEngine(
        model_dir, device="cuda", dtype="float32", decode=decode, continuous_batching=True, max_batch_size=8
    )
    worst = _worst_log_prob_gap(engine, SamplingSpec(temperature=0.8, top_p=0.9, max_new_tokens=24, seed=3))
    assert engine._row_store is not None and engine._row_store.runner is not None
    assert engine._row_store.runner.graph is not None and sorted(engine._row_store._free) == list(range(8))
    views = engine._row_store.runner.views  # windows over the first 32 slots of the 128 (graph mode only)
    assert decode == "compile" or (views and all(v.graph is not None for v in views.values()))
    assert worst < ATOL["float32"]


def test_greedy_matches_hf_generate_on_gpu(model_dir: Path):
    from transformers import AutoModelForCausalLM

    engine = NativeEngine(model_dir, device="cuda")
    hf: HFCausalLM = AutoModelForCausalLM.from_pretrained(model_dir)
    hf = hf.cuda().eval()
    outs = engine.generate(PROMPTS, SamplingSpec(temperature=0.0, max_new_tokens=16))
    for prompt, o in zip(PROMPTS, outs, strict=True):
        ref = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=16)
        assert list(o.token_ids) == ref[0, len(prompt) :].tolist()[: len(o.token_ids)]


def test_release_and_resume_gpu_memory_keeps_weights(model_dir: Path):
    engine = NativeEngine(model_dir, device="cuda")
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=8)
    before = engine.generate(PROMPTS, greedy)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    engine.release_memory(["weights", "kv_cache"])
    assert torch.cuda.memory_allocated() < held - 10_000_000  # the ~18 MB of float32 weights left the GPU
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    engine.resume_memory()
    assert all(p.device.type == "cuda" for p in engine.model.parameters())
    assert engine.generate(PROMPTS, greedy) == before


def test_graph_decode_is_the_cuda_default_and_seeded(model_dir: Path):
    engine = NativeEngine(model_dir, device="cuda", dtype="bfloat16")
    assert engine.decode_mode == "graph"
    opts = SamplingSpec(temperature=1.0, max_new_tokens=20, seed=7)
    prompts = [p for p in PROMPTS for _ in range(5)]
    first = engine.generate(prompts, opts)
    assert engine.generate(prompts, opts) == first
    assert engine._runners is not None and all(r.graph is not None for r in engine._runners._runners.values())
    engine.release_memory(["cuda_graph"])
    assert engine._runners is None
    engine.resume_memory()
    assert engine.generate(prompts, opts) == first  # recaptured, same samples


def test_cuda_ipc_into_engine_flattens_once_and_is_bit_identical(model_dir: Path, tmp_path: Path):
    from helpers.weight_peer import Peer, bits_equal, make_tensors, plan_from_text, specs_to_json

    from services.weights import WeightReceiver
    from services.weights.layout import specs_from_tensors

    engine = NativeEngine(model_dir, device="cuda", dtype="bfloat16")
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=8)
    engine.generate(PROMPTS, greedy)  # a graph captured before the params move
    specs = specs_from_tensors(engine.model.named_parameters())
    trainer, receiver = Peer(), WeightReceiver()
    try:
        for version in (1, 2):
            plan = plan_from_text(
                trainer.call(
                    op="prepare",
                    transport="cuda_ipc",
                    bucket_mb=1.0,
                    timeout_s=60,
                    specs=specs_to_json(specs),
                    version=version,
                    run_dir=str(tmp_path),
                    trainer_id="actor-0",
                )["plan"]
            )
            trainer.send(op="publish", seed=version)
            engine.receive_weights(plan, rank_offset=1, receiver=receiver)
            assert trainer.reply(timeout_s=120)["ok"]
            expected, params = make_tensors(specs, seed=version), engine.named_parameters()
            assert all(bits_equal(params[s.name].cpu(), expected[s.name]) for s in specs)
            cuda_ipc = receiver._transports["cuda_ipc"]
            assert isinstance(cuda_ipc, CudaIpcReceiver) and cuda_ipc.last_copies == 1  # FlatParams: one copy a bucket
        assert len({p.untyped_storage().data_ptr() for p in engine.model.parameters()}) == 1
        assert engine.weight_version == 2
        outs = engine.generate(PROMPTS, greedy)  # graphs recaptured on the flat params
        assert all(len(o.token_ids) >= 1 for o in outs)
    finally:
        trainer.close()
        receiver.close()

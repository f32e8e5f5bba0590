"""The chunked scoring head on a CUDA device (skipped without one): its torch.compile'd block math (what the trainer
uses where `model.fused_kernels` is on) matches the eager one and the old path, and the device's peak memory stops
growing with tokens x vocabulary (the allocator's statistics)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest
import torch
from scoring_reference import reference_scores

from services.contracts.sampling_spec import SamplingSpec
from services.trainer.algo.head_scoring import ChunkedScores
from services.trainer.algo.scoring import TokenSampling, score_request
from services.trainer.batching import MicroBatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _request(n: int, vocab: int, *, compiled: bool, spec: SamplingSpec, chunk: int | Literal["auto"] = 1024):
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=torch.Generator("cuda").manual_seed(n))
    row = torch.zeros(1, n + 1, dtype=torch.long, device="cuda")
    mb = MicroBatch(
        input_ids=row,
        attention_mask=torch.ones_like(row),
        rows=torch.zeros_like(targets),
        positions=torch.arange(n, device="cuda"),
        targets=targets,
        token_index=torch.arange(n),
        num_tokens=n + 1,
    )
    sampling = TokenSampling.per_row(
        torch.full((n,), spec.temperature), torch.full((n,), spec.top_p), torch.full((n,), spec.top_k)
    ).to(torch.device("cuda"))
    request = score_request(
        mb, sampling, vocab=vocab, chunk_tokens=chunk, entropy=True, entropy_grad=True, compiled=compiled
    )
    return request, sampling, targets


@pytest.mark.parametrize("chunk", [1024, "auto"], ids=["vocab_blocks", "auto_whole_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_head_matches_the_eager_one_and_the_old_path(dtype, chunk):
    """1,024-token chunks: three chunks of five blocks, each the last one short; auto: one chunk of whole rows."""
    n, hidden_size, vocab = 3000, 256, 40_000
    gen = torch.Generator("cuda").manual_seed(0)
    hidden = torch.randn(n, hidden_size, device="cuda", generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.1).to(dtype).requires_grad_()
    upstream = torch.randn(3, n, device="cuda", generator=gen)
    results = []
    for compiled in (False, True):
        request, sampling, targets = _request(
            n, vocab, compiled=compiled, spec=SamplingSpec(temperature=0.8), chunk=chunk
        )
        scores = ChunkedScores.apply(hidden, weight, request)
        results.append((scores, *torch.autograd.grad((upstream * scores).sum(), (hidden, weight))))
    ref = reference_scores(hidden @ weight.t(), targets, sampling)
    expected = (ref, *torch.autograd.grad((upstream * ref).sum(), (hidden, weight)))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got in results:
        for g, e in zip(got, expected, strict=True):
            assert float((g.double() - e.double()).norm() / e.double().norm()) < tol


def test_peak_device_memory_stops_growing_with_tokens_times_vocabulary():
    """bf16, Qwen2.5-0.5B's head (151,936 x 896): from 2,048 to 8,192 scored tokens, forward and backward, the
    peak grows by the [tokens x hidden] part, not by [6,144 x 151,936] tables (1.9 GB each in bf16 fp32 math)."""
    vocab, hidden_size = 151_936, 896
    weight = (torch.randn(vocab, hidden_size, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    peaks = {}
    for n in (2048, 8192):
        hidden = torch.randn(n, hidden_size, device="cuda").to(torch.bfloat16).requires_grad_()
        request, _, _ = _request(n, vocab, compiled=False, spec=SamplingSpec(temperature=1.0))
        request = dataclasses.replace(request, chunk_tokens=1024)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ChunkedScores.apply(hidden, weight, request).sum().backward()
        torch.cuda.synchronize()
        peaks[n] = torch.cuda.max_memory_allocated() - base
        weight.grad = None
    assert peaks[8192] - peaks[2048] < 0.25 * 6144 * vocab * 4, peaks

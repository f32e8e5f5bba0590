"""The chunked scoring head (services/trainer/algo/head_scoring.py) against the path it replaced
(tests/scoring_reference.py: full logits, whole-vocabulary tables, autograd): the same scores and the same gradients,
w.r.t. the hidden states and the head's weight, at fp32 to 1e-5, on batches mixing sampling distributions
(temperature, top-k, top-p, both, greedy) and behaviour spaces; through a real tied-embedding model in padded and
packed micro-batches, a LoRA head, bf16; and peak memory that stops growing with tokens x vocabulary (a subprocess's
peak RSS)."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from scoring_reference import reference_scores

from services.contracts.sampling_spec import SamplingSpec
from services.contracts.wire import build_batch
from services.trainer.algo.head_scoring import VOCAB_BLOCK, ChunkedScores, chunk_layout, install, scores_of, scoring
from services.trainer.algo.scoring import TokenSampling, score_request
from services.trainer.batching import MicroBatch, build_micro_batch, merge_batches, pack_rows
from services.trainer.model.backend import model_inputs

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

SETTINGS = [
    SamplingSpec(temperature=0.7, top_p=0.9),
    SamplingSpec(temperature=1.3, top_k=6),
    SamplingSpec(temperature=0.7, top_p=0.6, top_k=10),
    SamplingSpec(temperature=0.0, top_p=0.5),
    SamplingSpec(temperature=1.0),
]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


UNTRUNCATED = [SamplingSpec(temperature=0.7), SamplingSpec(temperature=0.0), SamplingSpec(temperature=1.3)]


def mixed_sampling(n: int, seed: int, settings: list[SamplingSpec] = SETTINGS) -> TokenSampling:
    rng = random.Random(seed)
    chosen = [rng.choice(settings) for _ in range(n)]
    return TokenSampling.per_row(
        torch.tensor([d.temperature for d in chosen]),
        torch.tensor([d.top_p for d in chosen]),
        torch.tensor([d.top_k for d in chosen]),
        tempered=torch.tensor([rng.random() < 0.3 for _ in range(n)]),
    )


def flat_micro_batch(targets: torch.Tensor) -> MicroBatch:
    n = len(targets)
    row = torch.zeros(1, n + 1, dtype=torch.long)
    return MicroBatch(
        input_ids=row,
        attention_mask=torch.ones_like(row),
        rows=torch.zeros(n, dtype=torch.long),
        positions=torch.arange(n),
        targets=targets,
        token_index=torch.arange(n),
        num_tokens=n + 1,
    )


@pytest.mark.parametrize(
    "settings,tempered,entropy_grad",
    [(SETTINGS, False, True), (SETTINGS, False, False), (SETTINGS, True, False), (UNTRUNCATED, False, True)],
    ids=["truncated+entropy", "truncated", "kl_reference", "untruncated+entropy"],
)
@pytest.mark.parametrize("block", [24, 64], ids=["vocab_blocks", "whole_rows"])
def test_scores_and_gradients_match_the_old_path(settings, tempered, entropy_grad, block):
    """Truncating batches go by whole rows; the others (and the KL's tempered pass) by vocabulary blocks, with the
    log-sum-exp and the entropy accumulated online: 53 tokens in chunks of 7, 64 columns in blocks of 24 (the last
    chunk and block short), or in one block of the whole vocabulary (what `scoring_chunk_tokens: auto` does: no
    merge). Log-probs around -60 carry float32's 2 ulps (rtol 1e-6)."""
    gen = torch.Generator().manual_seed(1)
    n, hidden_size, vocab = 53, 16, 64
    hidden = (torch.randn(n, hidden_size, generator=gen) * 2).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=gen).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=gen)
    sampling = mixed_sampling(n, seed=2, settings=settings)
    request = dataclasses.replace(
        score_request(
            flat_micro_batch(targets),
            sampling,
            vocab=vocab,
            chunk_tokens=7,
            tempered=tempered,
            entropy=not tempered,
            entropy_grad=entropy_grad,
        ),
        vocab_block=block,
    )
    assert request.needs_support == (settings is SETTINGS and not tempered)
    ours = ChunkedScores.apply(hidden, weight, request)
    ref = reference_scores(hidden @ weight.t(), targets, sampling, tempered=tempered, entropy_grad=entropy_grad)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)
    assert (ours[0] == -1e4).any() == request.needs_support  # outside its nucleus: floored
    upstream = torch.randn(3, n, generator=gen)
    got = torch.autograd.grad((upstream * ours).sum(), (hidden, weight))
    expected = torch.autograd.grad((upstream * ref).sum(), (hidden, weight))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def tiny_causal_lm(*, tied: bool, attn: str, vocab: int = 96) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg._attn_implementation = attn  # what the attn_implementation argument sets (its stub does not list it)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).train()


def varied_batch(vocab: int, seed: int = 3):
    """Two rollout batches (different sampling, one reporting tempered log-probs), samples of varied lengths."""
    rng = np.random.default_rng(seed)
    parts = []
    for rollout_id, (spec, space) in enumerate(
        [
            (SamplingSpec(temperature=0.7, top_p=0.8, top_k=20), "sampling"),
            (SamplingSpec(temperature=1.2, top_p=0.9), "tempered"),
        ]
    ):
        n = 4
        prompts = [rng.integers(3, vocab, size=int(rng.integers(2, 9))).tolist() for _ in range(n)]
        responses = [rng.integers(3, vocab, size=int(rng.integers(1, 12))).tolist() for _ in range(n)]
        parts.append(
            build_batch(
                rollout_id=rollout_id,
                policy_version=0,
                prompts=prompts,
                responses=responses,
                log_probs=[[-1.0] * len(r) for r in responses],
                rewards=[0.0] * n,
                group_ids=[0] * n,
                finish_reasons=["stop"] * n,
                sampling=spec,
                logprob_space=space,
            )
        )
    return merge_batches(parts)


def grads_of(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return dict(zip([n for n, _ in named], torch.autograd.grad(loss, [p for _, p in named]), strict=True))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_tied_embedding_model_trains_as_on_the_old_path_padded_or_packed(attn):
    """The installed head inside a real model (tied embeddings: the head's gradient reaches the input embedding
    too): scores and every parameter's gradient equal the old path's; packed rows (several samples each, position
    ids restarting, attention kept within each sample) give the same numbers as padded ones."""
    model = tiny_causal_lm(tied=True, attn=attn)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    batch = varied_batch(vocab=96)
    sampling = TokenSampling.of(batch)
    upstream = torch.randn(3, batch.num_response_tokens, generator=torch.Generator().manual_seed(4))
    padded = build_micro_batch(batch, list(range(batch.num_samples)))
    logits = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits[
        padded.rows, padded.positions
    ]
    ref = reference_scores(logits, padded.targets, sampling.at(padded.token_index))
    expected = grads_of(model, (upstream[:, padded.token_index] * ref).sum())
    seq = (batch.prompt_lengths + batch.response_lengths).tolist()
    [rows] = pack_rows(list(range(batch.num_samples)), seq, token_budget=10_000)
    packed = build_micro_batch(batch, rows)
    assert packed.input_ids.shape[0] < batch.num_samples  # some row holds several samples
    install(model)
    for mb in (padded, packed):
        request = score_request(
            mb, sampling.at(mb.token_index), vocab=96, chunk_tokens=5, entropy=True, entropy_grad=True
        )
        with scoring(request):
            scores = scores_of(model(**model_inputs(mb), use_cache=False), request)
        order = torch.argsort(mb.token_index)  # both in the batch's token order
        torch.testing.assert_close(scores[:, order], ref[:, torch.argsort(padded.token_index)], rtol=1e-6, atol=1e-5)
        got = grads_of(model, (upstream[:, mb.token_index] * scores).sum())
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_a_lora_head_trains_its_adapters_as_on_the_old_path():
    """trainer.lora with lm_head among the targets: the head's low-rank path is scored as extra columns
    ([h, s h A^T] [W, B]^T); with the adapters off it scores the base model (the KL reference's view)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_causal_lm(tied=False, attn="eager"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0),
    )
    for name, p in model.named_parameters():  # B = 0 at start: nudge it so the head's adapter matters
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5, generator=torch.Generator().manual_seed(5))
    batch = varied_batch(vocab=96, seed=6)
    sampling, mb = TokenSampling.of(batch), build_micro_batch(batch, list(range(batch.num_samples)))
    tok = sampling.at(mb.token_index)
    upstream = torch.randn(3, mb.targets.shape[0], generator=torch.Generator().manual_seed(7))
    ref = reference_scores(model(**model_inputs(mb)).logits[mb.rows, mb.positions], mb.targets, tok)
    expected = grads_of(model, (upstream * ref).sum())
    install(model)
    request = score_request(mb, tok, vocab=96, chunk_tokens=4, entropy=True, entropy_grad=True)
    with scoring(request):
        scores = scores_of(model(**model_inputs(mb), use_cache=False), request)
    torch.testing.assert_close(scores, ref, rtol=1e-6, atol=1e-5)
    got = grads_of(model, (upstream * scores).sum())
    assert any("lm_head.lora_B" in n for n in got)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    with torch.no_grad(), model.disable_adapter():
        base = model(**model_inputs(mb)).logits[mb.rows, mb.positions]
        with scoring(request):
            off = scores_of(model(**model_inputs(mb)), request)
    torch.testing.assert_close(off, reference_scores(base, mb.targets, tok), rtol=1e-6, atol=1e-5)


def test_bf16_weights_and_autocast_score_like_the_old_path():
    """bf16 parameters (trainer.precision bf16 and bf16_pure: the head sees bf16 weights in both) and fp32
    parameters under bf16 autocast, whose backward recomputes the logits under the forward's autocast."""
    gen = torch.Generator().manual_seed(8)
    n, hidden_size, vocab = 40, 32, 128
    targets = torch.randint(0, vocab, (n,), generator=gen)
    sampling = mixed_sampling(n, seed=9)
    request = score_request(
        flat_micro_batch(targets), sampling, vocab=vocab, chunk_tokens=9, entropy=True, entropy_grad=True
    )
    h32, w32 = torch.randn(n, hidden_size, generator=gen), torch.randn(vocab, hidden_size, generator=gen) * 0.3
    upstream = torch.randn(3, n, generator=gen)
    for dtype, autocast in ((torch.bfloat16, False), (torch.float32, True)):
        hidden, weight = h32.to(dtype).requires_grad_(), w32.to(dtype).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ours = ChunkedScores.apply(hidden, weight, request)
            ref = reference_scores(hidden @ weight.t(), targets, sampling)
        assert ours.dtype == torch.float32
        finite = ref[0] > -1e4  # a bf16 rounding may move a token across its nucleus' edge: compare the rest
        torch.testing.assert_close(ours[:, finite], ref[:, finite], rtol=0, atol=3e-2)
        got = torch.autograd.grad((upstream * ours).sum(), (hidden, weight))
        expected = torch.autograd.grad((upstream * ref).sum(), (hidden, weight))
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == dtype and float((g.float() - e.float()).norm() / e.float().norm()) < 3e-2


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from scoring_reference import reference_scores
    from services.contracts.sampling_spec import SamplingSpec
    from services.trainer.batching import MicroBatch
    from services.trainer.algo.head_scoring import ChunkedScores
    from services.trainer.algo.scoring import TokenSampling, score_request

    torch.set_num_threads(1)
    VOCAB, HIDDEN, CHUNK = 16384, 64, 64
    spec = SamplingSpec(temperature=0.7, top_p=0.9)
    weight = (torch.randn(VOCAB, HIDDEN) * 0.1).requires_grad_()

    def step(n, chunked):
        hidden = torch.randn(n, HIDDEN).requires_grad_()
        targets = torch.randint(0, VOCAB, (n,))
        sampling = TokenSampling.per_row(torch.full((n,), spec.temperature), torch.full((n,), spec.top_p),
                                         torch.zeros(n, dtype=torch.long))
        if chunked:
            mb = MicroBatch(input_ids=torch.zeros(1, 1, dtype=torch.long), attention_mask=torch.ones(1, 1),
                            rows=torch.zeros(n, dtype=torch.long), positions=torch.arange(n), targets=targets,
                            token_index=torch.arange(n), num_tokens=n)
            request = score_request(mb, sampling, vocab=VOCAB, chunk_tokens=CHUNK, entropy=True, entropy_grad=True)
            scores = ChunkedScores.apply(hidden, weight, request)
        else:
            scores = reference_scores(hidden @ weight.t(), targets, sampling)
        scores.sum().backward()
        weight.grad = None

    def peak_mib():   # VmHWM: this process's own high-water mark. ru_maxrss would start at the RSS of the parent
        # that spawned it (Linux carries it across exec), so under a big pytest worker every figure read the same
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024

    out = {}
    for path in ("chunked", "old"):   # the chunked head first: the high-water mark only rises
        step(64, chunked=path == "chunked")   # warm-up: the allocator's and the kernels' first-use costs
        for n in (128, 640):
            step(n, chunked=path == "chunked")
            out[f"{path}{n}"] = peak_mib()
    print(json.dumps(out))
""")


def peak_rss_mib() -> dict[str, float]:
    """Peak RSS (MiB) after each step of one subprocess: chunked at 128 then 640 tokens, then the old path."""
    tests = Path(__file__).resolve().parent
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(tests)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tests.parent,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_peak_memory_stops_growing_with_tokens_times_vocabulary():
    """From 128 to 640 scored tokens at a 16,384-token vocabulary (top-p 0.9, entropy in the loss), forward and
    backward: the old path's peak RSS grows by several [512 x 16,384] fp32 tables (32 MiB each; about eight were
    measured); the chunked head's (64-token chunks) by less than one (7-16 MiB were measured: its [tokens x hidden]
    part, per-token vectors and the allocator's slack)."""
    table_mib = 512 * 16384 * 4 / 2**20
    peaks = peak_rss_mib()
    assert peaks["chunked640"] - peaks["chunked128"] < table_mib, peaks
    assert peaks["old640"] - peaks["old128"] > 3 * table_mib, peaks


def test_auto_chunks_are_whole_rows_within_the_devices_budget_of_logits():
    """`scoring_chunk_tokens: auto` on a CPU: whole rows (one vocabulary block), as many as make 2^26 logits (441 at
    Qwen2.5's 151,936 tokens; a whole micro-batch at a toy vocabulary); a number keeps 8,192-column blocks."""
    assert chunk_layout("auto", 151_936, torch.device("cpu")) == (441, 151_936)
    assert chunk_layout("auto", 22, torch.device("cpu")) == (2**26 // 22, 22)
    assert chunk_layout(1024, 151_936, torch.device("cpu")) == (1024, VOCAB_BLOCK)
    request = score_request(
        flat_micro_batch(torch.zeros(3, dtype=torch.long)),
        mixed_sampling(3, seed=0),
        vocab=151_936,
        chunk_tokens="auto",
    )
    assert (request.chunk_tokens, request.vocab_block) == (441, 151_936)
    for vocab in (22, 4096, 151_936, 262_144):  # a chunk's table stays within the budget whatever the vocabulary
        rows, block = chunk_layout("auto", vocab, torch.device("cpu"))
        assert block == vocab and rows * vocab <= 2**26 < (rows + 1) * vocab


def test_auto_chunks_on_a_gpu_are_one_gib_of_logits_or_a_32nd_of_a_smaller_cards_memory(monkeypatch):
    """On a GPU (its memory faked: this runs anywhere) a chunk's float32 table is at most 1 GiB, 1,766 rows at
    151,936 tokens on an 80 GB H100 (was 1/32 of it, 4,372 rows, whose temporaries put prime-rl's shape over its
    12.5 GiB), and at most 1/32 of a smaller card's memory (a 16 GiB card: 883 rows)."""
    from services.trainer.algo import head_scoring

    for total, rows in ((80 * 10**9, 2**28 // 151_936), (16 * 2**30, 16 * 2**30 // 32 // 4 // 151_936)):
        props = type("Props", (), {"total_memory": total})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, props=props: props)
        head_scoring._auto_logits.cache_clear()
        try:
            assert chunk_layout("auto", 151_936, torch.device("cuda", 0)) == (rows, 151_936)
        finally:
            head_scoring._auto_logits.cache_clear()

"""Stop strings and end-of-generation ids in the native engine (real engine, tiny random-init models on CPU).

A stop string is taken from what the model generates without one; generating again with it must end each sample at
the token whose text completes it, keep that token (also when the string ends inside it), keep the tokens and
log-probs exactly as generated up to there, and report finish reason stop.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.contracts.config_loading import config_from_dict
from services.contracts.sampling_spec import SamplingSpec
from services.modelinit.init_model import init_model
from services.rollout.builder import build_engine
from services.rollout.chat_template import ChatTemplate
from services.rollout.engines.interface import SampleOutput
from services.rollout.engines.native.engine import NativeEngine
from services.rollout.engines.native.stop_strings import StopStringTables
from services.rollout.tokenizer import Texts, end_of_generation_ids, load_tokenizer

torch.set_num_threads(1)

PROMPTS = [[1, 7, 11, 18], [1, 3, 18], [1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 18], [1, 9, 9, 18]]


def texts_of(path: Path) -> Texts:
    """The run's tokenizer as the rollout service holds it (its own chat template)."""
    tokenizer = load_tokenizer(path)
    return Texts(tokenizer, ChatTemplate(tokenizer, source=f"the chat template of the tokenizer at {path}"))


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Texts]:
    path = init_model(tmp_path_factory.mktemp("toy") / "tiny", preset="tiny", seed=2)
    return path, texts_of(path)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Texts]:
    """Qwen2.5-0.5B's vocabulary and byte-level BPE tokenizer over a tiny body: tokens of several characters."""
    path = init_model(tmp_path_factory.mktemp("qwen") / "q", preset="qwen2.5-0.5b", body="tiny", seed=1)
    return path, texts_of(path)


def first_completion(texts: Texts, tokens: tuple[int, ...], stop: str) -> int | None:
    """Where generation must end: the first token whose prefix text holds `stop` (decoded whole, not by window)."""
    return next((p for p in range(len(tokens)) if stop in texts.decode_raw([tokens[: p + 1]])[0]), None)


def assert_cut(texts: Texts, free: SampleOutput, got: SampleOutput, stop: str) -> int | None:
    p = first_completion(texts, free.token_ids, stop)
    if p is None:
        assert got == free
        return None
    assert got.token_ids == free.token_ids[: p + 1] and got.finish_reason == "stop"
    assert got.log_probs == pytest.approx(free.log_probs[: p + 1], abs=1e-5)
    assert stop in texts.decode_raw([got.token_ids])[0]
    return p


@pytest.mark.parametrize("decode", ["dynamic", "static", "continuous"])
def test_stop_string_ends_the_sample_at_the_completing_token(toy: tuple[Path, Texts], decode: str):
    path, texts = toy
    kind = {"continuous_batching": True} if decode == "continuous" else {"decode": decode}
    engine = NativeEngine(path, device="cpu", detokenizer=texts, max_batch_size=8, **kind)
    # greedy rows do not depend on each other; the static path also samples every row every step
    opts = SamplingSpec(temperature=1.0 if decode == "static" else 0.0, max_new_tokens=12, seed=5, ignore_eos=True)
    free = engine.generate(PROMPTS * 2, opts)
    # two tokens' text ("a b") that the most samples hold: several rows end, each at its own token
    pairs = {texts.decode_raw([f.token_ids[i : i + 2]])[0] for f in free for i in range(1, 10)}
    stop = max(sorted(pairs), key=lambda s: sum(first_completion(texts, f.token_ids, s) is not None for f in free))
    got = engine.generate(PROMPTS * 2, replace(opts, stop=(stop, "no such text")))
    cuts = [assert_cut(texts, f, g, stop) for f, g in zip(free, got, strict=True)]
    assert len({c for c in cuts if c is not None}) >= 2, (stop, cuts)


def test_stop_string_ending_inside_a_token_keeps_that_token(qwen: tuple[Path, Texts]):
    path, texts = qwen
    engine = NativeEngine(path, device="cpu", detokenizer=texts)
    opts = SamplingSpec(temperature=1.0, max_new_tokens=10, seed=11, ignore_eos=True)
    prompt = [texts.encode_text("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")]
    free = engine.generate(prompt, opts)[0]
    pieces = [texts.decode_raw([[t]])[0] for t in free.token_ids]
    k = next(i for i in range(1, len(pieces)) if len(pieces[i]) >= 3)
    stop = pieces[k - 1] + pieces[k][:2]  # ends two characters into token k
    got = engine.generate(prompt, replace(opts, stop=(stop,)))[0]
    p = assert_cut(texts, free, got, stop)
    text = texts.decode_raw([got.token_ids])[0]
    assert p is not None and not text.endswith(stop) and text.index(stop) + len(stop) < len(text)


def test_candidate_tables(qwen: tuple[Path, Texts]):
    _, texts = qwen
    tables = StopStringTables(texts, vocab_size=151_936, device=torch.device("cpu"))
    hashes = tables.for_request(["####"])
    pieces = texts.decode_raw([[i] for i in range(len(texts.tokenizer))])
    expected = torch.tensor([("#" in t) or ("\ufffd" in t) for t in pieces])
    assert torch.equal(hashes.candidates, expected) and 0 < int(expected.sum()) < 1000
    assert hashes.window == 5  # 4 bytes + 1
    assert bool(tables.for_request(["done\n"]).candidates.all())  # ends in whitespace: every token
    assert tables.for_request(["####"]).candidates is hashes.candidates  # cached


def test_stop_strings_need_the_tokenizer(toy: tuple[Path, Texts]):
    engine = NativeEngine(toy[0], device="cpu")
    with pytest.raises(ValueError, match=r"built without the tokenizer \(detokenizer=\)"):
        engine.generate(PROMPTS[:1], SamplingSpec(stop=("3",)))


def test_every_end_of_generation_id_ends_a_sample(toy: tuple[Path, Texts], qwen: tuple[Path, Texts], tmp_path: Path):
    """generation_config.json's list counts, not only config.json's id: a model directory whose generation config
    names a token the model emits stops there, through the engine the rollout service builds."""
    assert end_of_generation_ids(qwen[0], qwen[1].tokenizer) == (151643, 151645)
    path, texts = toy
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    free = NativeEngine(path, device="cpu").generate(PROMPTS[:1], greedy)[0]
    emitted = free.token_ids[2]
    copy = Path(shutil.copytree(path, tmp_path / "m"))
    gen = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [gen["eos_token_id"], emitted]}))
    config = config_from_dict(
        {"model": {"path": str(copy)}, "data": {"train_path": "x.jsonl"}, "rollout": {"device": "cpu"}}
    )
    engine = build_engine(config, texts_of(copy))
    assert isinstance(engine, NativeEngine)
    assert emitted in engine.eos_token_ids and texts.tokenizer.eos_token_id in engine.eos_token_ids
    first = free.token_ids.index(emitted)
    out = engine.generate(PROMPTS[:1], replace(greedy, ignore_eos=False))[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"

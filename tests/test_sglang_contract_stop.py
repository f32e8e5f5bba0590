"""Stop strings and end-of-generation ids through the sglang engine, against the contract server started with a real
tokenizer directory (Qwen2.5's vocabulary, the byte-level BPE tokenizer `tandem init-model` trains): the server
matches `stop` as SGLang 0.5.17's scheduler does and answers in its shape (tests/helpers/sglang_contract_server.py).

The server's generation rule gives token i = last prompt token + 1 + i; ids 0..93 of this tokenizer are the bytes
'!'..'~', so a prompt ending in '`' (63) generates "abcdefg...".
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.sglang_contract_server import ContractServer

from services.contracts.config_loading import config_from_dict
from services.contracts.sampling_spec import SamplingSpec
from services.rollout.builder import build_engine
from services.rollout.chat_template import ChatTemplate
from services.rollout.engines.sglang.engine import SGLangEngine
from services.rollout.engines.sglang.protocol import parse_server_info
from services.rollout.tokenizer import Texts, load_tokenizer

pytestmark = pytest.mark.timeout(120)

BACKTICK, LETTER_U = 63, 83  # '`' then 'a', 'b', ...; 'u' then 'v', 'w', ...


def texts_of(path: Path) -> Texts:
    """The run's tokenizer as the rollout service holds it (its own chat template)."""
    tokenizer = load_tokenizer(path)
    return Texts(tokenizer, ChatTemplate(tokenizer, source=f"the chat template of the tokenizer at {path}"))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.modelinit.bpe_tokenizer import build_tokenizer, save_tokenizer
    from services.modelinit.families import QWEN25

    path = tmp_path_factory.mktemp("qwen-tokenizer")
    save_tokenizer(build_tokenizer(QWEN25, model_max_length=256), QWEN25, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    return path


@pytest.fixture(scope="module")
def server(tokenizer_dir: Path):
    # --eos 151645: a server that stops by itself only on the tokenizer's eos (<|im_end|>)
    s = ContractServer(
        "--profile",
        "0.5.17",
        "--tokenizer",
        str(tokenizer_dir),
        "--vocab",
        "151936",
        "--eos",
        "151645",
        "--context",
        "256",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(server: ContractServer, tokenizer_dir: Path):
    config = config_from_dict(
        {
            "model": {"path": str(tokenizer_dir)},
            "data": {"train_path": "x.jsonl"},
            "rollout": {"engine": "sglang", "sglang": {"urls": [server.url]}},
        }
    )
    e = build_engine(config, texts_of(tokenizer_dir))
    yield e
    e.close()


def last_body(server: ContractServer) -> dict:
    return [e["body"] for e in server.log() if e["path"] == "/generate"][-1]


def test_sglang_contract_stop_strings(server: ContractServer, engine: SGLangEngine, tokenizer_dir: Path):
    texts = texts_of(tokenizer_dir)
    assert len(texts.tokenizer.encode("cde", add_special_tokens=False)) == 3  # SGLang's tail holds 3 + 1 tokens
    out = engine.generate([[BACKTICK], [LETTER_U]], SamplingSpec(max_new_tokens=10, stop=("cde", "never")))
    assert texts.decode(out[0].token_ids) == "abcde" and out[0].finish_reason == "stop"  # "e" completes it, kept
    assert len(out[0].log_probs) == 5
    assert texts.decode(out[1].token_ids) == "uvwxyz{|}~" and out[1].finish_reason == "length"
    assert last_body(server)["sampling_params"]["stop"] == ["cde", "never"]
    # SGLang's own answer: output_ids keep the completing token, `text` is cut before the string
    raw = server.call(
        "POST",
        "/generate",
        {"input_ids": [BACKTICK], "return_logprob": True, "sampling_params": {"max_new_tokens": 10, "stop": ["cde"]}},
    )
    assert raw["meta_info"]["finish_reason"] == {"type": "stop", "matched": "cde"}
    assert raw["output_ids"] == [64, 65, 66, 67, 68] and raw["text"] == "ab"


def test_sglang_contract_every_end_of_generation_id(server: ContractServer, engine: SGLangEngine):
    """generation_config.json's second EOS (<|endoftext|>, 151643) ends a sample although this server stops only on
    151645 by itself: the adapter sends the model's EOS ids as stop_token_ids (not with ignore_eos)."""
    assert engine._eos_token_ids == (151643, 151645)
    (out,) = engine.generate([[151640]], SamplingSpec(max_new_tokens=8))
    assert out.token_ids == (151641, 151642, 151643) and out.finish_reason == "stop"
    assert last_body(server)["sampling_params"]["stop_token_ids"] == [151643, 151645]
    (out,) = engine.generate([[151640]], SamplingSpec(max_new_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4 and "stop_token_ids" not in last_body(server)["sampling_params"]


def test_sglang_contract_stop_strings_need_a_tokenizer_on_the_server(server: ContractServer):
    assert parse_server_info({"version": "0.5.17", "skip_tokenizer_init": True}, url="u").skip_tokenizer_init
    blind = SGLangEngine([server.url], startup_timeout_s=20)
    try:
        blind.servers[0].info = replace(blind.servers[0].info, skip_tokenizer_init=True)
        with pytest.raises(ValueError, match=r"runs with --skip-tokenizer-init, so it cannot match stop strings"):
            blind.generate([[BACKTICK]], SamplingSpec(stop=("x",)))
        assert blind.generate([[BACKTICK]], SamplingSpec(max_new_tokens=2))[0].token_ids == (64, 65)
    finally:
        blind.close()

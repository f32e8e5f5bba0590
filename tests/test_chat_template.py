"""The chat template (services/rollout/chat_template.py, tokenizer.py) with a real byte-level BPE ChatML tokenizer
built in the test: auto (the tokenizer's template from tokenizer_config.json), a template file, chat_template_kwargs, no
duplicated BOS, one-line failures; a RolloutService with the real native engine on a tiny model over that tokenizer
generating from chat prompts (what the trainer and the reward see); and preflight's checks of chat rows."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import recording_reward
from helpers.chatml_tokenizer import CHATML_TEMPLATE, build_chatml_model, build_chatml_tokenizer

from services.buffer.stream import RolloutBuffer, connect
from services.contracts.chat_messages import ChatMessage
from services.contracts.config import ConfigError
from services.contracts.config_loading import config_from_dict
from services.contracts.rollout_calls import GenerateRequest
from services.coordinator.data import PromptRecord
from services.launcher import preflight
from services.rollout.builder import build_rollout
from services.rollout.chat_template import ChatTemplate, ChatTemplateError
from services.rollout.service import PromptInput, RolloutService
from services.rollout.tokenizer import encode_texts, load_tokenizer, model_inputs

torch.set_num_threads(1)
QUESTION = (ChatMessage("user", "Ava has 3 apples and buys 2 more. How many apples does Ava have now?"),)
RENDERED = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nAva has 3 apples and buys "
    "2 more. How many apples does Ava have now?<|im_end|>\n<|im_start|>assistant\n"
)
# Qwen3's switch: with enable_thinking false, the generation prompt holds an empty thinking block
THINKING_TEMPLATE = CHATML_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' }}",
    "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))


def config(model: str, **data):
    return config_from_dict(
        {"model": {"path": model}, "data": {"train_path": "unused.parquet", **data}, "rollout": {"device": "cpu"}}
    )


def test_auto_renders_the_tokenizers_template_and_encodes_it_without_special_tokens(chatml):
    tokenizer = load_tokenizer(chatml)
    chat = ChatTemplate.from_config(tokenizer, config(str(chatml)))
    prompts = [PromptRecord(text="", label="5", messages=QUESTION), PromptRecord(text="3 + 2 =", label="5")]
    texts, ids = model_inputs(tokenizer, chat, prompts)
    assert texts == [RENDERED, "3 + 2 ="]
    assert ids[0] == tokenizer(RENDERED, add_special_tokens=False)["input_ids"]
    im_start, im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert isinstance(im_start, int) and isinstance(im_end, int)
    assert ids[0][0] == im_start and ids[0].count(im_start) == 3 and ids[0].count(im_end) == 2  # whole tokens
    assert ids[1] == tokenizer("3 + 2 =")["input_ids"]


def test_a_template_file_and_kwargs_reach_the_template(chatml, tmp_path):
    (tmp_path / "thinking.jinja").write_text(THINKING_TEMPLATE)
    tokenizer = load_tokenizer(chatml)
    off = config(
        str(chatml), chat_template=str(tmp_path / "thinking.jinja"), chat_template_kwargs={"enable_thinking": False}
    )
    [text] = ChatTemplate.from_config(tokenizer, off).render([QUESTION])
    assert text == RENDERED + "<think>\n\n</think>\n\n"
    on = config(str(chatml), chat_template=str(tmp_path / "thinking.jinja"))
    assert ChatTemplate.from_config(tokenizer, on).render([QUESTION]) == [RENDERED]
    with pytest.raises(ChatTemplateError, match=r"data.chat_template: cannot read .*missing.jinja"):
        ChatTemplate.from_config(tokenizer, config(str(chatml), chat_template=str(tmp_path / "missing.jinja")))


def test_a_template_that_writes_the_bos_gets_no_second_one(example_model, tmp_path):
    """The tiny tokenizer adds <s> to text; a template that writes {{ bos_token }} itself must not get another."""
    (tmp_path / "bos.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tokenizer = load_tokenizer(example_model)
    chat = ChatTemplate.from_config(tokenizer, config(str(example_model), chat_template=str(tmp_path / "bos.jinja")))
    _, [chat_ids, text_ids] = model_inputs(
        tokenizer,
        chat,
        [
            PromptRecord(text="", label="", messages=(ChatMessage("user", "3 4 ="),)),
            PromptRecord(text="3 4 =", label=""),
        ],
    )
    assert chat_ids == text_ids == tokenizer("3 4 =")["input_ids"]
    assert chat_ids.count(tokenizer.bos_token_id) == 1


def test_a_missing_template_or_one_that_fails_is_named_in_one_line(example_model, chatml, tmp_path):
    tiny = load_tokenizer(example_model)  # word-level, no chat template
    with pytest.raises(
        ChatTemplateError,
        match=r"data.chat_template is auto, and the tokenizer at .* has no chat "
        "template; set data.chat_template to a Jinja template file",
    ):
        ChatTemplate.from_config(tiny, config(str(example_model))).render([QUESTION])
    with pytest.raises(ChatTemplateError, match=r"data.chat_template is tokenizer, and the tokenizer at "):
        ChatTemplate.from_config(tiny, config(str(example_model), chat_template="tokenizer")).render([QUESTION])
    (tmp_path / "strict.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    chat = ChatTemplate.from_config(
        load_tokenizer(chatml), config(str(chatml), chat_template=str(tmp_path / "strict.jinja"))
    )
    with pytest.raises(ChatTemplateError, match=r"strict\.jinja .* failed: .*no tool role") as caught:
        chat.render([QUESTION, QUESTION, (ChatMessage("tool", "42"),)])
    assert caught.value.index == 2


def test_a_rollout_service_generates_from_chat_prompts_with_the_template_and_the_reward_sees_text_and_messages(
    tmp_path_factory, redis_server, stream
):
    """The real native engine on a random two-layer model over the ChatML tokenizer: the trainer's prompt tokens
    are the template's, the reward gets the rendered text and the messages (JSON) beside the row's metadata."""
    model = build_chatml_model(tmp_path_factory.mktemp("chatml_model"))
    svc = RolloutService(
        build_rollout(
            config_from_dict(
                {
                    "run_name": "chat-test",
                    "model": {"path": str(model)},
                    "data": {"train_path": "unused.parquet", "system_prompt": "Answer with a number."},
                    "rollout": {
                        "device": "cpu",
                        "n_samples_per_prompt": 2,
                        "reward": "helpers.recording_reward:record",
                        "sampling": {"temperature": 1.0, "max_new_tokens": 4, "seed": 1},
                    },
                    "redis": {"url": redis_server.url},
                }
            ),
            replica=0,
        )
    )
    try:
        messages = (ChatMessage("system", "Answer with a number."), *QUESTION)
        recording_reward.SEEN.clear()
        result = svc.generate(
            GenerateRequest(
                rollout_id=0,
                stream=stream,
                prompts=(
                    PromptInput(messages=messages, label="5", group_id=0, metadata={"level": "1"}),
                    PromptInput(text="3 + 2 =", label="5", group_id=1),
                ),
            )
        )
        buffer = RolloutBuffer(connect(redis_server.url), stream, groups=("actor",), group="actor", consumer="a")
        batch = buffer.read([result.entry_id], timeout_s=10)[0].batch
    finally:
        svc.close()
    rendered = RENDERED.replace("You are a helpful assistant.", "Answer with a number.")
    expected = encode_texts(svc.texts.tokenizer, [rendered], special_tokens=False)[0]
    slices = list(batch.sample_slices())
    assert [batch.tokens[p].tolist() for p, _, _ in slices[:2]] == [expected, expected]
    assert recording_reward.SEEN[0] == (
        rendered,
        "5",
        {"level": "1", "messages": json.dumps([m.as_dict() for m in messages])},
    )
    assert recording_reward.SEEN[2] == ("3 + 2 =", "5", {})


def write_chat_rows(path: Path, contents: list[str]) -> Path:
    pq.write_table(
        pa.Table.from_pylist([{"prompt": [{"role": "user", "content": c}], "label": "1"} for c in contents]), path
    )
    return path


def test_preflight_checks_every_chat_row_with_the_template_applied(chatml, tmp_path):
    """Row 1's text is 20 tokens, within the limit; with the template's system turn and headers it is not."""
    data = write_chat_rows(tmp_path / "tasks.parquet", ["hi", "Ava has 3 apples " * 4, "Ben", ""])
    run = config_from_dict(
        {
            "model": {"path": str(chatml)},
            "data": {"train_path": str(data)},
            "rollout": {"rollout_batch_size": 1, "max_context_length": 48, "sampling": {"max_new_tokens": 8}},
        }
    )
    records = preflight.check_data(run)
    prompts = preflight.model_prompts(run, records, load_tokenizer(chatml))
    assert prompts["data.train_path"].texts[0].endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(
        ConfigError,
        match=r"^data.train_path: .*tasks.parquet: row 1: the prompt has \d+ tokens with "
        r"the chat template applied, more than the 40 a prompt may have .*; 1 more "
        r"row empty or too long \(row 3\)$",
    ):
        preflight.check_prompt_lengths(run, records, prompts)
    no_template = build_chatml_tokenizer(tmp_path / "plain", chat_template=None)
    run = config_from_dict(
        {"model": {"path": str(no_template)}, "data": {"train_path": str(data)}, "rollout": {"rollout_batch_size": 1}}
    )
    with pytest.raises(
        ConfigError,
        match=r"data.chat_template is auto, and the tokenizer at .*plain has no chat "
        "template",
    ):
        preflight.model_prompts(run, preflight.check_data(run), load_tokenizer(no_template))


def test_preflight_encodes_only_the_prompts_a_length_bound_cannot_clear(chatml, monkeypatch):
    """Byte length bounds the token count: rows far within the limit need no encoding (most of preflight's time),
    rows near it are counted exactly, and a bound that fails on the always-encoded sample falls back to encoding
    every row."""
    from tokenizers import normalizers

    from services.rollout import tokenizer as tokenizer_module

    tokenizer = load_tokenizer(chatml)
    texts = [f"Ava has {i} apples." for i in range(preflight.BOUND_SAMPLE + 500)] + ["apples " * 40, "Åva hås äpples."]
    n = len(texts)
    measured = preflight.measure_prompts(tokenizer, texts, [True] * n, limit=100, exact=preflight.BOUND_SAMPLE)
    exact = encode_texts(tokenizer, texts, special_tokens=False)
    assert set(measured.ids) == {*range(preflight.BOUND_SAMPLE), n - 2}  # the 280-byte row may exceed 100 tokens
    assert all(measured.ids[i] == exact[i] for i in measured.ids)
    assert all(measured.lengths[i] >= len(exact[i]) for i in range(n))
    assert measured.lengths[n - 2] == len(exact[n - 2])

    tokenizer.backend_tokenizer.normalizer = normalizers.NFC()  # Qwen2.5's: bytes still bound ASCII text
    measured = preflight.measure_prompts(tokenizer, texts, [True] * n, limit=100, exact=preflight.BOUND_SAMPLE)
    assert set(measured.ids) == {*range(preflight.BOUND_SAMPLE), n - 2, n - 1}  # the non-ASCII row is encoded
    tokenizer.backend_tokenizer.normalizer = normalizers.Replace(" ", "__")  # one the bound does not know
    assert len(preflight.measure_prompts(tokenizer, texts, [True] * n, limit=100, exact=10).ids) == n

    monkeypatch.setattr(tokenizer_module, "length_bounds", lambda tok, texts, chats: [1] * len(texts))
    tokenizer.backend_tokenizer.normalizer = None
    wrong = preflight.measure_prompts(tokenizer, texts, [True] * n, limit=100, exact=10)
    assert len(wrong.ids) == n and wrong.lengths == [len(ids) for ids in exact]

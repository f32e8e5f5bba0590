"""Token-in-token-out through the OpenAI-compatible endpoint: when an agent sends back the assistant message it got,
the next prompt holds the ids the engine generated, not a re-encoding of their text (prime-rl #1334, verl #2618).

A real byte-level BPE ChatML tokenizer (tests/helpers/chatml_tokenizer.py) with a Qwen2.5-like template that renders
`tools` and tool calls; the real uvicorn server and `openai` client; a scripted fake engine, because the test needs
turns whose ids are NOT how the tokenizer encodes their text (what real models emit all the time, at random)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from helpers.chatml_tokenizer import build_chatml_tokenizer  # noqa: E402
from helpers.scripted_engine import GenerateOnlyEngine  # noqa: E402

from services.contracts.config_loading import config_from_dict  # noqa: E402
from services.contracts.sampling_spec import SamplingSpec  # noqa: E402
from services.rollout.agents.tool_calls import hermes, llama3_json  # noqa: E402
from services.rollout.builder import build_rollout  # noqa: E402
from services.rollout.engines.interface import FINISH_STOP, SampleOutput  # noqa: E402
from services.rollout.service import RolloutService  # noqa: E402
from services.rollout.tokenizer import load_tokenizer  # noqa: E402

# Qwen2.5's tool branches in short: the tools in the system turn, a call as <tool_call> JSON, results in a user turn
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | map(attribute='function.name') | join(',')) + "
    "'<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + m.content }}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>' + ({'name': c.function.name, 'arguments': "
    "c.function.arguments} | tojson) + '</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


class ScriptedFakeEngine(GenerateOnlyEngine):
    """Call t answers turns[t] for every prompt; records every prompt it was given."""

    def __init__(self, turns: list[list[int]]):
        super().__init__(max_context=4096)
        self.turns = turns
        self.prompts: list[list[int]] = []

    def _generate_admitted(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec, budgets: Sequence[int]
    ) -> list[SampleOutput]:
        ids = self.turns[len(self.prompts)]
        self.prompts += [list(p) for p in prompts]
        return [SampleOutput(tuple(ids), tuple([-0.5] * len(ids)), FINISH_STOP, 0) for _ in prompts]


def split_letters(tokenizer: Any, text: str) -> list[int]:
    """`text` one byte-level character per token: never how BPE encodes it."""
    ids: list[int] = []
    for piece in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text):
        ids += tokenizer.convert_tokens_to_ids(list(piece[0]))
    return ids


def test_the_generated_ids_are_reused_when_the_agent_sends_its_answer_back(tmp_path: Path, redis_server):
    path = build_chatml_tokenizer(tmp_path / "tok", chat_template=None)
    (tmp_path / "tools.jinja").write_text(TOOLS_TEMPLATE)
    tokenizer = load_tokenizer(path)
    call = 'I will add. <tool_call>{"name": "add", "arguments": {"a": 3, "b": 2}}</tool_call>'
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(end, int)
    first = [*split_letters(tokenizer, call), end]
    final = [*split_letters(tokenizer, "Ava has 5 apples"), end]
    engine = ScriptedFakeEngine([first, final])
    config = config_from_dict(
        {
            "model": {"path": str(path)},
            "data": {"train_path": "unused.jsonl", "chat_template": str(tmp_path / "tools.jinja")},
            "rollout": {"openai_api": {"enabled": True, "tool_parser": "hermes"}, "sampling": {"max_new_tokens": 64}},
            "redis": {"url": redis_server.url},
        }
    )
    service = RolloutService(build_rollout(config, engine=engine, tokenizer=tokenizer))
    assert service.agents is not None
    episode = service.agents.store.open(None, SamplingSpec(max_new_tokens=64, seed=1), timeout_s=60)
    try:
        client = openai.OpenAI(
            base_url=f"{service.agents.server.url}/episodes/{episode.id}/v1", api_key="unused", max_retries=0
        )
        messages: list = [{"role": "user", "content": "Ava has 3 apples and buys 2 more. How many?"}]
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content == "I will add."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("add", {"a": 3, "b": 2})
        ]
        messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"}]
        answer = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        assert answer.choices[0].message.content == "Ava has 5 apples"
    finally:
        service.close()
    prompt0, prompt1 = engine.prompts
    # the first prompt: the template rendered with `tools`; the second: it, the ids generated, then only the tool
    # result's turn and the next header, encoded on their own
    assert prompt0 == service.texts.chat_ids(messages[:1], tools=TOOLS)
    assert str(tokenizer.decode(prompt0)).startswith("<|im_start|>system\nTools: add<|im_end|>")
    tail = service.texts.continuation_ids([{"role": "tool", "content": "5"}], turn=first, turn_ended=True, tools=TOOLS)
    assert prompt1 == [*prompt0, *first, *tail]
    assert (
        tokenizer.decode(tail)
        == "\n<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # what re-rendering the conversation would have given: other ids for the same text
    rerendered = service.texts.chat_ids(
        [messages[0], {"role": "assistant", "content": call}, {"role": "tool", "content": "5"}], tools=TOOLS
    )
    assert rerendered != prompt1 and tokenizer.decode(rerendered) == tokenizer.decode(prompt1)
    # recorded as one sample: both turns' ids with loss 1, the tool result's turn with loss 0
    [sample] = episode.training_samples(version=0)
    assert list(sample.prompt_ids) == prompt0
    assert list(sample.output.token_ids) == [*first, *tail, *final]
    assert list(sample.loss_mask) == [1] * len(first) + [0] * len(tail) + [1] * len(final)
    assert episode.reused_turns == 1 and episode.rewritten == 0


def test_tool_call_parsers_read_each_family_format_and_leave_what_is_not_a_call():
    parsed = hermes(
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "g"}</tool_call>'
    )
    assert parsed.content == "Sure." and [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("f", '{"x": 1}'),
        ("g", "{}"),
    ]
    broken = "<tool_call>{not json}</tool_call>"
    assert hermes(broken).content == broken and hermes(broken).tool_calls == ()
    llama = llama3_json('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}')
    assert llama.content == "" and [(c.name, c.arguments) for c in llama.tool_calls] == [("f", '{"x": 1}'), ("g", "{}")]
    assert llama3_json("The answer is {x}").tool_calls == () and llama3_json('{"x": 1}').content == '{"x": 1}'


@pytest.mark.parametrize(("family", "parser"), [("QWEN25", "hermes"), ("QWEN3", "hermes"), ("LLAMA3", "llama3_json")])
def test_auto_picks_the_family_tool_call_format_from_its_vocabulary(family: str, parser: str):
    from services.modelinit import families
    from services.modelinit.bpe_tokenizer import build_tokenizer
    from services.rollout.agents.tool_calls import resolve_tool_parser

    tokenizer = build_tokenizer(getattr(families, family), model_max_length=4096)
    assert resolve_tool_parser("auto", tokenizer)[0] == parser


def test_auto_reads_no_tool_calls_from_a_vocabulary_without_a_format(example_model: Path):
    from services.rollout.agents.tool_calls import resolve_tool_parser

    assert resolve_tool_parser("auto", load_tokenizer(example_model))[0] == "none"

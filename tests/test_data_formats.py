"""Task files as users bring them (services/coordinator/data.py, datafiles.py): JSONL, parquet and a saved Hugging
Face dataset give the same prompts; verl-prepared parquet rows work unchanged (message-list prompts, the dotted
label key reward_model.ground_truth); chat keys (data.chat_template none / a file, data.system_prompt); and a file
of no known format, or a bad row, is named in one line with its line (JSONL) or row (tables)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.contracts.chat_messages import ChatMessage
from services.contracts.config import ConfigError, DataConfig
from services.contracts.config_loading import config_from_dict, load_config
from services.coordinator.data import PromptRecord, load_prompts

ROWS = [
    {"prompt": [{"role": "user", "content": "Ava has 3 apples and buys 2 more. How many?"}], "label": "5", "level": 1},
    {
        "prompt": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "Ben had 9 pencils and gave 4 away. How many are left?"},
        ],
        "label": "5",
        "level": 2,
    },
]
VERL_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [
        {
            "role": "user",
            "content": "Natalia sold 48 clips in April and half as many in May. How "
            "many in all? Let's think step by step and output the final "
            'answer after "####".',
        }
    ],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "72"},
    "extra_info": {"split": "train", "index": 0, "question": "Natalia sold 48 clips..."},
}


def write(tmp_path: Path, fmt: str, rows: list[dict], name: str = "tasks") -> Path:
    match fmt:
        case "jsonl":
            path = tmp_path / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        case "parquet":
            path = tmp_path / f"{name}.parquet"
            pq.write_table(pa.Table.from_pylist(rows), path)
        case "hf_dataset":
            import datasets

            path = tmp_path / name
            datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def data(**keys) -> DataConfig:
    return DataConfig(train_path="unused", **keys)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf_dataset"])
def test_every_format_gives_the_same_chat_prompts_labels_and_metadata(tmp_path, fmt):
    records = load_prompts(str(write(tmp_path, fmt, ROWS)), data())
    assert records == [
        PromptRecord(
            text="",
            label="5",
            metadata={"level": "1"},
            messages=(ChatMessage("user", "Ava has 3 apples and buys 2 more. How many?"),),
        ),
        PromptRecord(
            text="",
            label="5",
            metadata={"level": "2"},
            messages=(
                ChatMessage("system", "Answer with a number."),
                ChatMessage("user", "Ben had 9 pencils and gave 4 away. How many are left?"),
            ),
        ),
    ]
    first_position = 1 if fmt == "jsonl" else 0  # a JSONL line as editors count, a table row as dataset[i] does
    assert [r.line for r in records] == [first_position, first_position + 1]
    assert load_prompts(str(write(tmp_path, fmt, ROWS, name="limited")), data(), limit=1) == records[:1]


def test_a_verl_prepared_parquet_file_works_unchanged(tmp_path):
    path = write(tmp_path, "parquet", [VERL_ROW, {**VERL_ROW, "reward_model": {"style": "rule", "ground_truth": "18"}}])
    first, second = load_prompts(str(path), data(label_key="reward_model.ground_truth"))
    question = (
        "Natalia sold 48 clips in April and half as many in May. How many in all? Let's think step by step "
        'and output the final answer after "####".'
    )
    assert first.messages == (ChatMessage("user", question),) and first.text == ""
    assert (first.label, second.label) == ("72", "18")
    numbers = write(tmp_path, "parquet", [{**VERL_ROW, "reward_model": {"ground_truth": 72}}], name="numbers")
    assert load_prompts(str(numbers), data(label_key="reward_model.ground_truth"))[0].label == "72"
    assert set(first.metadata) == {"data_source", "ability", "reward_model", "extra_info"}
    assert first.metadata["data_source"] == "openai/gsm8k"
    assert json.loads(first.metadata["extra_info"]) == VERL_ROW["extra_info"]
    assert json.loads(first.metadata["reward_model"])["style"] == "rule"


def test_dotted_keys_reach_into_objects_and_an_exact_key_wins(tmp_path):
    rows = [
        {
            "extra_info": {"question": "2 + 3 =", "answer": 5},
            "a.b": "flat",
            "a": {"b": "nested"},
            "answers": ["5", "five"],
        }
    ]
    path = write(tmp_path, "jsonl", rows)
    [record] = load_prompts(str(path), data(prompt_key="extra_info.question", label_key="extra_info.answer"))
    assert (record.text, record.label, record.messages) == ("2 + 3 =", "5", ())
    [record] = load_prompts(str(path), data(prompt_key="a.b", label_key="answers"))
    assert (record.text, record.label) == ("flat", '["5", "five"]')  # a list label as JSON, not a Python repr
    [record] = load_prompts(str(path), data(prompt_key="a.b", label_key="nowhere.at.all"))
    assert record.label == ""


def test_system_prompt_goes_before_chats_without_one_and_turns_text_into_a_chat(tmp_path):
    path = write(tmp_path, "jsonl", [*ROWS, {"prompt": "7 - 2 =", "label": "5"}])
    a, b, c = load_prompts(str(path), data(system_prompt="Be brief."))
    assert a.messages[0] == ChatMessage("system", "Be brief.") and a.messages[1].role == "user"
    assert b.messages[0] == ChatMessage("system", "Answer with a number.")  # the row's own system message wins
    assert c.messages == (ChatMessage("system", "Be brief."), ChatMessage("user", "7 - 2 =")) and c.text == ""
    [_, _, plain] = load_prompts(str(path), data())  # auto: a text prompt stays text
    assert (plain.text, plain.messages) == ("7 - 2 =", ())
    for every_prompt in (str(tmp_path / "t.jinja"), "tokenizer"):  # a template file, or the tokenizer's, for all
        [_, _, templated] = load_prompts(str(path), data(chat_template=every_prompt))
        assert templated.messages == (ChatMessage("user", "7 - 2 ="),) and templated.text == ""


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_bad_rows_are_named_by_line_or_row(tmp_path, fmt):
    where = "tasks.jsonl:2" if fmt == "jsonl" else "tasks.parquet: row 1"
    rows = [ROWS[0], {**ROWS[0], "prompt": [{"role": "user", "content": "hi", "tool_calls": "call()"}]}]
    with pytest.raises(ValueError, match=f"{where}: message 0 of the prompt has tool_calls"):
        load_prompts(str(write(tmp_path, fmt, rows)), data())
    first = "tasks.jsonl:1" if fmt == "jsonl" else "tasks.parquet: row 0"
    with pytest.raises(
        ValueError,
        match=f"{first}: the prompt is a list of chat messages, and data.chat_template is none; set it to auto",
    ):
        load_prompts(str(write(tmp_path, fmt, ROWS)), data(chat_template="none"))
    with pytest.raises(ValueError, match=f"{where}: the prompt is an empty list of chat messages"):
        load_prompts(str(write(tmp_path, fmt, [ROWS[0], {**ROWS[0], "prompt": []}])), data())
    missing = (
        rf"{where}: expected an object with key 'question' \(its keys: prompt, "
        if fmt == "jsonl"
        else rf"{where}: the prompt \(question\) is null"
    )  # a table has the column; the row has no value
    with pytest.raises(ValueError, match=missing):
        load_prompts(str(write(tmp_path, fmt, [{"question": "q"}, ROWS[0]])), data(prompt_key="question"))
    ints = "ints.jsonl:1" if fmt == "jsonl" else "ints.parquet: row 0"
    with pytest.raises(ValueError, match=rf"{ints}: the prompt \(label\) is int 1; expected text or a list"):
        load_prompts(str(write(tmp_path, fmt, [{"label": 1}, {"label": 2}], name="ints")), data(prompt_key="label"))


def test_pyarrow_struct_fields_a_message_does_not_use_are_ignored(tmp_path):
    """A parquet column of messages is one struct type: a field one message has is null in the others."""
    rows = [{"prompt": [{"role": "user", "content": "hi", "name": None}], "label": "1"}]
    [record] = load_prompts(str(write(tmp_path, "parquet", rows)), data())
    assert record.messages == (ChatMessage("user", "hi"),)


def test_a_file_of_no_known_format_is_named_in_one_line(tmp_path):
    cases = {
        "tasks.csv": (b"prompt,label\n1 2 =,3\n", r"tasks.csv: unsupported format \(.csv, and it is not JSON Lines\)"),
        "array.json": (b'[{"prompt": "1 2 ="}]', "holds one JSON array; Tandem reads JSON Lines"),
        "wrong.parquet": (b'{"prompt": "1 2 ="}\n', "wrong.parquet is not a parquet file"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=message):
            load_prompts(str(tmp_path / name), data())
    parquet = write(tmp_path, "parquet", ROWS)
    misnamed = tmp_path / "misnamed.jsonl"
    misnamed.write_bytes(parquet.read_bytes())
    with pytest.raises(ValueError, match=r"misnamed\.jsonl is a parquet file .* name it \.parquet"):
        load_prompts(str(misnamed), data())
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="folder is a directory but not a saved Hugging Face dataset"):
        load_prompts(str(tmp_path / "folder"), data())


def test_a_dataset_dict_asks_for_one_split_and_a_missing_datasets_package_says_what_to_install(tmp_path, monkeypatch):
    import datasets

    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS)}
    ).save_to_disk(str(tmp_path / "gsm8k"))
    with pytest.raises(
        ValueError,
        match=r"is a DatasetDict with splits train, test: point the path at one split's "
        r"directory \(e.g. .*gsm8k/train\)",
    ):
        load_prompts(str(tmp_path / "gsm8k"), data())
    assert len(load_prompts(str(tmp_path / "gsm8k" / "train"), data())) == 2
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(
        ValueError,
        match=r"is a saved Hugging Face dataset; reading it needs the datasets package: "
        r"pip install 'tandem-rl\[datasets\]'",
    ):
        load_prompts(str(tmp_path / "gsm8k" / "train"), data())


def test_chat_keys_are_checked_and_a_template_path_is_relative_to_the_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.system_prompt needs a chat template, and data\.chat_template is"):
        config_from_dict(
            {"model": {"path": "m"}, "data": {"train_path": "t", "chat_template": "none", "system_prompt": "Be brief."}}
        )
    with pytest.raises(ConfigError, match=r"data\.chat_template_kwargs: add_generation_prompt is set by Tandem"):
        config_from_dict(
            {
                "model": {"path": "m"},
                "data": {
                    "train_path": "t",
                    "chat_template_kwargs": {"add_generation_prompt": False, "enable_thinking": False},
                },
            }
        )
    (tmp_path / "run.yaml").write_text(
        "model: {path: m}\ndata: {train_path: t.parquet, chat_template: "
        "templates/chatml.jinja, chat_template_kwargs: {enable_thinking: false}}\n"
    )
    config = load_config(str(tmp_path / "run.yaml"), [])
    assert config.data.chat_template == str(tmp_path / "templates" / "chatml.jinja")
    assert config.data.chat_template_kwargs == {"enable_thinking": False}
    for mode in ("auto", "tokenizer", "none"):
        assert load_config(str(tmp_path / "run.yaml"), [f"data.chat_template={mode}"]).data.chat_template == mode


def test_a_chat_prompt_crosses_grpc_as_messages(tmp_path):
    """The coordinator sends a record as tandem.v1.Prompt; the rollout server reads it back unchanged."""
    from services.contracts.convert import from_message, to_message
    from services.contracts.gen.tandem.v1 import common_pb2
    from services.contracts.rollout_calls import PromptInput

    [record] = load_prompts(str(write(tmp_path, "jsonl", ROWS[:1])), data(system_prompt="Be brief."))
    wire = common_pb2.Prompt.FromString(to_message(record.to_input(group_id=7), common_pb2.Prompt).SerializeToString())
    prompt = from_message(wire, PromptInput)
    assert (prompt.text, prompt.label, prompt.group_id, prompt.metadata) == ("", "5", 7, {"level": "1"})
    assert (
        prompt.messages
        == record.messages
        == (ChatMessage("system", "Be brief."), ChatMessage("user", "Ava has 3 apples and buys 2 more. How many?"))
    )

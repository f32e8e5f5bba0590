"""The rank-command codec: every command survives encode -> JSON -> decode; malformed headers get one clear error.

No DeepSpeed and no process group: the codec is plain JSON and TensorData bytes (what CommandRelay carries).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest_trainer import make_batch

from services.trainer.batching import merge_batches
from services.trainer.commands import (
    CommandError,
    Load,
    Offload,
    Onload,
    PublishWeights,
    Save,
    Shutdown,
    Train,
    WeightChecksums,
    decode,
    encode,
)


def _train(values: bool) -> Train:
    batch = merge_batches([make_batch(seed=3), make_batch(rollout_id=1, seed=4)])
    if values:
        batch = batch.with_values(torch.linspace(-1, 1, batch.num_response_tokens))
    return Train(rollout_id=7, entry_ids=("1-0", "2-0"), batch=batch)


def _over_the_relay(header: dict, payloads: list[bytes]) -> tuple[dict, list[bytes]]:
    """What CommandRelay does to a command: the header as JSON text, the payloads as raw bytes."""
    return json.loads(json.dumps(header)), [bytes(p) for p in payloads]


@pytest.mark.parametrize(
    "command",
    [
        Save(directory="/ckpt/actor/rollout_00000003", rollout_id=3, export_hf=True, extra_state={"coordinator": "{}"}),
        Save(directory="/ckpt/critic/rollout_00000000", rollout_id=0, export_hf=False),
        Load(directory="/ckpt/actor/rollout_00000003"),
        WeightChecksums(),
        WeightChecksums(by_bucket=True),
        PublishWeights(version=12),
        Offload(),
        Onload(),
        Shutdown(),
    ],
    ids=lambda c: type(c).__name__,
)
def test_every_command_round_trips(command):
    header, payloads = encode(command)
    assert payloads == []
    assert decode(*_over_the_relay(header, payloads)) == command


@pytest.mark.parametrize("values", [False, True], ids=["grpo", "with_critic_values"])
def test_train_round_trips_its_batch_exactly(values):
    command = _train(values)
    header, payloads = encode(command)
    got = decode(*_over_the_relay(header, payloads))
    assert isinstance(got, Train)
    assert (got.rollout_id, got.entry_ids) == (7, ("1-0", "2-0"))
    assert (got.batch.values is None) == (not values)
    for name, tensor in vars(command.batch).items():
        if tensor is not None:
            assert getattr(got.batch, name).dtype == tensor.dtype, name
            assert torch.equal(getattr(got.batch, name), tensor), name


def test_the_header_format_is_the_relays():
    """The header every rank of a running trainer already speaks (a rolling change would split ranks)."""
    assert encode(PublishWeights(version=2))[0] == {"cmd": "weights", "mode": "publish", "version": 2}
    assert encode(WeightChecksums())[0] == {"cmd": "weights", "mode": "checksums", "by_bucket": False}
    assert encode(WeightChecksums(by_bucket=True))[0] == {"cmd": "weights", "mode": "checksums", "by_bucket": True}
    assert encode(Load(directory="/d"))[0] == {"cmd": "load", "dir": "/d"}
    header, payloads = encode(_train(False))
    assert header["cmd"] == "train" and header["fields"][:3] == ["tokens", "prompt_lengths", "response_lengths"]
    assert len(payloads) == len(header["fields"])


@pytest.mark.parametrize(
    "header,payloads,message",
    [
        (["train"], [], "must be a JSON object, got list"),
        ({}, [], "names no trainer command"),
        ({"cmd": "format_disk"}, [], "names no trainer command"),
        ({"cmd": "load"}, [], "'load' lacks 'dir'"),
        ({"cmd": "load", "dir": 3}, [], "'dir' must be str, got int"),
        ({"cmd": "weights", "mode": "publish", "version": True}, [], "'version' must be int, got bool"),
        ({"cmd": "weights", "mode": "stream"}, [], "unknown mode 'stream'"),
        (
            {"cmd": "save", "dir": "/d", "rollout_id": 1, "export_hf": False, "extra_state": {"a": 1}},
            [],
            "'extra_state' must map strings to strings",
        ),
        ({"cmd": "onload"}, [b"x"], "carries no payloads, got 1"),
        ({"cmd": "train", "rollout_id": 0, "fields": ["tokens"], "entry_ids": []}, [], "1 batch fields but 0 payloads"),
        ({"cmd": "train", "rollout_id": 0, "fields": ["weights"], "entry_ids": []}, [b""], "unknown batch fields"),
        ({"cmd": "train", "rollout_id": 0, "fields": ["tokens"], "entry_ids": []}, [b"\xff\xff"], "train:"),
    ],
)
def test_a_malformed_command_is_refused_with_a_clear_message(header, payloads, message):
    with pytest.raises(CommandError, match=message):
        decode(header, payloads)


def test_a_train_without_every_batch_field_is_refused():
    header, payloads = encode(_train(False))
    with pytest.raises(CommandError, match=r"train: .*rewards"):
        decode({**header, "fields": header["fields"][:5]}, payloads[:5])

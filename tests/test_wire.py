"""Wire format of rollout batches: round trips and every way a payload can be wrong."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from services.contracts.convert import from_message, to_message
from services.contracts.gen.tandem.v1 import common_pb2
from services.contracts.sampling_spec import SamplingParams, SamplingSpec
from services.contracts.wire import (
    FINISH_REASONS,
    RolloutBatchData,
    WireError,
    array_from_proto,
    array_to_proto,
    build_batch,
    decode_batch,
    encode_batch,
    payload_checksum,
)


def sample_batch(**overrides: Any) -> RolloutBatchData:
    kw: dict[str, Any] = dict(
        rollout_id=7,
        policy_version=3,
        prompts=[[1, 2, 3], [4, 5]],
        responses=[[6, 7], [8, 9, 10, 11]],
        log_probs=[[-0.5, -1.25], [-0.1, -0.2, -0.3, -2.0]],
        rewards=[1.0, 0.0],
        group_ids=[70, 70],
        finish_reasons=["stop", "length"],
        sample_versions=[3, 2],
        loss_masks=[[1, 1], [1, 0, 1, 1]],
        labels=["4", "2"],
        metadata={"task": "copy", "seed": "1"},
        producer="rollout-0",
        sampling=SamplingSpec(temperature=0.7, top_p=0.9, top_k=5),
    )
    kw.update(overrides)
    return build_batch(**kw)


def reencoded(payload: bytes, mutate) -> bytes:
    """Parses a payload, lets `mutate` damage the message, serializes it again (keeping num_samples last)."""
    msg = common_pb2.RolloutBatch.FromString(payload)
    mutate(msg)
    n = msg.num_samples
    msg.ClearField("num_samples")
    return msg.SerializeToString() + common_pb2.RolloutBatch(num_samples=n).SerializeToString()


# ---- round trips ---------------------------------------------------------------------------------------


def test_round_trip_keeps_every_field():
    batch = sample_batch()
    out = decode_batch(encode_batch(batch))
    for f in dataclasses.fields(RolloutBatchData):
        a, b = getattr(batch, f.name), getattr(out, f.name)
        if isinstance(a, np.ndarray):
            assert a.tolist() == b.tolist(), f.name
        else:
            assert a == b, f.name
    assert (out.tokens.dtype, out.loss_mask.dtype, out.rollout_log_probs.dtype, out.group_ids.dtype) == (
        np.int32,
        np.uint8,
        np.float32,
        np.int64,
    )
    assert out.num_samples == 2 and out.num_response_tokens == 6
    prompt, response, resp_tok = out.sample_slices()[1]
    assert out.tokens[prompt].tolist() == [4, 5] and out.tokens[response].tolist() == [8, 9, 10, 11]
    assert out.loss_mask[resp_tok].tolist() == [1, 0, 1, 1]


def test_encoding_is_deterministic():
    batch = sample_batch()
    assert encode_batch(batch) == encode_batch(batch)
    assert payload_checksum(encode_batch(batch)) == payload_checksum(encode_batch(batch))


def test_payload_is_standard_protobuf():
    """encode_batch writes the arrays by hand: a stock protobuf parser must see the same message, and a
    message serialized by protobuf itself (any field order) must decode."""
    batch = sample_batch()
    parsed = common_pb2.RolloutBatch.FromString(encode_batch(batch))
    reference = common_pb2.RolloutBatch(
        rollout_id=7,
        policy_version=3,
        num_samples=2,
        tokens=array_to_proto(batch.tokens),
        prompt_lengths=array_to_proto(batch.prompt_lengths),
        response_lengths=array_to_proto(batch.response_lengths),
        loss_mask=array_to_proto(batch.loss_mask),
        rollout_log_probs=array_to_proto(batch.rollout_log_probs),
        rewards=array_to_proto(batch.rewards),
        group_ids=array_to_proto(batch.group_ids),
        sample_versions=array_to_proto(batch.sample_versions),
        sampling_temperature=array_to_proto(np.full(2, 0.7, np.float32)),
        sampling_top_p=array_to_proto(np.full(2, 0.9, np.float32)),
        sampling_top_k=array_to_proto(np.full(2, 5, np.int32)),
        finish_reasons=[common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH],
        metadata={"task": "copy", "seed": "1"},
        created_unix_ns=batch.created_unix_ns,
        producer="rollout-0",
        labels=["4", "2"],
        token_version_runs=array_to_proto(np.array([[0, 3], [2, 2]], np.int64)),
    )
    assert parsed == reference
    out = decode_batch(reference.SerializeToString())
    assert out.tokens.tolist() == batch.tokens.tolist() and out.labels == ("4", "2")


def test_token_versions_round_trip_and_a_batch_without_them_gives_each_token_its_samples_version():
    """A sync that landed mid-generation: sample 1's last two tokens were sampled by version 3. An older producer
    sends no token_versions: every token then has its sample's version."""
    batch = sample_batch(token_versions=[[3, 3], [2, 2, 3, 3]])
    out = decode_batch(encode_batch(batch))
    assert out.versions.tolist() == [3, 3, 2, 2, 3, 3] and out.sample_versions.tolist() == [3, 2]
    sent = common_pb2.RolloutBatch.FromString(encode_batch(batch))
    assert array_from_proto(sent.token_version_runs).tolist() == [[0, 3], [2, 2], [4, 3]]  # run-length coded
    sent.ClearField("token_version_runs")
    assert decode_batch(sent.SerializeToString()).versions.tolist() == [3, 3, 2, 2, 2, 2]


@pytest.mark.parametrize("runs", [[[1, 3]], [[0, 3], [0, 2]], [[0, 3], [6, 2]], [[0, 3, 1]], []])
def test_malformed_version_runs_are_refused(runs):
    payload = reencoded(
        encode_batch(sample_batch()),
        lambda m: m.token_version_runs.CopyFrom(
            array_to_proto(
                np.array(runs, np.int64).reshape(-1, 2) if runs and len(runs[0]) == 2 else np.array(runs, np.int64)
            )
        ),
    )
    with pytest.raises(WireError, match="token_version_runs"):
        decode_batch(payload)


@pytest.mark.parametrize(
    "sample_versions, token_versions, message",
    [
        ([3, 2], [[3, 3], [3, 3, 3, 3]], "sample 1 has version 2 but its oldest token was sampled by version 3"),
        ([3, 2], [[4, 4], [2, 2, 2, 2]], "sample 0 has version 3 but its oldest token was sampled by version 4"),
        ([3, 2], [[3], [2, 2, 2, 2]], "token_versions has 5 entries, expected 6"),
    ],
)
def test_token_versions_that_disagree_with_the_sample_versions_are_refused(sample_versions, token_versions, message):
    with pytest.raises(WireError, match=message):
        encode_batch(sample_batch(sample_versions=sample_versions, token_versions=token_versions))


def test_wider_input_dtypes_are_cast_to_the_wire_dtypes():
    b = sample_batch()
    wide = dataclasses.replace(
        b,
        tokens=b.tokens.astype(np.int64),
        loss_mask=b.loss_mask.astype(bool),
        rewards=b.rewards.astype(np.float64),
        group_ids=b.group_ids.astype(np.int32),
        rollout_log_probs=b.rollout_log_probs.astype(np.float64),
    )
    assert encode_batch(wide) == encode_batch(b)


def test_batch_without_labels_and_an_empty_response():
    batch = sample_batch(responses=[[6, 7], []], log_probs=[[-0.5, -1.0], []], loss_masks=None, labels=None)
    out = decode_batch(encode_batch(batch))
    assert out.labels == () and out.response_lengths.tolist() == [2, 0] and out.loss_mask.tolist() == [1, 1]


@pytest.mark.parametrize("dtype", ["int32", "int64", "float32", "uint8", "float64", "int8", "float16", "bool"])
def test_array_round_trip(dtype):
    arr = (np.arange(24).reshape(2, 3, 4) % 2).astype(dtype)
    out = array_from_proto(common_pb2.TensorData.FromString(array_to_proto(arr).SerializeToString()))
    assert out.dtype == arr.dtype and out.shape == (2, 3, 4) and out.tobytes() == arr.tobytes()


def test_big_endian_and_non_contiguous_arrays_travel_as_little_endian():
    arr = np.arange(10, dtype=">i4")[::2]
    out = array_from_proto(array_to_proto(arr))
    assert out.dtype == np.dtype("<i4") and out.tolist() == [0, 2, 4, 6, 8]
    assert array_from_proto(array_to_proto(np.zeros((0, 5), np.float32))).shape == (0, 5)


# ---- validation errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(response_lengths=np.array([2], np.int32)), r"response_lengths has shape \(1,\), expected \(2,\)"),
        (dict(rewards=np.array([1.0, 0.0, 1.0], np.float32)), r"rewards has shape \(3,\), expected \(2,\)"),
        (dict(group_ids=np.array([1], np.int64)), r"group_ids has shape"),
        (dict(sample_versions=np.zeros((2, 1), np.int64)), r"sample_versions has shape \(2, 1\)"),
        (dict(tokens=np.arange(10, dtype=np.int32)), r"10 tokens, lengths sum to 11"),
        (dict(loss_mask=np.ones(5, np.uint8)), r"loss_mask has 5 entries, expected 6 \(one per response token\)"),
        (dict(rollout_log_probs=np.zeros(7, np.float32)), r"rollout_log_probs has 7 entries, expected 6"),
        (dict(finish_reasons=("stop",)), r"1 finish reasons for 2 samples"),
        (dict(labels=("a", "b", "c")), r"3 labels for 2 samples"),
        (dict(prompt_lengths=np.array([-1, 3], np.int32)), r"negative prompt or response length"),
        (dict(rewards=np.array([np.nan, 0.0], np.float32)), r"rewards contain NaN or inf"),
        (dict(rewards=np.array([np.inf, 0.0], np.float32)), r"rewards contain NaN or inf"),
        (dict(rollout_log_probs=np.array([np.nan] + [0.0] * 5, np.float32)), r"rollout_log_probs contain NaN"),
        (dict(tokens=np.zeros(11, np.float32)), r"tokens has dtype float32, expected int32"),
        (dict(rollout_log_probs=np.zeros(6, np.int32)), r"rollout_log_probs has dtype int32, expected float32"),
        (dict(tokens=list(range(11))), r"tokens is a list, expected a numpy array"),
        (dict(finish_reasons=("stop", "eos")), r"unknown finish reason\(s\) \['eos'\]"),
        (
            dict(sampling_temperature=np.array([0.7], np.float32)),
            r"sampling_temperature has shape \(1,\), expected \(2,\)",
        ),
        (dict(sampling_temperature=np.array([0.7, -1.0], np.float32)), r"sampling_temperature must be finite and >= 0"),
        (dict(sampling_temperature=np.array([0.7, np.nan], np.float32)), r"sampling_temperature must be finite"),
        (dict(sampling_top_p=np.array([0.0, 0.9], np.float32)), r"sampling_top_p must lie in \(0, 1\]"),
        (dict(sampling_top_p=np.array([1.5, 0.9], np.float32)), r"sampling_top_p must lie in \(0, 1\]"),
        (dict(sampling_top_k=np.array([-1, 5], np.int32)), r"sampling_top_k must be >= 0"),
        (dict(sampling_top_k=np.array([1.5, 5.0], np.float32)), r"sampling_top_k has dtype float32, expected int32"),
    ],
)
def test_invalid_batches_are_refused_by_encode(change, message):
    bad = dataclasses.replace(sample_batch(), **change)
    with pytest.raises(WireError, match=message) as err:
        encode_batch(bad)
    assert str(err.value).startswith("batch 7: ")  # names the batch


def test_build_batch_refuses_lists_of_different_lengths():
    with pytest.raises(WireError, match="per-sample lists differ in length"):
        sample_batch(rewards=[1.0])


def test_unsupported_dtype_cannot_be_sent():
    with pytest.raises(WireError, match="dtype complex64 cannot be sent"):
        array_to_proto(np.zeros(3, np.complex64))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: setattr(m.tokens, "dtype", "complex128"), r"batch 7 tokens: dtype 'complex128', expected 'int32'"),
        (lambda m: setattr(m.rewards, "dtype", "int32"), r"batch 7 rewards: dtype 'int32', expected 'float32'"),
        (lambda m: m.tokens.shape.append(2), r"tokens: shape \(11, 2\) of int32 needs 88 bytes, got 44"),
        (lambda m: setattr(m.rewards, "data", m.rewards.data[:-1]), r"rewards: shape \(2,\) of float32 needs 8 bytes"),
        (lambda m: m.response_lengths.shape.__setitem__(0, -2), r"negative dimension"),
        (lambda m: m.ClearField("loss_mask"), r"batch 7 loss_mask: missing"),
        (
            lambda m: m.ClearField("sampling_top_p"),
            r"batch 7 sampling_top_p: missing \(the producer does not say which "
            r"distribution its samples were drawn from\)",
        ),
        (lambda m: m.finish_reasons.append(common_pb2.FINISH_REASON_UNSPECIFIED), r"unknown finish reason 0"),
        (lambda m: setattr(m, "num_samples", 3), r"header says 3 samples, arrays hold 2"),
        (lambda m: m.rewards.CopyFrom(array_to_proto(np.array([1.0, np.nan], np.float32))), r"rewards contain NaN"),
    ],
)
def test_invalid_payloads_are_refused_by_decode(mutate, message):
    payload = reencoded(encode_batch(sample_batch()), mutate)
    with pytest.raises(WireError, match=message):
        decode_batch(payload)


def test_every_truncation_is_detected():
    payload = encode_batch(sample_batch())
    for cut in range(len(payload)):
        with pytest.raises(WireError):
            decode_batch(payload[:cut])
    with pytest.raises(WireError, match="truncated payload"):  # cut at a field boundary: the trailer is gone
        decode_batch(payload[:-2])


@pytest.mark.parametrize("seed", range(20))
def test_garbage_bytes_are_refused(seed):
    garbage = np.random.default_rng(seed).integers(0, 256, size=64 + 50 * seed, dtype=np.uint8).tobytes()
    with pytest.raises(WireError):
        decode_batch(garbage)


def test_obvious_garbage_has_a_clear_message():
    with pytest.raises(WireError, match="not a valid protobuf message"):
        decode_batch(b"\xff" * 32)
    with pytest.raises(WireError, match="tokens: missing"):
        decode_batch(b"")  # parses as an empty message
    other = common_pb2.WeightSyncPlan(version=1, transport="gloo").SerializeToString()
    with pytest.raises(WireError):  # a different message type
        decode_batch(other)


def test_finish_reason_names_match_the_proto_enum():
    assert {common_pb2.FinishReason.Name(v) for v in FINISH_REASONS.values()} == {
        f"FINISH_REASON_{k.upper()}" for k in FINISH_REASONS
    }


def test_sampling_spec_round_trips_through_the_proto():
    spec = SamplingSpec(
        temperature=0.75,
        top_p=0.5,
        top_k=5,
        max_new_tokens=9,
        stop_token_ids=(3, 4),
        seed=8,
        stop=("####", "</answer>"),
    )
    default = SamplingSpec(stop=("\n\n",))
    wire = common_pb2.SamplingParams.FromString(
        to_message(spec.params(), common_pb2.SamplingParams).SerializeToString()
    )
    assert SamplingSpec.from_params(from_message(wire, SamplingParams), default=default) == spec
    assert SamplingSpec.from_params(SamplingParams(temperature=1.0), default=default).stop == ("\n\n",)
    with pytest.raises(ValueError, match=r"sampling\.stop names a string twice"):
        SamplingSpec.from_params(SamplingParams(stop=("a", "a")), default=default)

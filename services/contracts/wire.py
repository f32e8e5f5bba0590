"""Wire format of rollout batches: protobuf with raw little-endian arrays, plus a checksum.

Arrays travel as `TensorData` (dtype, shape, bytes) — packed, zero-parse on decode (np.frombuffer) and
never pickled. `decode_batch` validates every length relation so a malformed entry fails loudly at the
consumer instead of training on garbage.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

import numpy as np
from google.protobuf.message import DecodeError

from services.contracts.gen.tandem.v1 import common_pb2
from services.contracts.sampling_spec import SamplingSpec


class WireError(ValueError):
    """A batch or tensor payload that cannot be decoded or is inconsistent."""


# What a batch's rollout log-probs are of (docs/algorithms.md): the sampling distribution (truncated, renormalised;
# the native engine, and every batch without the field) or the tempered one, log_softmax(logits / T) (SGLang).
LOGPROB_SPACES = {"sampling": common_pb2.LOGPROB_SPACE_SAMPLING, "tempered": common_pb2.LOGPROB_SPACE_TEMPERED}
_LOGPROB_SPACE_NAMES = {v: k for k, v in LOGPROB_SPACES.items()}

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
_FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}

_NP_DTYPES = {
    "int32": np.int32,
    "int64": np.int64,
    "float32": np.float32,
    "uint8": np.uint8,
    "float64": np.float64,
    "int8": np.int8,
    "float16": np.float16,
    "bool": np.bool_,
}


def array_to_proto(array: np.ndarray) -> common_pb2.TensorData:
    array = np.ascontiguousarray(array)
    name = array.dtype.name
    if name not in _NP_DTYPES:
        raise WireError(f"dtype {name} cannot be sent as TensorData")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return common_pb2.TensorData(dtype=name, shape=list(array.shape), data=array.tobytes())


def array_from_proto(tensor: common_pb2.TensorData, *, what: str = "tensor") -> np.ndarray:
    dtype = _NP_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"{what}: unknown dtype {tensor.dtype!r}")
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"{what}: negative dimension in shape {shape}")
    data = tensor.data  # one access: the upb runtime copies a bytes field on every access
    expected = math.prod(shape) * np.dtype(dtype).itemsize
    if expected != len(data):
        raise WireError(f"{what}: shape {shape} of {tensor.dtype} needs {expected} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


# What each array of a batch is on the wire, and which numpy kinds a batch may hold before encoding.
_WIRE_DTYPES = {
    "tokens": "int32",
    "prompt_lengths": "int32",
    "response_lengths": "int32",
    "loss_mask": "uint8",
    "rollout_log_probs": "float32",
    "rewards": "float32",
    "group_ids": "int64",
    "sample_versions": "int64",
    "sampling_temperature": "float32",
    "sampling_top_p": "float32",
    "sampling_top_k": "int32",
    "token_versions": "int64",
}
_FIELD_KINDS = {
    "tokens": "iu",
    "prompt_lengths": "iu",
    "response_lengths": "iu",
    "loss_mask": "iub",
    "rollout_log_probs": "f",
    "rewards": "fiu",
    "group_ids": "iu",
    "sample_versions": "iu",
    "sampling_temperature": "fiu",
    "sampling_top_p": "fiu",
    "sampling_top_k": "iu",
    "token_versions": "iu",
}
_PER_SAMPLE = (
    "response_lengths",
    "rewards",
    "group_ids",
    "sample_versions",
    "sampling_temperature",
    "sampling_top_p",
    "sampling_top_k",
)
_PER_TOKEN = ("loss_mask", "rollout_log_probs", "token_versions")


def payload_checksum(payload: bytes | memoryview) -> str:
    return f"crc32:{zlib.crc32(payload):08x}"


@dataclass(frozen=True)
class RolloutBatchData:
    """One rollout step's samples, flattened. Response-token arrays are concatenated over samples."""

    rollout_id: int
    policy_version: int
    tokens: np.ndarray  # int32, prompt+response of every sample, concatenated
    prompt_lengths: np.ndarray  # int32 [n]
    response_lengths: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # uint8 [sum(response_lengths)]
    rollout_log_probs: np.ndarray  # float32 [sum(response_lengths)]: each token's behaviour log-prob
    rewards: np.ndarray  # float32 [n]
    group_ids: np.ndarray  # int64 [n]
    sample_versions: np.ndarray  # int64 [n]: the version of the sample's oldest token
    # The distribution each sample was drawn from (services.tensors.sampling_dist): the trainer scores it under it.
    sampling_temperature: np.ndarray  # float32 [n], 0 = greedy
    sampling_top_p: np.ndarray  # float32 [n], 1 = off
    sampling_top_k: np.ndarray  # int32 [n], 0 = off
    finish_reasons: tuple[str, ...]  # "stop" | "length" | "abort"
    labels: tuple[str, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict)
    producer: str = ""
    created_unix_ns: int = 0
    logprob_space: str = "sampling"  # what rollout_log_probs are of: "sampling" | "tempered" (LOGPROB_SPACES)
    # int64 [sum(response_lengths)]: the weight version that sampled each token. None (a batch built without it,
    # or an older producer's): every token has its sample's version.
    token_versions: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.token_versions is None:
            lengths = np.asarray(self.response_lengths)
            versions = np.asarray(self.sample_versions)
            filled = (
                np.repeat(versions, lengths)
                if lengths.shape == versions.shape and (lengths >= 0).all()
                else np.zeros(0, dtype=np.int64)
            )  # inconsistent lengths: validate() names the problem
            object.__setattr__(self, "token_versions", filled.astype(np.int64, copy=False))

    @property
    def versions(self) -> np.ndarray:
        """token_versions, never None (the type checker's view of __post_init__)."""
        assert self.token_versions is not None
        return self.token_versions

    @property
    def num_samples(self) -> int:
        return int(self.prompt_lengths.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_lengths.sum())

    def validate(self) -> None:
        """Raises WireError naming the first inconsistency found (checks in this order)."""
        for check in _BATCH_CHECKS:
            check(self)

    def sample_slices(self) -> list[tuple[slice, slice, slice]]:
        """Per sample: (prompt slice of tokens, response slice of tokens, slice of response-token arrays)."""
        out, tok, resp = [], 0, 0
        for p, r in zip(self.prompt_lengths.tolist(), self.response_lengths.tolist(), strict=True):
            out.append((slice(tok, tok + p), slice(tok + p, tok + p + r), slice(resp, resp + r)))
            tok += p + r
            resp += r
        return out


def _check_dtypes(batch: RolloutBatchData) -> None:
    for name, kinds in _FIELD_KINDS.items():
        arr = getattr(batch, name)
        if not isinstance(arr, np.ndarray):
            raise WireError(f"batch {batch.rollout_id}: {name} is a {type(arr).__name__}, expected a numpy array")
        if arr.dtype.kind not in kinds:
            raise WireError(f"batch {batch.rollout_id}: {name} has dtype {arr.dtype}, expected {_WIRE_DTYPES[name]}")


def _check_per_sample_shapes(batch: RolloutBatchData) -> None:
    if batch.prompt_lengths.ndim != 1:
        raise WireError(
            f"batch {batch.rollout_id}: prompt_lengths has shape {batch.prompt_lengths.shape}, expected one dimension"
        )
    n = batch.num_samples
    for name in _PER_SAMPLE:
        arr = getattr(batch, name)
        if arr.ndim != 1 or arr.shape[0] != n:
            raise WireError(f"batch {batch.rollout_id}: {name} has shape {arr.shape}, expected ({n},)")


def _check_per_sample_strings(batch: RolloutBatchData) -> None:
    n = batch.num_samples
    if len(batch.finish_reasons) != n:
        raise WireError(f"batch {batch.rollout_id}: {len(batch.finish_reasons)} finish reasons for {n} samples")
    unknown = sorted({r for r in batch.finish_reasons if r not in FINISH_REASONS})
    if unknown:
        raise WireError(
            f"batch {batch.rollout_id}: unknown finish reason(s) {unknown}, expected one of {sorted(FINISH_REASONS)}"
        )
    if batch.labels and len(batch.labels) != n:
        raise WireError(f"batch {batch.rollout_id}: {len(batch.labels)} labels for {n} samples")
    if batch.logprob_space not in LOGPROB_SPACES:
        raise WireError(
            f"batch {batch.rollout_id}: unknown logprob_space {batch.logprob_space!r}, expected one of "
            f"{sorted(LOGPROB_SPACES)}"
        )


def _check_token_counts(batch: RolloutBatchData) -> None:
    """The concatenated arrays hold exactly what the per-sample lengths say."""
    if (batch.prompt_lengths < 0).any() or (batch.response_lengths < 0).any():
        raise WireError(f"batch {batch.rollout_id}: negative prompt or response length")
    total = int(batch.prompt_lengths.sum()) + int(batch.response_lengths.sum())
    if batch.tokens.ndim != 1 or batch.tokens.shape[0] != total:
        raise WireError(f"batch {batch.rollout_id}: {batch.tokens.shape[0]} tokens, lengths sum to {total}")
    n_resp = int(batch.response_lengths.sum())
    for name in _PER_TOKEN:
        arr = getattr(batch, name)
        if arr.ndim != 1 or arr.shape[0] != n_resp:
            raise WireError(
                f"batch {batch.rollout_id}: {name} has {arr.shape[0]} entries, "
                f"expected {n_resp} (one per response token)"
            )


def _check_finite(batch: RolloutBatchData) -> None:
    if not np.isfinite(batch.rewards).all():
        raise WireError(f"batch {batch.rollout_id}: rewards contain NaN or inf")
    if np.isnan(batch.rollout_log_probs).any():
        raise WireError(f"batch {batch.rollout_id}: rollout_log_probs contain NaN")


def _check_sampling(batch: RolloutBatchData) -> None:
    temperature, top_p = batch.sampling_temperature, batch.sampling_top_p
    if not (np.isfinite(temperature) & (temperature >= 0)).all():
        raise WireError(f"batch {batch.rollout_id}: sampling_temperature must be finite and >= 0")
    if not ((top_p > 0) & (top_p <= 1)).all():  # NaN fails both comparisons
        raise WireError(f"batch {batch.rollout_id}: sampling_top_p must lie in (0, 1]")
    if (batch.sampling_top_k < 0).any():
        raise WireError(f"batch {batch.rollout_id}: sampling_top_k must be >= 0 (0 = off)")


def _check_versions(batch: RolloutBatchData) -> None:
    """A sample's version is the one of its oldest token (the stale rule drops a sample by it)."""
    lengths = batch.response_lengths.astype(np.int64)
    has_tokens = lengths > 0
    if not has_tokens.any():
        return
    starts = np.cumsum(lengths) - lengths
    oldest = np.minimum.reduceat(batch.versions, starts[has_tokens])
    differ = np.flatnonzero(oldest != batch.sample_versions[has_tokens])
    if differ.size:
        i = int(np.flatnonzero(has_tokens)[differ[0]])
        raise WireError(
            f"batch {batch.rollout_id}: sample {i} has version {int(batch.sample_versions[i])} but its "
            f"oldest token was sampled by version {int(oldest[differ[0]])} (token_versions)"
        )


_BATCH_CHECKS: tuple[Callable[[RolloutBatchData], None], ...] = (
    _check_dtypes,
    _check_per_sample_shapes,
    _check_per_sample_strings,
    _check_token_counts,
    _check_finite,
    _check_sampling,
    _check_versions,
)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tensor_field(field_number: int, array: np.ndarray, dtype: str) -> list[bytes | memoryview]:
    """One `TensorData` submessage as protobuf wire bytes, the array's buffer referenced, not copied."""
    arr = np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<"))
    header = common_pb2.TensorData(dtype=dtype, shape=list(arr.shape)).SerializeToString()
    data = arr.data.cast("B")
    body: list[bytes | memoryview] = [header]
    if data.nbytes:
        body += [b"\x1a", _varint(data.nbytes), data]  # field 3: data
    inner_len = sum(len(x) if isinstance(x, bytes) else x.nbytes for x in body)
    return [_varint(field_number << 3 | 2), _varint(inner_len), *body]


_TENSOR_FIELDS = tuple(
    (common_pb2.RolloutBatch.DESCRIPTOR.fields_by_name[name].number, name, dtype)
    for name, dtype in _WIRE_DTYPES.items()
    if name != "token_versions"
)  # sent run-length coded
_RUNS_FIELD = common_pb2.RolloutBatch.DESCRIPTOR.fields_by_name["token_version_runs"].number


def version_runs(versions: np.ndarray) -> np.ndarray:
    """int64 [runs, 2]: (first token, version) of every run of equal versions (the wire's token_version_runs)."""
    starts = np.flatnonzero(np.diff(versions, prepend=versions[:1] - 1)) if versions.size else np.zeros(0, np.int64)
    return (
        np.stack([starts, versions[starts]], axis=1).astype(np.int64) if versions.size else np.zeros((0, 2), np.int64)
    )


def versions_from_runs(runs: np.ndarray, num_tokens: int, *, what: str) -> np.ndarray:
    """The per-token versions of `runs` (version_runs' inverse); WireError when they do not cover num_tokens."""
    if runs.ndim != 2 or runs.shape[1] != 2:
        raise WireError(f"{what}: shape {runs.shape}, expected (runs, 2)")
    starts = runs[:, 0]
    if (
        (num_tokens == 0) != (starts.size == 0)
        or (starts.size and (starts[0] != 0 or starts[-1] >= num_tokens))
        or (np.diff(starts) <= 0).any()
    ):
        raise WireError(f"{what}: runs must start at token 0, strictly increase and stay below {num_tokens} tokens")
    return np.repeat(runs[:, 1], np.diff(starts, append=num_tokens))


def encode_batch(batch: RolloutBatchData) -> bytes:
    """Serialized `RolloutBatch` (standard protobuf: any parser reads it into the message).

    The arrays are written straight from their buffers (one copy in all), after the small fields, and
    `num_samples` comes last (parsers accept fields in any order), so a payload cut at any byte fails to
    decode instead of silently losing trailing fields. The output is deterministic."""
    batch.validate()
    head = common_pb2.RolloutBatch(
        rollout_id=batch.rollout_id,
        policy_version=batch.policy_version,
        finish_reasons=[FINISH_REASONS[r] for r in batch.finish_reasons],
        metadata=batch.metadata,
        created_unix_ns=batch.created_unix_ns or time.time_ns(),
        producer=batch.producer,
        labels=list(batch.labels),
        logprob_space=LOGPROB_SPACES[batch.logprob_space],
    ).SerializeToString(deterministic=True)
    parts: list[bytes | memoryview] = [head]
    for number, name, dtype in _TENSOR_FIELDS:
        parts += _tensor_field(number, getattr(batch, name), dtype)
    parts += _tensor_field(_RUNS_FIELD, version_runs(batch.versions.astype(np.int64, copy=False)), "int64")
    parts.append(common_pb2.RolloutBatch(num_samples=batch.num_samples).SerializeToString())
    return b"".join(parts)


def decode_batch(payload: bytes) -> RolloutBatchData:
    msg = common_pb2.RolloutBatch()
    try:
        msg.ParseFromString(payload)
    except DecodeError as exc:
        raise WireError(f"rollout batch is not a valid protobuf message: {exc}") from None
    try:
        reasons = tuple(_FINISH_NAMES[r] for r in msg.finish_reasons)
    except KeyError as exc:
        raise WireError(f"batch {msg.rollout_id}: unknown finish reason {exc}") from None
    space = _LOGPROB_SPACE_NAMES.get(msg.logprob_space)
    if space is None:
        raise WireError(f"batch {msg.rollout_id}: unknown logprob_space {msg.logprob_space} (a newer producer?)")

    def arr(name: str) -> np.ndarray:
        what = f"batch {msg.rollout_id} {name}"
        if not msg.HasField(name):
            why = (
                "the producer does not say which distribution its samples were drawn from"
                if name.startswith("sampling_")
                else "truncated or not a rollout batch"
            )
            raise WireError(f"{what}: missing ({why})")
        tensor = getattr(msg, name)
        if tensor.dtype != _WIRE_DTYPES[name]:
            raise WireError(f"{what}: dtype {tensor.dtype!r}, expected {_WIRE_DTYPES[name]!r}")
        return array_from_proto(tensor, what=what)

    tokens = arr("tokens")  # read first: a message that is no batch at all fails on its first field
    response_lengths = arr("response_lengths")
    batch = RolloutBatchData(
        rollout_id=msg.rollout_id,
        policy_version=msg.policy_version,
        tokens=tokens,
        prompt_lengths=arr("prompt_lengths"),
        response_lengths=response_lengths,
        loss_mask=arr("loss_mask"),
        rollout_log_probs=arr("rollout_log_probs"),
        rewards=arr("rewards"),
        group_ids=arr("group_ids"),
        sample_versions=arr("sample_versions"),
        sampling_temperature=arr("sampling_temperature"),
        sampling_top_p=arr("sampling_top_p"),
        sampling_top_k=arr("sampling_top_k"),
        finish_reasons=reasons,
        labels=tuple(msg.labels),
        metadata=dict(msg.metadata),
        producer=msg.producer,
        created_unix_ns=msg.created_unix_ns,
        logprob_space=space,
        token_versions=_token_versions(msg, num_tokens=int(response_lengths.sum())),
    )
    if msg.num_samples == 0 and batch.num_samples > 0:
        raise WireError(f"batch {msg.rollout_id}: num_samples (the last field) is missing: truncated payload")
    if msg.num_samples != batch.num_samples:
        raise WireError(
            f"batch {msg.rollout_id}: header says {msg.num_samples} samples, arrays hold {batch.num_samples}"
        )
    batch.validate()
    return batch


def _token_versions(msg: common_pb2.RolloutBatch, *, num_tokens: int) -> np.ndarray | None:
    """The per-token versions of the message's runs; None when it has none (an older producer)."""
    if not msg.HasField("token_version_runs"):
        return None
    what = f"batch {msg.rollout_id} token_version_runs"
    if msg.token_version_runs.dtype != "int64":
        raise WireError(f"{what}: dtype {msg.token_version_runs.dtype!r}, expected 'int64'")
    return versions_from_runs(array_from_proto(msg.token_version_runs, what=what), num_tokens, what=what)


class SamplingArrays(TypedDict):
    """A batch's per-sample sampling fields (RolloutBatchData's sampling_*)."""

    sampling_temperature: np.ndarray
    sampling_top_p: np.ndarray
    sampling_top_k: np.ndarray


def sampling_arrays(n: int, sampling: SamplingSpec) -> SamplingArrays:
    """The per-sample sampling fields of n samples drawn from one distribution."""
    return {
        "sampling_temperature": np.full(n, sampling.temperature, dtype=np.float32),
        "sampling_top_p": np.full(n, sampling.top_p, dtype=np.float32),
        "sampling_top_k": np.full(n, sampling.top_k, dtype=np.int32),
    }


def build_batch(
    *,
    rollout_id: int,
    policy_version: int,
    prompts: list[list[int]],
    responses: list[list[int]],
    log_probs: list[list[float]],
    rewards: list[float],
    group_ids: list[int],
    finish_reasons: list[str],
    sampling: SamplingSpec,
    sample_versions: list[int] | None = None,
    loss_masks: list[list[int]] | None = None,
    labels: list[str] | None = None,
    metadata: dict[str, str] | None = None,
    producer: str = "",
    logprob_space: str = "sampling",
    token_versions: list[list[int]] | None = None,
) -> RolloutBatchData:
    """Builds a batch from per-sample lists (what an engine naturally produces); `sampling` is the distribution
    every sample was drawn from, `logprob_space` what the engine's log-probs are of, `token_versions` the version
    that sampled each response token (None: each token its sample's version)."""
    n = len(prompts)
    if not (len(responses) == len(log_probs) == len(rewards) == len(group_ids) == len(finish_reasons) == n):
        raise WireError("build_batch: per-sample lists differ in length")
    tokens = np.fromiter((t for p, r in zip(prompts, responses, strict=True) for t in (*p, *r)), dtype=np.int32)
    masks = loss_masks or [[1] * len(r) for r in responses]
    return RolloutBatchData(
        rollout_id=rollout_id,
        policy_version=policy_version,
        tokens=tokens,
        prompt_lengths=np.array([len(p) for p in prompts], dtype=np.int32),
        response_lengths=np.array([len(r) for r in responses], dtype=np.int32),
        loss_mask=np.fromiter((m for ms in masks for m in ms), dtype=np.uint8),
        rollout_log_probs=np.fromiter((x for lp in log_probs for x in lp), dtype=np.float32),
        rewards=np.asarray(rewards, dtype=np.float32),
        group_ids=np.asarray(group_ids, dtype=np.int64),
        sample_versions=np.asarray(
            sample_versions if sample_versions is not None else [policy_version] * n, dtype=np.int64
        ),
        **sampling_arrays(n, sampling),
        finish_reasons=tuple(finish_reasons),
        labels=tuple(labels or ()),
        metadata=dict(metadata or {}),
        producer=producer,
        created_unix_ns=time.time_ns(),
        logprob_space=logprob_space,
        token_versions=None
        if token_versions is None
        else np.fromiter((v for vs in token_versions for v in vs), dtype=np.int64),
    )

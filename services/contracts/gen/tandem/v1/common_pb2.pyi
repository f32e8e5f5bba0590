from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class LogProbSpace(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROB_SPACE_SAMPLING: _ClassVar[LogProbSpace]
    LOGPROB_SPACE_TEMPERED: _ClassVar[LogProbSpace]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
LOGPROB_SPACE_SAMPLING: LogProbSpace
LOGPROB_SPACE_TEMPERED: LogProbSpace

class TensorData(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RolloutBatch(_message.Message):
    __slots__ = ("rollout_id", "policy_version", "num_samples", "tokens", "prompt_lengths", "response_lengths", "loss_mask", "rollout_log_probs", "rewards", "group_ids", "sample_versions", "finish_reasons", "metadata", "created_unix_ns", "producer", "labels", "sampling_temperature", "sampling_top_p", "sampling_top_k", "logprob_space", "token_version_runs")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_TOP_P_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_TOP_K_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_SPACE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSION_RUNS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: int
    policy_version: int
    num_samples: int
    tokens: TensorData
    prompt_lengths: TensorData
    response_lengths: TensorData
    loss_mask: TensorData
    rollout_log_probs: TensorData
    rewards: TensorData
    group_ids: TensorData
    sample_versions: TensorData
    finish_reasons: _containers.RepeatedScalarFieldContainer[FinishReason]
    metadata: _containers.ScalarMap[str, str]
    created_unix_ns: int
    producer: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    sampling_temperature: TensorData
    sampling_top_p: TensorData
    sampling_top_k: TensorData
    logprob_space: LogProbSpace
    token_version_runs: TensorData
    def __init__(self, rollout_id: _Optional[int] = ..., policy_version: _Optional[int] = ..., num_samples: _Optional[int] = ..., tokens: _Optional[_Union[TensorData, _Mapping]] = ..., prompt_lengths: _Optional[_Union[TensorData, _Mapping]] = ..., response_lengths: _Optional[_Union[TensorData, _Mapping]] = ..., loss_mask: _Optional[_Union[TensorData, _Mapping]] = ..., rollout_log_probs: _Optional[_Union[TensorData, _Mapping]] = ..., rewards: _Optional[_Union[TensorData, _Mapping]] = ..., group_ids: _Optional[_Union[TensorData, _Mapping]] = ..., sample_versions: _Optional[_Union[TensorData, _Mapping]] = ..., finish_reasons: _Optional[_Iterable[_Union[FinishReason, str]]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., created_unix_ns: _Optional[int] = ..., producer: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., sampling_temperature: _Optional[_Union[TensorData, _Mapping]] = ..., sampling_top_p: _Optional[_Union[TensorData, _Mapping]] = ..., sampling_top_k: _Optional[_Union[TensorData, _Mapping]] = ..., logprob_space: _Optional[_Union[LogProbSpace, str]] = ..., token_version_runs: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("text", "token_ids", "label", "group_id", "metadata", "messages")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    label: str
    group_id: int
    metadata: _containers.ScalarMap[str, str]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., label: _Optional[str] = ..., group_id: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed", "ignore_eos", "stop")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset_bytes", "nbytes", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset_bytes: int
    nbytes: int
    checksum: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset_bytes: _Optional[int] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[str] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "device_uuid")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class WeightBucket(_message.Message):
    __slots__ = ("index", "dtype", "nbytes", "tensors", "ipc", "sglang_payloads", "checksum")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    SGLANG_PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    index: int
    dtype: str
    nbytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    ipc: CudaIpcHandle
    sglang_payloads: _containers.RepeatedScalarFieldContainer[str]
    checksum: str
    def __init__(self, index: _Optional[int] = ..., dtype: _Optional[str] = ..., nbytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., sglang_payloads: _Optional[_Iterable[str]] = ..., checksum: _Optional[str] = ...) -> None: ...

class WeightSyncPlan(_message.Message):
    __slots__ = ("version", "transport", "buckets", "group_name", "master_addr", "master_port", "world_size", "disk_path", "timeout_s", "verify", "total_bytes", "trainer_id", "buffers_freed_after", "sglang_load_format", "verify_by_bucket", "checksum_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DISK_PATH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FREED_AFTER_FIELD_NUMBER: _ClassVar[int]
    SGLANG_LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_BY_BUCKET_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    transport: str
    buckets: _containers.RepeatedCompositeFieldContainer[WeightBucket]
    group_name: str
    master_addr: str
    master_port: int
    world_size: int
    disk_path: str
    timeout_s: float
    verify: bool
    total_bytes: int
    trainer_id: str
    buffers_freed_after: bool
    sglang_load_format: str
    verify_by_bucket: bool
    checksum_s: float
    def __init__(self, version: _Optional[int] = ..., transport: _Optional[str] = ..., buckets: _Optional[_Iterable[_Union[WeightBucket, _Mapping]]] = ..., group_name: _Optional[str] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., disk_path: _Optional[str] = ..., timeout_s: _Optional[float] = ..., verify: _Optional[bool] = ..., total_bytes: _Optional[int] = ..., trainer_id: _Optional[str] = ..., buffers_freed_after: _Optional[bool] = ..., sglang_load_format: _Optional[str] = ..., verify_by_bucket: _Optional[bool] = ..., checksum_s: _Optional[float] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Ack(_message.Message):
    __slots__ = ("ok", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

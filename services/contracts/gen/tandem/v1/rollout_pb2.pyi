from services.contracts.gen.tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("rollout_id", "prompts", "n_samples_per_prompt", "sampling", "stream", "trace_context", "reward")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    N_SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    rollout_id: int
    prompts: _containers.RepeatedCompositeFieldContainer[_common_pb2.Prompt]
    n_samples_per_prompt: int
    sampling: _common_pb2.SamplingParams
    stream: str
    trace_context: _containers.ScalarMap[str, str]
    reward: str
    def __init__(self, rollout_id: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[_common_pb2.Prompt, _Mapping]]] = ..., n_samples_per_prompt: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stream: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., reward: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("entry_id", "num_samples", "num_prompt_tokens", "num_response_tokens", "weight_version", "generate_time_s", "reward_time_s", "put_time_s", "metrics", "producer", "num_groups", "informative_groups")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    REWARD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PUT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    INFORMATIVE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    entry_id: str
    num_samples: int
    num_prompt_tokens: int
    num_response_tokens: int
    weight_version: int
    generate_time_s: float
    reward_time_s: float
    put_time_s: float
    metrics: _containers.ScalarMap[str, float]
    producer: str
    num_groups: int
    informative_groups: int
    def __init__(self, entry_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_response_tokens: _Optional[int] = ..., weight_version: _Optional[int] = ..., generate_time_s: _Optional[float] = ..., reward_time_s: _Optional[float] = ..., put_time_s: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., producer: _Optional[str] = ..., num_groups: _Optional[int] = ..., informative_groups: _Optional[int] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("name", "prompts", "n_samples_per_prompt", "sampling", "reward")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    N_SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    name: str
    prompts: _containers.RepeatedCompositeFieldContainer[_common_pb2.Prompt]
    n_samples_per_prompt: int
    sampling: _common_pb2.SamplingParams
    reward: str
    def __init__(self, name: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[_common_pb2.Prompt, _Mapping]]] = ..., n_samples_per_prompt: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., reward: _Optional[str] = ...) -> None: ...

class EvaluateResponse(_message.Message):
    __slots__ = ("metrics", "weight_version", "time_s")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    weight_version: int
    time_s: float
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ..., weight_version: _Optional[int] = ..., time_s: _Optional[float] = ...) -> None: ...

class PrepareReceiveRequest(_message.Message):
    __slots__ = ("version", "pause_mode")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MODE_FIELD_NUMBER: _ClassVar[int]
    version: int
    pause_mode: str
    def __init__(self, version: _Optional[int] = ..., pause_mode: _Optional[str] = ...) -> None: ...

class PrepareReceiveResponse(_message.Message):
    __slots__ = ("ready", "engine_ranks")
    READY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_RANKS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    engine_ranks: int
    def __init__(self, ready: _Optional[bool] = ..., engine_ranks: _Optional[int] = ...) -> None: ...

class ReceiveWeightsRequest(_message.Message):
    __slots__ = ("plan", "rank_offset")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    plan: _common_pb2.WeightSyncPlan
    rank_offset: int
    def __init__(self, plan: _Optional[_Union[_common_pb2.WeightSyncPlan, _Mapping]] = ..., rank_offset: _Optional[int] = ...) -> None: ...

class ReceiveWeightsResponse(_message.Message):
    __slots__ = ("version", "checksums", "bytes_received", "time_s", "bucket_checksums", "checksum_s")
    class ChecksumsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    BUCKET_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    checksums: _containers.ScalarMap[str, str]
    bytes_received: int
    time_s: float
    bucket_checksums: _containers.RepeatedScalarFieldContainer[str]
    checksum_s: float
    def __init__(self, version: _Optional[int] = ..., checksums: _Optional[_Mapping[str, str]] = ..., bytes_received: _Optional[int] = ..., time_s: _Optional[float] = ..., bucket_checksums: _Optional[_Iterable[str]] = ..., checksum_s: _Optional[float] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    def __init__(self, mode: _Optional[str] = ...) -> None: ...

class MemoryRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class RolloutState(_message.Message):
    __slots__ = ("engine", "model_path", "weight_version", "paused", "memory_released", "generated_samples", "device", "producer", "in_flight", "gpu_memory_reserved_bytes", "gpu_memory_freed_bytes", "engine_busy_s")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RELEASED_FIELD_NUMBER: _ClassVar[int]
    GENERATED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    engine: str
    model_path: str
    weight_version: int
    paused: bool
    memory_released: bool
    generated_samples: int
    device: str
    producer: str
    in_flight: int
    gpu_memory_reserved_bytes: int
    gpu_memory_freed_bytes: int
    engine_busy_s: float
    def __init__(self, engine: _Optional[str] = ..., model_path: _Optional[str] = ..., weight_version: _Optional[int] = ..., paused: _Optional[bool] = ..., memory_released: _Optional[bool] = ..., generated_samples: _Optional[int] = ..., device: _Optional[str] = ..., producer: _Optional[str] = ..., in_flight: _Optional[int] = ..., gpu_memory_reserved_bytes: _Optional[int] = ..., gpu_memory_freed_bytes: _Optional[int] = ..., engine_busy_s: _Optional[float] = ...) -> None: ...

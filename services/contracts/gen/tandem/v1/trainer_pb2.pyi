from services.contracts.gen.tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class TrainRequest(_message.Message):
    __slots__ = ("rollout_id", "entry_ids", "num_batches", "max_staleness", "use_critic_values", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRY_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    USE_CRITIC_VALUES_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    rollout_id: int
    entry_ids: _containers.RepeatedScalarFieldContainer[str]
    num_batches: int
    max_staleness: int
    use_critic_values: bool
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, rollout_id: _Optional[int] = ..., entry_ids: _Optional[_Iterable[str]] = ..., num_batches: _Optional[int] = ..., max_staleness: _Optional[int] = ..., use_critic_values: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("rollout_id", "step", "metrics", "entry_ids", "replayed", "samples_trained", "samples_dropped_stale", "time_s", "samples_filtered")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TRAINED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FILTERED_FIELD_NUMBER: _ClassVar[int]
    rollout_id: int
    step: int
    metrics: _containers.ScalarMap[str, float]
    entry_ids: _containers.RepeatedScalarFieldContainer[str]
    replayed: bool
    samples_trained: int
    samples_dropped_stale: int
    time_s: float
    samples_filtered: int
    def __init__(self, rollout_id: _Optional[int] = ..., step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., entry_ids: _Optional[_Iterable[str]] = ..., replayed: _Optional[bool] = ..., samples_trained: _Optional[int] = ..., samples_dropped_stale: _Optional[int] = ..., time_s: _Optional[float] = ..., samples_filtered: _Optional[int] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("rollout_id", "path", "export_hf", "extra_state")
    class ExtraStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    EXPORT_HF_FIELD_NUMBER: _ClassVar[int]
    EXTRA_STATE_FIELD_NUMBER: _ClassVar[int]
    rollout_id: int
    path: str
    export_hf: bool
    extra_state: _containers.ScalarMap[str, str]
    def __init__(self, rollout_id: _Optional[int] = ..., path: _Optional[str] = ..., export_hf: _Optional[bool] = ..., extra_state: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("path", "hf_path", "step", "time_s")
    PATH_FIELD_NUMBER: _ClassVar[int]
    HF_PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    path: str
    hf_path: str
    step: int
    time_s: float
    def __init__(self, path: _Optional[str] = ..., hf_path: _Optional[str] = ..., step: _Optional[int] = ..., time_s: _Optional[float] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("loaded", "path", "rollout_id", "step", "weight_version", "extra_state")
    class ExtraStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LOADED_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXTRA_STATE_FIELD_NUMBER: _ClassVar[int]
    loaded: bool
    path: str
    rollout_id: int
    step: int
    weight_version: int
    extra_state: _containers.ScalarMap[str, str]
    def __init__(self, loaded: _Optional[bool] = ..., path: _Optional[str] = ..., rollout_id: _Optional[int] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., extra_state: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PrepareWeightSyncRequest(_message.Message):
    __slots__ = ("version", "transport", "engine_world_size", "verify", "verify_by_bucket")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    VERIFY_BY_BUCKET_FIELD_NUMBER: _ClassVar[int]
    version: int
    transport: str
    engine_world_size: int
    verify: bool
    verify_by_bucket: bool
    def __init__(self, version: _Optional[int] = ..., transport: _Optional[str] = ..., engine_world_size: _Optional[int] = ..., verify: _Optional[bool] = ..., verify_by_bucket: _Optional[bool] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("version", "bytes_sent", "time_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes_sent: int
    time_s: float
    def __init__(self, version: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., time_s: _Optional[float] = ...) -> None: ...

class TrainerState(_message.Message):
    __slots__ = ("role", "step", "last_rollout_id", "weight_version", "world_size", "zero_stage", "offloaded", "device", "samples_trained", "gpu_memory_reserved_bytes")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ZERO_STAGE_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TRAINED_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    role: str
    step: int
    last_rollout_id: int
    weight_version: int
    world_size: int
    zero_stage: int
    offloaded: bool
    device: str
    samples_trained: int
    gpu_memory_reserved_bytes: int
    def __init__(self, role: _Optional[str] = ..., step: _Optional[int] = ..., last_rollout_id: _Optional[int] = ..., weight_version: _Optional[int] = ..., world_size: _Optional[int] = ..., zero_stage: _Optional[int] = ..., offloaded: _Optional[bool] = ..., device: _Optional[str] = ..., samples_trained: _Optional[int] = ..., gpu_memory_reserved_bytes: _Optional[int] = ...) -> None: ...

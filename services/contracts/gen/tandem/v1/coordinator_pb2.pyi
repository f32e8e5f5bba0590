from services.contracts.gen.tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RunStatus(_message.Message):
    __slots__ = ("state", "rollout_id", "num_rollout", "weight_version", "data_cursor", "epoch", "last_metrics", "run_dir", "last_checkpoint", "error")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_CURSOR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    state: str
    rollout_id: int
    num_rollout: int
    weight_version: int
    data_cursor: int
    epoch: int
    last_metrics: _containers.ScalarMap[str, float]
    run_dir: str
    last_checkpoint: str
    error: str
    def __init__(self, state: _Optional[str] = ..., rollout_id: _Optional[int] = ..., num_rollout: _Optional[int] = ..., weight_version: _Optional[int] = ..., data_cursor: _Optional[int] = ..., epoch: _Optional[int] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., run_dir: _Optional[str] = ..., last_checkpoint: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class EvalRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class EvalResult(_message.Message):
    __slots__ = ("rollout_id", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, rollout_id: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("include_history",)
    INCLUDE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    include_history: bool
    def __init__(self, include_history: _Optional[bool] = ...) -> None: ...

class StepEvent(_message.Message):
    __slots__ = ("kind", "rollout_id", "metrics", "message", "unix_time")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    kind: str
    rollout_id: int
    metrics: _containers.ScalarMap[str, float]
    message: str
    unix_time: float
    def __init__(self, kind: _Optional[str] = ..., rollout_id: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., message: _Optional[str] = ..., unix_time: _Optional[float] = ...) -> None: ...

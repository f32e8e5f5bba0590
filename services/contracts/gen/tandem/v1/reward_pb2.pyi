from services.contracts.gen.tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RewardSample(_message.Message):
    __slots__ = ("prompt", "messages", "response", "label", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    response: str
    label: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., response: _Optional[str] = ..., label: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("model", "samples", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    model: str
    samples: _containers.RepeatedCompositeFieldContainer[RewardSample]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, model: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[RewardSample, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SubScores(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "sub_scores", "verdicts", "time_s", "queue_s", "tokens", "parse_failed")
    class SubScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SubScores
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[SubScores, _Mapping]] = ...) -> None: ...
    SCORES_FIELD_NUMBER: _ClassVar[int]
    SUB_SCORES_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARSE_FAILED_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    sub_scores: _containers.MessageMap[str, SubScores]
    verdicts: _containers.RepeatedScalarFieldContainer[str]
    time_s: float
    queue_s: float
    tokens: int
    parse_failed: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, scores: _Optional[_Iterable[float]] = ..., sub_scores: _Optional[_Mapping[str, SubScores]] = ..., verdicts: _Optional[_Iterable[str]] = ..., time_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., tokens: _Optional[int] = ..., parse_failed: _Optional[_Iterable[bool]] = ...) -> None: ...

class RewardModelState(_message.Message):
    __slots__ = ("name", "type", "path", "samples_scored", "parse_failures")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SCORED_FIELD_NUMBER: _ClassVar[int]
    PARSE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    path: str
    samples_scored: int
    parse_failures: int
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., path: _Optional[str] = ..., samples_scored: _Optional[int] = ..., parse_failures: _Optional[int] = ...) -> None: ...

class RewardState(_message.Message):
    __slots__ = ("models", "device")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[RewardModelState]
    device: str
    def __init__(self, models: _Optional[_Iterable[_Union[RewardModelState, _Mapping]]] = ..., device: _Optional[str] = ...) -> None: ...

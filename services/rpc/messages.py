"""Which frozen dataclass each message of the services' calls converts to (services/contracts/convert.py): one row per
message, none per field. tests/test_rpc_convert.py pairs every request and reply of every service in the tandem.v1
protos with its row, so a new message without a dataclass, or a field on one side only, fails there."""

from __future__ import annotations

from google.protobuf.message import Message

from services.contracts import common_calls, coordinator_calls, reward_calls, rollout_calls, trainer_calls, weight_plan
from services.contracts.convert import to_message
from services.contracts.gen.tandem.v1 import common_pb2, coordinator_pb2, reward_pb2, rollout_pb2, trainer_pb2
from services.telemetry.events import StepEvent

_PAIRS: tuple[tuple[type[Message], type], ...] = (
    (common_pb2.Empty, common_calls.Empty),
    (common_pb2.Ack, common_calls.Ack),
    (common_pb2.WeightSyncPlan, weight_plan.WeightSyncPlan),
    (coordinator_pb2.RunStatus, coordinator_calls.RunStatus),
    (coordinator_pb2.EvalRequest, coordinator_calls.EvalRequest),
    (coordinator_pb2.EvalResult, coordinator_calls.EvalResult),
    (coordinator_pb2.WatchRequest, coordinator_calls.WatchRequest),
    (coordinator_pb2.StepEvent, StepEvent),
    (trainer_pb2.TrainRequest, trainer_calls.TrainRequest),
    (trainer_pb2.TrainResponse, trainer_calls.TrainResult),
    (trainer_pb2.SaveRequest, trainer_calls.SaveRequest),
    (trainer_pb2.SaveResponse, trainer_calls.SaveResult),
    (trainer_pb2.LoadRequest, trainer_calls.LoadRequest),
    (trainer_pb2.LoadResponse, trainer_calls.LoadResult),
    (trainer_pb2.PrepareWeightSyncRequest, trainer_calls.WeightSyncRequest),
    (trainer_pb2.PublishWeightsRequest, trainer_calls.PublishRequest),
    (trainer_pb2.PublishWeightsResponse, trainer_calls.PublishResult),
    (trainer_pb2.TrainerState, trainer_calls.TrainerStatus),
    (rollout_pb2.GenerateRequest, rollout_calls.GenerateRequest),
    (rollout_pb2.GenerateResponse, rollout_calls.GenerateResult),
    (rollout_pb2.EvaluateRequest, rollout_calls.EvaluateRequest),
    (rollout_pb2.EvaluateResponse, rollout_calls.EvaluateResult),
    (rollout_pb2.PrepareReceiveRequest, rollout_calls.PrepareRequest),
    (rollout_pb2.PrepareReceiveResponse, rollout_calls.PrepareResult),
    (rollout_pb2.ReceiveWeightsRequest, rollout_calls.ReceiveRequest),
    (rollout_pb2.ReceiveWeightsResponse, rollout_calls.ReceiveResult),
    (rollout_pb2.PauseRequest, rollout_calls.PauseRequest),
    (rollout_pb2.MemoryRequest, rollout_calls.MemoryRequest),
    (rollout_pb2.RolloutState, rollout_calls.RolloutStatus),
    (reward_pb2.ScoreRequest, reward_calls.ScoreRequest),
    (reward_pb2.ScoreResponse, reward_calls.ScoreResult),
    (reward_pb2.RewardState, reward_calls.RewardState),
)
MESSAGE_DATACLASSES: dict[str, type] = {message.DESCRIPTOR.full_name: cls for message, cls in _PAIRS}
_MESSAGE_CLASSES: dict[type, type[Message]] = {cls: message for message, cls in _PAIRS}


def message_of(value: object) -> Message:
    """The service message of the dataclass `value` (the one its row names)."""
    message = _MESSAGE_CLASSES.get(type(value))
    if message is None:
        raise TypeError(f"{type(value).__name__} is the dataclass of no service message (services/rpc/messages.py)")
    return to_message(value, message)

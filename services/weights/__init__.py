"""Weight sync trainer -> rollout engines: bucketing, transports (gloo, nccl, cuda_ipc, disk), front ends.

    publisher = WeightPublisher(config=cfg.weights, run_dir=run_dir, trainer_id="actor-0")
    plan = publisher.prepare(specs, version, engine_world_size, verify)      # trainer.PrepareWeightSync
    receiver.receive(plan, rank_offset, params)  ||  publisher.publish(plan, named_tensors)   # concurrently

See docs/CONTRACTS.md ("Weight sync") and each transport module for its handshake.
"""

from services.weights.checksums import tensor_checksum
from services.weights.front_ends import WeightPublisher, WeightReceiver
from services.weights.layout import (
    Layout,
    TensorSpec,
    check_params,
    layout_from_plan,
    plan_layout,
    specs_from_tensors,
)
from services.weights.transport_base import (
    Deadline,
    Received,
    ReceiverTransport,
    SenderTransport,
    SyncStats,
    WeightChecksumMismatch,
    WeightSyncError,
    WeightSyncPeerLost,
    WeightSyncRefused,
    WeightSyncTimeout,
)
from services.weights.transport_registry import TRANSPORTS, transport_names

__all__ = [
    "TRANSPORTS",
    "Deadline",
    "Layout",
    "Received",
    "ReceiverTransport",
    "SenderTransport",
    "SyncStats",
    "TensorSpec",
    "WeightChecksumMismatch",
    "WeightPublisher",
    "WeightReceiver",
    "WeightSyncError",
    "WeightSyncPeerLost",
    "WeightSyncRefused",
    "WeightSyncTimeout",
    "check_params",
    "layout_from_plan",
    "plan_layout",
    "specs_from_tensors",
    "tensor_checksum",
    "transport_names",
]

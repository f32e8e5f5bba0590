"""The weight-sync plan: what a PrepareWeightSync answers and every engine follows (buckets, tensor names and
offsets, the rendezvous, checksums). It stays a protobuf message in every process, by design: it travels trainer ->
coordinator -> engines as it is, and the transports' handshakes carry its fields. Code outside the gRPC edges names
it WeightSyncPlan from here (services/weights reads and fills it)."""

from __future__ import annotations

from services.contracts.gen.tandem.v1 import common_pb2

WeightSyncPlan = common_pb2.WeightSyncPlan

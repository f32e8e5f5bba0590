"""`tandem ctl`: a small client of the coordinator's control API."""

from __future__ import annotations

import json
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from services.common.gen.tandem.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.common.grpc_util import open_channel


def run_ctl(*, addr: str, action: str, token: str | None, tls_ca: str | None, timeout_s: float) -> int:
    try:
        with open_channel(addr, tls_ca=tls_ca, auth_token=token) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            if action == "watch":
                from services.coordinator.watch import watch_table

                return watch_table(stub)
            method = {"status": stub.GetStatus, "save": stub.Save, "eval": stub.Eval, "pause": stub.Pause,
                      "resume": stub.Resume, "stop": stub.Stop}[action]
            request = coordinator_pb2.EvalRequest(timeout_s=timeout_s) if action == "eval" else common_pb2.Empty()
            reply = method(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        print(f"tandem ctl {action}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True), indent=2, sort_keys=True))
    return 0

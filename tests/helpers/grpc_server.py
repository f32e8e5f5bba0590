"""A tiny service process built with services.rpc.grpc_util.start_server, for the gRPC plumbing tests.

    python tests/helpers/grpc_server.py [--auth-token T] [--max-message-mb N] [--bind-host H] [--port P]

Serves a minimal Coordinator (GetStatus, WatchEvents; Eval/Pause/Resume/Stop/Save raise exceptions that
@map_errors turns into status codes) and a Rollout whose Generate counts the prompts it got. Prints
`TANDEM_READY test-server <port>` once bound, stops gracefully on SIGTERM.
"""

from __future__ import annotations

import argparse
import sys

from services.buffer.stream import EntryNotFoundError
from services.contracts.errors import FailedPrecondition
from services.contracts.gen.tandem.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)
from services.rpc.grpc_util import ServerOptions, map_errors, start_server
from services.rpc.shutdown import StopSignals


class Coordinator(coordinator_pb2_grpc.CoordinatorServicer):
    @map_errors
    def GetStatus(self, request, context):
        return coordinator_pb2.RunStatus(state="running", rollout_id=3, run_dir="helper")

    @map_errors
    def WatchEvents(self, request, context):
        for i in range(3):
            if request.include_history and i == 1:
                raise ValueError("history is not kept")
            yield coordinator_pb2.StepEvent(kind="step", rollout_id=i)

    @map_errors
    def Eval(self, request, context):
        raise ValueError(f"timeout_s must be positive, got {request.timeout_s}")

    @map_errors
    def Pause(self, request, context):
        raise FailedPrecondition("the run is not started yet")

    @map_errors
    def Resume(self, request, context):
        raise KeyError("no such step 7")

    @map_errors
    def Save(self, request, context):
        raise EntryNotFoundError("entry 1-1 is not in stream s")

    @map_errors
    def Stop(self, request, context):
        raise RuntimeError("boom")


class Rollout(rollout_pb2_grpc.RolloutServicer):
    @map_errors
    def Generate(self, request, context):
        return rollout_pb2.GenerateResponse(
            num_samples=len(request.prompts), num_prompt_tokens=sum(len(p.text) for p in request.prompts)
        )

    @map_errors
    def Resume(self, request, context):
        return common_pb2.Ack(ok=True, message="x" * (2 << 20))  # a reply over a 1 MiB client limit


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--auth-token", default=None)
    parser.add_argument("--max-message-mb", type=int, default=64)
    parser.add_argument("--bind-host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    options = ServerOptions(
        bind_host=args.bind_host, port=args.port, max_message_mb=args.max_message_mb, auth_token=args.auth_token
    )
    server = start_server(
        [
            (
                coordinator_pb2_grpc.add_CoordinatorServicer_to_server,
                Coordinator(),
                coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name,
            ),
            (
                rollout_pb2_grpc.add_RolloutServicer_to_server,
                Rollout(),
                rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name,
            ),
        ],
        options,
    )
    stop = StopSignals()  # as the services wait for their stop
    print(f"TANDEM_READY test-server {server.port}", flush=True)
    stop.wait()
    server.stop(grace_s=1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

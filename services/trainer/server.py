"""`tandem trainer CONFIG --role actor|critic`: the Trainer gRPC service.

One rank (no launcher): this process is the whole trainer. Under torchrun / the DeepSpeed launcher
(RANK and WORLD_SIZE set) rank 0 serves gRPC and relays every command to the other ranks, which wait in
`TrainerService.serve_worker`. Started without a launcher but with trainer.num_ranks > 1, `main` re-runs
itself under torchrun with that many ranks (what `tandem run` does too).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from services.contracts.common_calls import Ack
from services.contracts.config import TandemConfig
from services.contracts.config_loading import dump_config
from services.contracts.convert import from_message, to_message
from services.contracts.exits import ExitCode
from services.contracts.files import PRIVATE_FILE_MODE, write_atomic
from services.contracts.gen.tandem.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.contracts.trainer_calls import LoadRequest, PublishRequest, SaveRequest, TrainRequest, WeightSyncRequest
from services.rpc.grpc_util import ServerOptions, map_errors, start_server
from services.rpc.ports import free_port
from services.rpc.shutdown import StopSignals, begin_stop, exit_now
from services.telemetry.process_age import process_age_s
from services.telemetry.tracing import setup_logging, setup_tracing, shutdown_tracing

if TYPE_CHECKING:
    from services.trainer.service import TrainerService

log = logging.getLogger(__name__)

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """Thin adapter: each call's message as its dataclass into TrainerService, the dataclass it returns back as the
    reply message (contracts/convert.py); errors become status codes."""

    def __init__(self, service: TrainerService):
        self.service = service

    @map_errors
    def Train(self, request: trainer_pb2.TrainRequest, context: grpc.ServicerContext) -> trainer_pb2.TrainResponse:
        return to_message(self.service.train(from_message(request, TrainRequest)), trainer_pb2.TrainResponse)

    @map_errors
    def Save(self, request: trainer_pb2.SaveRequest, context: grpc.ServicerContext) -> trainer_pb2.SaveResponse:
        return to_message(self.service.save(from_message(request, SaveRequest)), trainer_pb2.SaveResponse)

    @map_errors
    def Load(self, request: trainer_pb2.LoadRequest, context: grpc.ServicerContext) -> trainer_pb2.LoadResponse:
        return to_message(self.service.load(from_message(request, LoadRequest)), trainer_pb2.LoadResponse)

    @map_errors
    def PrepareWeightSync(
        self, request: trainer_pb2.PrepareWeightSyncRequest, context: grpc.ServicerContext
    ) -> common_pb2.WeightSyncPlan:
        plan = self.service.prepare_weight_sync(from_message(request, WeightSyncRequest))
        return to_message(plan, common_pb2.WeightSyncPlan)

    @map_errors
    def PublishWeights(
        self, request: trainer_pb2.PublishWeightsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.PublishWeightsResponse:
        result = self.service.publish_weights(from_message(request, PublishRequest))
        return to_message(result, trainer_pb2.PublishWeightsResponse)

    @map_errors
    def Offload(self, request: common_pb2.Empty, context: grpc.ServicerContext) -> common_pb2.Ack:
        return to_message(Ack(message=self.service.offload()), common_pb2.Ack)

    @map_errors
    def Onload(self, request: common_pb2.Empty, context: grpc.ServicerContext) -> common_pb2.Ack:
        return to_message(Ack(message=self.service.onload()), common_pb2.Ack)

    @map_errors
    def GetState(self, request: common_pb2.Empty, context: grpc.ServicerContext) -> trainer_pb2.TrainerState:
        return to_message(self.service.get_state(), trainer_pb2.TrainerState)


def launch_ranks(config: TandemConfig, *, run_dir: Path, role: str) -> int:
    """Re-runs `tandem trainer` under torchrun with trainer.num_ranks local ranks; forwards SIGTERM/SIGINT."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / f"trainer-{role}.config.yaml"
    write_atomic(config_file, dump_config(config), mode=PRIVATE_FILE_MODE)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(config.trainer.num_ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "services.cli",
        "trainer",
        str(config_file),
        "--run-dir",
        str(run_dir),
        "--role",
        role,
    ]
    proc = subprocess.Popen(cmd)
    stopping = threading.Event()

    def forward(sig: int, _frame: object) -> None:
        stopping.set()
        proc.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    rc = proc.wait()
    if stopping.is_set():
        # torchrun reports a signalled shutdown as a failure; here it is what was asked for.
        log.info("trainer ranks stopped on request (torchrun exit code %d)", rc)
        return ExitCode.OK
    return rc


def _close_quietly(service: TrainerService, timeout_s: float) -> None:
    """Tells the other ranks to stop; they may already be gone (the launcher signals them too)."""
    worker = threading.Thread(target=service.close, daemon=True)
    worker.start()
    worker.join(timeout_s)


def main(config: TandemConfig, *, run_dir: Path, role: str) -> int:
    from services.trainer.dist import launched_by_launcher

    if config.trainer.num_ranks > 1 and not launched_by_launcher():
        return launch_ranks(config, run_dir=run_dir, role=role)
    name = "trainer" if role == "actor" else "critic"
    setup_logging(name, config.tracing.log_level)
    setup_tracing(
        "tandem-trainer",
        exporter=config.tracing.exporter,
        instance=name,
        file_path=config.tracing.file_path or str(run_dir / "traces.jsonl"),
    )
    from transformers.utils import logging as hf_logging

    from services.trainer.builder import build_trainer
    from services.trainer.service import TrainerService

    hf_logging.disable_progress_bar()
    service = TrainerService(build_trainer(config, run_dir=run_dir, role=role))
    if service.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
        service.serve_worker()
        return ExitCode.OK
    address = config.services.trainer if role == "actor" else config.services.critic
    s = config.services
    server = start_server(
        [(trainer_pb2_grpc.add_TrainerServicer_to_server, TrainerServicer(service), SERVICE_NAME)],
        ServerOptions(
            bind_host=s.bind_host,
            port=address.port,
            max_message_mb=s.max_message_mb,
            auth_token=s.auth_token,
            tls_cert=s.tls_cert,
            tls_key=s.tls_key,
        ),
    )
    log.info("%s ready %.1fs after its process started", name, process_age_s())
    log.info(
        "%s (%d ranks, ZeRO %d) serving on %s:%d",
        name,
        service.world.world_size,
        config.trainer.zero_stage,
        s.bind_host,
        server.port,
    )
    stop = StopSignals()
    print(f"TANDEM_READY {name} {server.port}", flush=True)
    signum = stop.wait()
    # One shutdown budget: half for in-flight calls, the rest for the ranks, so the process exits before a
    # supervisor waiting services.timeouts.shutdown_s kills it.
    deadline = begin_stop(name=name, signum=signum, shutdown_s=s.timeouts.shutdown_s, code=ExitCode.OK)
    server.stop(grace_s=s.timeouts.shutdown_s / 2)
    _close_quietly(service, timeout_s=max(0.0, deadline - time.monotonic()))
    shutdown_tracing()  # flushes a batching (otlp) exporter
    exit_now(ExitCode.OK)
    return ExitCode.OK

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

from services.contracts.config import TandemConfig
from services.contracts.config_loading import dump_config
from services.contracts.exits import ExitCode
from services.contracts.files import PRIVATE_FILE_MODE, write_atomic
from services.contracts.gen.tandem.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
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
    """Thin adapter: protobuf in, TrainerService call with plain values, its dataclass out as protobuf; errors
    become status codes."""

    def __init__(self, service: TrainerService):
        self.service = service

    @map_errors
    def Train(self, request: trainer_pb2.TrainRequest, context: grpc.ServicerContext) -> trainer_pb2.TrainResponse:
        r = self.service.train(
            rollout_id=request.rollout_id,
            entry_ids=list(request.entry_ids),
            num_batches=request.num_batches,
            max_staleness=request.max_staleness,
            use_critic_values=request.use_critic_values,
            trace_context=dict(request.trace_context),
        )
        return trainer_pb2.TrainResponse(
            rollout_id=r.rollout_id,
            step=r.step,
            metrics=r.metrics,
            entry_ids=r.entry_ids,
            replayed=r.replayed,
            samples_trained=r.samples_trained,
            samples_dropped_stale=r.samples_dropped_stale,
            samples_filtered=r.samples_filtered,
            time_s=r.time_s,
        )

    @map_errors
    def Save(self, request: trainer_pb2.SaveRequest, context: grpc.ServicerContext) -> trainer_pb2.SaveResponse:
        r = self.service.save(
            rollout_id=request.rollout_id,
            path=request.path,
            export_hf=request.export_hf,
            extra_state=dict(request.extra_state),
        )
        return trainer_pb2.SaveResponse(path=r.path, hf_path=r.hf_path, step=r.step, time_s=r.time_s)

    @map_errors
    def Load(self, request: trainer_pb2.LoadRequest, context: grpc.ServicerContext) -> trainer_pb2.LoadResponse:
        r = self.service.load(path=request.path)
        return trainer_pb2.LoadResponse(
            loaded=r.loaded,
            path=r.path,
            rollout_id=r.rollout_id,
            step=r.step,
            weight_version=r.weight_version,
            extra_state=r.extra_state,
        )

    @map_errors
    def PrepareWeightSync(
        self, request: trainer_pb2.PrepareWeightSyncRequest, context: grpc.ServicerContext
    ) -> common_pb2.WeightSyncPlan:
        return self.service.prepare_weight_sync(
            version=request.version,
            transport=request.transport,
            engine_world_size=request.engine_world_size,
            verify=request.verify,
            verify_by_bucket=request.verify_by_bucket,
        )

    @map_errors
    def PublishWeights(
        self, request: trainer_pb2.PublishWeightsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.PublishWeightsResponse:
        r = self.service.publish_weights(version=request.version)
        return trainer_pb2.PublishWeightsResponse(version=r.version, bytes_sent=r.bytes_sent, time_s=r.time_s)

    @map_errors
    def Offload(self, request: common_pb2.Empty, context: grpc.ServicerContext) -> common_pb2.Ack:
        return common_pb2.Ack(ok=True, message=self.service.offload())

    @map_errors
    def Onload(self, request: common_pb2.Empty, context: grpc.ServicerContext) -> common_pb2.Ack:
        return common_pb2.Ack(ok=True, message=self.service.onload())

    @map_errors
    def GetState(self, request: common_pb2.Empty, context: grpc.ServicerContext) -> trainer_pb2.TrainerState:
        s = self.service.get_state()
        return trainer_pb2.TrainerState(
            role=s.role,
            step=s.step,
            last_rollout_id=s.last_rollout_id,
            weight_version=s.weight_version,
            world_size=s.world_size,
            zero_stage=s.zero_stage,
            offloaded=s.offloaded,
            device=s.device,
            samples_trained=s.samples_trained,
            gpu_memory_reserved_bytes=s.gpu_memory_reserved_bytes,
        )


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

"""The coordinator service: the run loop in the main thread, the control API (gRPC) beside it."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc

from services.contracts.common_calls import Ack
from services.contracts.config import TandemConfig
from services.contracts.convert import from_message, to_message
from services.contracts.coordinator_calls import EvalResult, RunStatus, WatchRequest
from services.contracts.exits import ExitCode
from services.contracts.failure import clear_failure, write_failure
from services.contracts.gen.tandem.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.coordinator.builder import build_coordinator
from services.coordinator.call_errors import failure_record
from services.coordinator.loop import Coordinator
from services.rpc.grpc_util import ServerOptions, map_errors, start_server
from services.rpc.shutdown import StopSignals, exit_now
from services.telemetry.tracing import TRACEBACK_TO_FILE, setup_logging, setup_tracing, shutdown_tracing

log = logging.getLogger(__name__)


CONTROL_WORKERS = 16  # server threads for everything but WatchEvents streams: GetStatus, Stop, health, ...


class StreamSlots:
    """A WatchEvents stream holds a server thread for as long as it is open, idle or not. The server has
    CONTROL_WORKERS threads plus one per slot, and a stream beyond the slots is refused at once, so open streams
    never take the threads GetStatus, health or a graceful Stop need."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free = threading.BoundedSemaphore(limit)

    @contextlib.contextmanager
    def take(self, context: grpc.ServicerContext) -> Iterator[None]:
        if not self._free.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.limit} WatchEvents streams are open already (services.max_watch_streams); close one first",
            )
        try:
            yield
        finally:
            self._free.release()


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Thin adapter: every method reads or flips state of the plain `Coordinator`."""

    def __init__(self, coordinator: Coordinator, *, max_watch_streams: int = 32):
        self.c = coordinator
        self.streams = StreamSlots(max_watch_streams)

    @map_errors
    def GetStatus(self, request, context):
        c = self.c
        status = RunStatus(
            state=c.status,
            rollout_id=c.state.next_rollout_id,
            num_rollout=c.num_rollout,
            weight_version=c.state.weight_version,
            data_cursor=c.data.cursor.consumed,
            epoch=c.data.cursor.epoch,
            last_metrics=c.last_metrics,
            run_dir=str(c.run_dir),
            last_checkpoint=c.last_checkpoint,
            error=c.error,
        )
        return to_message(status, coordinator_pb2.RunStatus)

    @map_errors
    def Save(self, request, context):
        self.c.control.request_save()
        return to_message(Ack(message="a checkpoint will be written at the end of the current step"), common_pb2.Ack)

    @map_errors
    def Eval(self, request, context):
        rollout_id = self.c.state.next_rollout_id - 1
        metrics = self.c.evals.evaluate()
        self.c.evals.record(rollout_id, metrics)
        return to_message(EvalResult(rollout_id=rollout_id, metrics=metrics), coordinator_pb2.EvalResult)

    @map_errors
    def Pause(self, request, context):
        self.c.control.pause()
        return to_message(Ack(message="no new step will start until Resume"), common_pb2.Ack)

    @map_errors
    def Resume(self, request, context):
        self.c.control.resume()
        return to_message(Ack(message="resumed"), common_pb2.Ack)

    @map_errors
    def Stop(self, request, context):
        self.c.control.stop()
        return to_message(Ack(message="stopping after the current step (with a final checkpoint)"), common_pb2.Ack)

    def WatchEvents(self, request, context):
        with self.streams.take(context):  # released when the stream ends or the caller goes away
            watch = from_message(request, WatchRequest)
            for event in self.c.events.watch(include_history=watch.include_history, is_active=context.is_active):
                yield to_message(event, coordinator_pb2.StepEvent)


def main(config: TandemConfig, *, run_dir: Path) -> int:
    setup_logging("coordinator", config.tracing.log_level, str(run_dir / "logs" / "coordinator.log"))
    setup_tracing(
        "tandem-coordinator",
        exporter=config.tracing.exporter,
        instance="coordinator",
        file_path=config.tracing.file_path or str(run_dir / "traces.jsonl"),
    )
    clear_failure(run_dir)  # a record of an earlier coordinator is not this one's
    try:
        coordinator = Coordinator(build_coordinator(config, run_dir=run_dir))
    except (ValueError, FileNotFoundError) as exc:  # bad data (file and line named): a restart would repeat it
        return _failed(exc, run_dir=run_dir, kept="", starting=True)
    s = config.services
    servicer = CoordinatorServicer(coordinator, max_watch_streams=s.max_watch_streams)
    server = start_server(
        [(coordinator_pb2_grpc.add_CoordinatorServicer_to_server, servicer, "tandem.v1.Coordinator")],
        ServerOptions(
            bind_host=s.bind_host,
            port=s.coordinator.port,
            max_message_mb=s.max_message_mb,
            max_workers=CONTROL_WORKERS + s.max_watch_streams,
            auth_token=s.auth_token,
            tls_cert=s.tls_cert,
            tls_key=s.tls_key,
        ),
    )
    print(f"TANDEM_READY coordinator {server.port}", flush=True)

    def on_signal(signum: int, count: int) -> None:
        if count == 1:
            log.info("signal %d: stopping after the current step (again to terminate)", signum)
            coordinator.control.stop()  # thread-safe: a paused loop wakes up to stop
        else:
            log.warning("signal %d again: terminating now", signum)
            exit_now(ExitCode.INTERRUPTED)

    StopSignals(on_signal=on_signal)  # heard whichever thread the kernel hands the signal to
    code: int = ExitCode.OK
    try:
        coordinator.run()
    except Exception as exc:  # noqa: BLE001 - every failure becomes the record and its exit code
        code = _failed(exc, run_dir=run_dir, kept=coordinator.last_checkpoint)
    for tracker in coordinator.trackers:
        tracker.close()
    server.stop(grace_s=s.timeouts.control_s)  # control calls still running get their deadline to finish
    shutdown_tracing()
    # A generation or eval thread may still wait on its call's deadline (a failed run): exiting the interpreter
    # would join it.
    exit_now(code)
    return code


def _failed(exc: Exception, *, run_dir: Path, kept: str, starting: bool = False) -> int:
    """Every failure ends the same way: the traceback to the log file, RUN_DIR/failure.json for `tandem run` to
    show, and the same block on stderr for a coordinator run alone; the exit code says whether to restart."""
    record = failure_record(exc, kept=kept, starting=starting)
    log.error("run failed: %s", exc, exc_info=exc, extra=TRACEBACK_TO_FILE)
    write_failure(run_dir, record)
    print(record.render(command="tandem coordinator", run_dir=run_dir), file=sys.stderr, flush=True)
    return record.exit_code

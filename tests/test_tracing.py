"""services.telemetry.tracing: exporters, the `rl.*` attribute scheme, context through thread pools and carriers,
log correlation, and exporter `none` installing nothing. Tracing set-up is once per process, so each case
runs in a fresh Python process (a script on stdin); the OTLP case sends to a real OTLP/gRPC receiver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest

REPO = Path(__file__).resolve().parents[1]


def run_script(script: str, *, env: dict[str, str] | None = None, timeout_s: float = 60) -> str:
    done = subprocess.run(
        [sys.executable, "-"],
        input=textwrap.dedent(script),
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def read_spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_exporter_none_installs_nothing():
    out = run_script("""
        from concurrent.futures import ThreadPoolExecutor
        import grpc
        from opentelemetry import trace
        from services.telemetry import tracing
        before = (ThreadPoolExecutor.submit, grpc.insecure_channel)
        tracing.setup_tracing("tandem-coordinator", exporter="none")
        assert (ThreadPoolExecutor.submit, grpc.insecure_channel) == before   # nothing patched
        assert tracing.server_interceptors() == [] and not tracing.tracing_enabled()
        with tracing.span("rl.train", rollout_id=1, parent={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
                          links_from=[{}]) as s:
            assert s is trace.INVALID_SPAN and tracing.inject_context() == {}
        steps = tracing.StepSpans()
        with steps.started(0):
            assert tracing.inject_context() == {}
        with steps.step(0) as s:
            tracing.annotate(tokens=3)
        steps.close_all(trained=False)
        print("none ok")
    """)
    assert "none ok" in out


def test_file_exporter_records_rl_attributes_parents_links_and_thread_pool_context(tmp_path: Path):
    path = tmp_path / "traces.jsonl"
    run_script(f"""
        from concurrent.futures import ThreadPoolExecutor
        from services.telemetry import tracing
        tracing.setup_tracing("tandem-trainer", exporter="file", file_path={str(path)!r}, instance="trainer")
        with tracing.span("rl.sample", rollout_id=3, **{{"net.peer.name": "x"}}, skipped=None):
            sample_carrier = tracing.inject_context()
        def in_pool():
            with tracing.span("rl.pool"):
                pass
        steps = tracing.StepSpans()
        with steps.started(3, mode="async"):
            loop_carrier = tracing.inject_context()
            with ThreadPoolExecutor(2) as pool:   # the pool thread runs in the submitter's context
                pool.submit(in_pool).result()
        with tracing.span("rl.other"):             # a different trace is current: the carrier switches to its trace
            with tracing.span("rl.train", parent=loop_carrier, links_from=[sample_carrier, sample_carrier, {{}}]):
                pass
        with steps.step(3):
            with tracing.span("rl.inner"):         # current span already in the carrier's trace: it stays the parent
                with tracing.span("rl.nested", parent=loop_carrier):
                    pass
            tracing.annotate(staleness=1)
        with steps.after(3):                       # after the step ended: still its trace
            with tracing.span("rl.final"):
                pass
        with steps.after(2):                       # not the step that ended last: the current context
            with tracing.span("rl.elsewhere"):
                pass
        steps.open(4)                              # a generation that is never trained
        steps.close_all(trained=False)
    """)
    spans = {(s["name"], s["attributes"].get("rl.rollout_id")): s for s in read_spans(path)}
    sample, loop, train = spans["rl.sample", 3], spans["rl.loop", 3], spans["rl.train", None]
    assert sample["attributes"] == {"rl.rollout_id": 3, "net.peer.name": "x"}
    assert sample["service"] == "tandem-trainer" and sample["instance"] == "trainer"
    assert loop["parent_span_id"] is None and loop["attributes"] == {
        "rl.rollout_id": 3,
        "rl.mode": "async",
        "rl.staleness": 1,
    }
    assert spans["rl.pool", None]["parent_span_id"] == loop["span_id"]
    assert train["parent_span_id"] == loop["span_id"] and train["trace_id"] == loop["trace_id"]
    assert train["links"] == [{"trace_id": sample["trace_id"], "span_id": sample["span_id"]}]
    assert spans["rl.nested", None]["parent_span_id"] == spans["rl.inner", None]["span_id"]
    assert spans["rl.final", None]["parent_span_id"] == loop["span_id"]
    assert spans["rl.elsewhere", None]["parent_span_id"] is None
    never = spans["rl.loop", 4]
    assert never["attributes"]["rl.trained"] is False and never["trace_id"] != loop["trace_id"]


def test_file_lines_stay_whole_with_several_writer_processes(tmp_path: Path):
    """Each export is one O_APPEND write; lines far above PIPE_BUF (4 KiB) from 4 processes must not interleave."""
    path = tmp_path / "traces.jsonl"
    script = f"""
        import os
        from services.telemetry import tracing
        tracing.setup_tracing("tandem-rollout", exporter="file", file_path={str(path)!r})
        for i in range(300):
            with tracing.span("rl.sample", rollout_id=i, payload=str(os.getpid()) * 3000):
                pass
    """
    procs = [subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, cwd=REPO, text=True) for _ in range(4)]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(textwrap.dedent(script))
        p.stdin.close()
    assert all(p.wait(timeout=120) == 0 for p in procs)
    spans = read_spans(path)  # json.loads fails on any torn or interleaved line
    assert len(spans) == 1200
    for pid in {s["pid"] for s in spans}:
        mine = [s for s in spans if s["pid"] == pid]
        assert sorted(s["attributes"]["rl.rollout_id"] for s in mine) == list(range(300))
        assert all(s["attributes"]["rl.payload"] == str(pid) * 3000 for s in mine)


def test_log_lines_carry_trace_and_span_ids(tmp_path: Path):
    out = run_script(f"""
        import logging
        from services.telemetry import tracing
        tracing.setup_logging("trainer", "INFO")
        tracing.setup_tracing("tandem-trainer", exporter="file", file_path={str(tmp_path / "t.jsonl")!r})
        log = logging.getLogger("x")
        log.info("outside")
        with tracing.span("rl.train") as s:
            c = s.get_span_context()
            log.info("inside %032x %016x", c.trace_id, c.span_id)
    """)
    outside = next(line for line in out.splitlines() if line.endswith("outside"))
    inside = next(line for line in out.splitlines() if " inside " in line)
    assert "trainer [trace=- span=-]" in outside
    trace_id, span_id = inside.split()[-2:]
    assert f"[trace={trace_id} span={span_id}]" in inside and trace_id != "0" * 32


def test_console_exporter_prints_spans():
    out = run_script("""
        from services.telemetry import tracing
        tracing.setup_tracing("tandem-rollout", exporter="console")
        with tracing.span("rl.reward", rollout_id=5):
            pass
    """)
    assert '"name": "rl.reward"' in out and '"rl.rollout_id": 5' in out and "tandem-rollout" in out


def test_unknown_exporter_and_file_without_path_are_clear_errors():
    from services.telemetry.tracing import _span_processor

    with pytest.raises(ValueError, match="unknown exporter 'zipkin'"):
        _span_processor("zipkin", file_path=None)
    with pytest.raises(ValueError, match=r"file needs tracing.file_path"):
        _span_processor("file", file_path=None)


def test_otlp_exporter_sends_to_the_endpoint_of_the_standard_variables(free_port):
    """A real OTLP/gRPC receiver; the service finds it through OTEL_EXPORTER_OTLP_ENDPOINT alone."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list = []
    got = threading.Event()

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.append(request)
            got.set()
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port}")
    server.start()
    try:
        run_script(
            """
            from services.telemetry import tracing
            tracing.setup_tracing("tandem-trainer", exporter="otlp", instance="critic")
            with tracing.span("rl.train", rollout_id=7):
                pass
            tracing.shutdown_tracing()   # flushes the batch
        """,
            env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true"},
        )
        assert got.wait(timeout=30)
    finally:
        server.stop(grace=1)
    resource_spans = [rs for r in received for rs in r.resource_spans]
    resource = {a.key: a.value.string_value for a in resource_spans[0].resource.attributes}
    assert resource["service.name"] == "tandem-trainer" and resource["service.instance.id"] == "critic"
    [sent] = [s for rs in resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert sent.name == "rl.train"
    assert {a.key: a.value.int_value for a in sent.attributes} == {"rl.rollout_id": 7}

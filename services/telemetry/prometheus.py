"""An optional Prometheus endpoint on the coordinator (`tracing.trackers: [{type: prometheus, port: PORT}]`).

A tiny HTTP server on 127.0.0.1 serves `GET /metrics` in the Prometheus text exposition format (0.0.4):
the latest value of every metric the run has logged (the last step's, and the last eval's `eval/*`), each a
gauge named `tandem_<key>` with `/`, `@`, ... turned into `_`, labelled with the run name; plus
`tandem_rollout_id` (the newest rollout id logged) and `tandem_last_log_timestamp_seconds`. Written by hand:
prometheus_client is not a dependency. Port 0 picks a free port (see `.port` and the coordinator's log).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from services.telemetry.trackers import Tracker

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(key: str) -> str:
    """`rollout/reward_mean` -> `tandem_rollout_reward_mean`; `eval/pass@1` -> `tandem_eval_pass_1`."""
    return "tandem_" + _INVALID.sub("_", key).strip("_")


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render(values: dict[str, float], *, run_name: str) -> str:
    """The text format: one `# TYPE` line and one sample per metric, sorted by name."""
    labels = f'{{run="{_label_value(run_name)}"}}'
    lines = []
    for name, value in sorted(values.items()):
        lines.append(f"# TYPE {name} gauge")
        lines.append(f"{name}{labels} {_number(value)}")
    return "\n".join(lines) + "\n"


class PrometheusTracker(Tracker):
    def __init__(self, *, port: int, run_name: str, host: str = "127.0.0.1"):
        self.run_name = run_name
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()
        try:
            self._server = ThreadingHTTPServer((host, port), self._handler_class())
        except OSError as exc:
            raise ValueError(f"tracing.trackers: prometheus cannot listen on {host}:{port}: {exc}") from exc
        self._server.daemon_threads = True
        self.host, self.port = host, int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="prometheus", daemon=True)
        self._thread.start()
        log.info("Prometheus metrics on http://%s:%d/metrics", self.host, self.port)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self._lock:
            for key, value in metrics.items():
                self._values[metric_name(key)] = float(value)
            # evals of an earlier step may be logged after a later step: the gauge never goes back
            self._values["tandem_rollout_id"] = max(float(step), self._values.get("tandem_rollout_id", -1.0))
            self._values["tandem_last_log_timestamp_seconds"] = time.time()

    def exposition(self) -> str:
        with self._lock:
            values = dict(self._values)
        return render(values, run_name=self.run_name)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        tracker = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = tracker.exposition().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler

"""A stand-alone weight-sync peer process for tests and benchmarks: `python tests/helpers/weight_peer.py`.

It reads one JSON command per line on stdin and answers one JSON line on stdout. Plans travel as base64 of
the protobuf bytes and tensors are regenerated from a seed on each side, so nothing is pickled. One
`WeightReceiver` (and at most one `WeightPublisher`) lives for the process, so group reuse is exercised.

Commands (`op`): receive (`flat`: params as views of one buffer laid out like the plan), prepare, publish,
raw_recv (a bare ProcessGroupGloo broadcast, for the benchmark), exit. `Peer` below is the parent's handle on
such a process.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.contracts.config import weights_config
from services.contracts.convert import from_message, to_message
from services.contracts.gen.tandem.v1 import common_pb2
from services.contracts.untyped import JsonObject, JsonValue
from services.contracts.weight_plan import WeightSyncPlan
from services.weights import torch_compat
from services.weights.front_ends import WeightPublisher, WeightReceiver
from services.weights.layout import TensorSpec, layout_from_plan, tensor_bytes, torch_dtype
from services.weights.transport_base import SyncStats

# A test and benchmark harness, not a service (no config): how long the parent waits for the peer to start and
# to answer a command, and for it to exit; a `stall_after` publish sleeps past any deadline a test sets.
_HARNESS_TIMEOUT_S = 60.0
_REPO = Path(__file__).resolve().parents[2]  # the child runs as a script: services/ must be importable
_EXIT_TIMEOUT_S = 10.0
_STALL_S = 3600.0


def make_tensors(specs: Sequence[TensorSpec], *, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic tensors for `specs`: the same seed gives the same bits in every process."""
    out = {}
    for i, spec in enumerate(specs):
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        dtype = torch_dtype(spec.dtype)
        if dtype.is_floating_point:
            tensor = torch.randn(spec.shape, generator=gen, dtype=torch.float32).to(dtype)
        elif dtype == torch.bool:
            tensor = torch.randint(0, 2, spec.shape, generator=gen).bool()
        else:
            tensor = torch.randint(0, 100, spec.shape, generator=gen, dtype=torch.int64).to(dtype)
        out[spec.name] = tensor
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(tensor_bytes(a), tensor_bytes(b))


def specs_to_json(specs: Sequence[TensorSpec]) -> list[list[JsonValue]]:
    return [[s.name, s.dtype, list(s.shape)] for s in specs]


def specs_from_json(items: Sequence[Sequence[JsonValue]]) -> list[TensorSpec]:
    return [TensorSpec(name=name, dtype=dtype, shape=tuple(shape)) for name, dtype, shape in items]


def plan_to_text(plan: WeightSyncPlan) -> str:
    """The plan as it crosses to a peer process: its protobuf message's bytes, base64 (never a pickle)."""
    return base64.b64encode(to_message(plan, common_pb2.WeightSyncPlan).SerializeToString()).decode()


def plan_from_text(text: str) -> WeightSyncPlan:
    return from_message(common_pb2.WeightSyncPlan.FromString(base64.b64decode(text)), WeightSyncPlan)


def stats_to_json(stats: SyncStats) -> JsonObject:
    return {
        "version": stats.version,
        "bytes": stats.bytes,
        "seconds": stats.seconds,
        "checksums": stats.checksums,
        "transport": stats.transport,
        "wait_seconds": stats.wait_seconds,
        "bucket_checksums": list(stats.bucket_checksums),
    }


class _Worker:
    def __init__(self) -> None:
        self.receiver = WeightReceiver(accepted_trainer_id=os.environ.get("TANDEM_PEER_ACCEPT") or None)
        self.publisher: WeightPublisher | None = None
        self.plan: WeightSyncPlan | None = None
        self.specs: list[TensorSpec] = []
        self.params: dict[str, torch.Tensor] = {}
        self.params_key: Any = None

    def receive(self, cmd: JsonObject) -> JsonObject:
        specs = specs_from_json(cmd["specs"])
        device = cmd.get("device", "cpu")
        plan = plan_from_text(cmd["plan"])
        flat = cmd.get("flat")
        key = (tuple(specs), device, flat)
        if key != self.params_key:  # the engine keeps its params between syncs
            if flat:  # params as views of one buffer laid out like the plan's buckets
                from services.weights.transports.cuda_ipc import flat_views

                self.params = flat_views(layout_from_plan(plan), device)[1]
                if flat == "recipe":  # the same views as a plain mapping: copies planned per tensor
                    self.params = dict(self.params)
            else:
                self.params = {s.name: torch.zeros(s.shape, dtype=torch_dtype(s.dtype), device=device) for s in specs}
            self.params_key = key
        stats = self.receiver.receive(plan, cmd.get("rank", 1), self.params)
        reply: JsonObject = {"stats": stats_to_json(stats)}
        transport: Any = self.receiver._transports.get(plan.transport)  # diagnostics of some transports
        if hasattr(transport, "last_copies"):
            reply["copies"] = transport.last_copies
        if hasattr(transport, "last_timings"):
            reply["timings"] = dict(transport.last_timings)
        if hasattr(transport, "kept_mappings"):
            reply["kept_mappings"] = transport.kept_mappings
        if cmd.get("seed") is not None:
            expected = make_tensors(specs, seed=cmd["seed"])
            reply["unequal"] = [
                n
                for n, t in expected.items()
                if not (bits_equal(self.params[n].cpu(), t) and torch.equal(self.params[n].cpu(), t))
            ]
        return reply

    def prepare(self, cmd: JsonObject) -> JsonObject:
        if self.publisher is None:
            config = weights_config(transport=cmd["transport"], bucket_mb=cmd["bucket_mb"], timeout_s=cmd["timeout_s"])
            self.publisher = WeightPublisher(
                config=config, run_dir=Path(cmd.get("run_dir", ".")), trainer_id=cmd.get("trainer_id", "peer")
            )
        self.specs = specs_from_json(cmd["specs"])
        self.plan = self.publisher.prepare(
            self.specs, cmd["version"], cmd.get("engine_world_size", 1), cmd.get("verify", False)
        )
        return {"plan": plan_to_text(self.plan)}

    def publish(self, cmd: JsonObject) -> JsonObject:
        assert self.publisher is not None and self.plan is not None
        tensors = make_tensors(self.specs, seed=cmd["seed"])
        stall_after, exit_after = cmd.get("stall_after"), cmd.get("exit_after")

        def stream():
            for i, spec in enumerate(self.specs):
                if i == stall_after:
                    time.sleep(_STALL_S)
                if i == exit_after:
                    os._exit(3)
                yield spec.name, tensors[spec.name]

        return {"stats": stats_to_json(self.publisher.publish(self.plan, stream()))}

    @staticmethod
    def raw_recv(cmd: JsonObject) -> JsonObject:
        """The bare-gloo baseline: one buffer of `nbytes`, broadcast `repeats` times from rank 0."""
        timeout = datetime.timedelta(seconds=cmd["timeout_s"])
        store = dist.TCPStore(host_name=cmd["addr"], port=cmd["port"], is_master=False, timeout=timeout)
        pg = torch_compat.gloo_group(
            dist.PrefixStore(cmd["group"], store),
            rank=1,
            world_size=2,
            timeout=timeout,
            device=dist.ProcessGroupGloo.create_device(hostname="127.0.0.1"),
        )
        buffer = torch.empty(cmd["nbytes"], dtype=torch.uint8)
        for _ in range(cmd["repeats"]):
            pg.broadcast(buffer, 0, timeout).wait()
        pg.abort()
        return {}


def main() -> int:
    if os.environ.get("TANDEM_PEER_THREADS"):
        torch.set_num_threads(int(os.environ["TANDEM_PEER_THREADS"]))
    worker = _Worker()
    print(json.dumps({"ok": True, "ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            worker.receiver.close()
            return 0
        started = time.monotonic()
        try:
            reply = {"ok": True, **getattr(worker, cmd["op"])(cmd)}
        except Exception as exc:  # noqa: BLE001 - the parent asserts on the error type and message
            reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        reply["elapsed"] = time.monotonic() - started
        print(json.dumps(reply), flush=True)
    return 0


class Peer:
    """The parent's handle on a peer process (replies read by a thread, so waits can time out)."""

    def __init__(self, *, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, (str(_REPO), os.environ.get("PYTHONPATH")))),
                **(env or {}),
            },
        )
        self._replies: queue.Queue[JsonObject | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        hello = self.reply(timeout_s=_HARNESS_TIMEOUT_S)
        assert hello.get("ready"), hello

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._replies.put(json.loads(line))
        self._replies.put(None)

    def send(self, **cmd: JsonValue) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, *, timeout_s: float) -> JsonObject:
        item = self._replies.get(timeout=timeout_s)
        if item is None:
            raise RuntimeError(f"peer {self.proc.pid} exited with {self.proc.wait()}")
        return item

    def call(self, *, reply_timeout_s: float = _HARNESS_TIMEOUT_S, **cmd: JsonValue) -> JsonObject:
        self.send(**cmd)
        return self.reply(timeout_s=reply_timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="exit")
                self.proc.wait(timeout=_EXIT_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


if __name__ == "__main__":
    raise SystemExit(main())

"""The SGLang adapter's side of a `cuda_ipc` sync: /update_weights_from_tensor with what the trainer serialised.

The trainer's half is weight_send_tensor.py (this package): the plan carries, per bucket and engine rank, one
base64 string in SGLang's MultiprocessingSerializer format (CUDA IPC handles of the trainer's fresh bucket buffers).
This side decodes none of them. It checks what it can without unpickling, because SGLang raises inside its scheduler
on a payload it cannot load, and that kills the server instead of answering 400 (0.5.17: `_deserialize_own_rank`,
`load_weights` and the flush assert are not wrapped):
  - the plan is one for SGLang (`sglang_load_format`), every bucket with tensors carries one string per engine rank,
    each is base64 of a pickle (protocol header 0x80, protocol <= 5);
  - every server runs on this host (a loopback URL): CUDA IPC handles open only on the trainer's machine;
  - every tensor's name and shape are those of the checkpoint the server loaded (its model_path's safetensors
    headers, where that directory is readable here), so SGLang's loader meets no unknown name or wrong shape.
Then, after the trainer's go (its buffers are filled and synchronised): per server, concurrently, one POST per bucket
(inside /begin_weight_update ... /end_weight_update where the server has them, as 0.5.23 requires) with that
server's ranks' strings (rank r reads entry r), weight_version on the last, never flush_cache (a failed
flush inside an update is an assert in SGLang); the adapter flushes afterwards with its own /flush_cache. Each
server's success is posted as `done` for its ranks; a failure is posted as `abort` with SGLang's message.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import json
import logging
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.contracts.weight_plan import WeightSyncPlan
from services.rollout.engines.sglang.http import SGLangError, is_loopback, wait_for_all
from services.rollout.engines.sglang.protocol import BadAnswer, tensor_update_body
from services.rollout.engines.sglang.servers import Server
from services.rollout.engines.sglang.weight_send_group import EngineHandshake
from services.rollout.engines.sglang.weight_sync_group import begin_session
from services.weights.transport_base import Deadline, SyncContext, WeightSyncError
from services.weights.transports import rendezvous

log = logging.getLogger(__name__)

_MAX_LISTED = 5  # names listed in one refusal
_HEADER_MAX = 100 << 20  # bytes of a safetensors header read at most

_HIGHEST_PICKLE_PROTOCOL = 5  # the header byte a pickle starts with after 0x80 (checked, never loaded)


def payload_problem(payload: str) -> str | None:
    """Why `payload` cannot be a MultiprocessingSerializer string, judged without unpickling it."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        return f"not base64 ({exc})"
    if len(raw) < 2 or raw[0] != 0x80 or raw[1] > _HIGHEST_PICKLE_PROTOCOL:
        return f"not a pickle (starts with {raw[:2].hex() or 'nothing'})"
    return None


def safetensors_shapes(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """name -> shape from the headers of every *.safetensors file in `directory` (None when there are none)."""
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _HEADER_MAX:
                raise ValueError(f"{path}: safetensors header of {size} bytes")
            header = json.loads(f.read(size))
        shapes.update(
            {name: tuple(int(d) for d in meta["shape"]) for name, meta in header.items() if name != "__metadata__"}
        )
    return shapes


@functools.lru_cache(maxsize=8)
def _checkpoint(directory: str) -> dict[str, tuple[int, ...]] | None:
    try:
        return safetensors_shapes(Path(directory))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("cannot read the safetensors headers in %s (%s): names and shapes are not checked", directory, exc)
        return None


def plan_tensors(plan: WeightSyncPlan) -> list[tuple[str, tuple[int, ...]]]:
    return [(m.name, tuple(int(d) for d in m.shape)) for b in plan.buckets for m in b.tensors if m.nbytes > 0]


def checkpoint_problems(plan: WeightSyncPlan, model_path: str) -> list[str]:
    """Tensors of the plan whose name or shape the server's checkpoint does not have (nothing when unreadable)."""
    shapes = _checkpoint(model_path) if model_path else None
    if shapes is None:
        return []
    unknown = [n for n, _ in plan_tensors(plan) if n not in shapes]
    wrong = [
        f"{n} {list(s)} (checkpoint {list(shapes[n])})" for n, s in plan_tensors(plan) if n in shapes and shapes[n] != s
    ]
    out = []
    if unknown:
        out.append(
            f"{len(unknown)} tensor(s) the model at {model_path} does not have: {', '.join(unknown[:_MAX_LISTED])}"
        )
    if wrong:
        out.append(f"{len(wrong)} tensor(s) of another shape: {', '.join(wrong[:_MAX_LISTED])}")
    return out


class TensorSync:
    """`flush`: the adapter's best-effort /flush_cache on one server after its last update; `probe_s` bounds the
    best-effort /end_weight_update after a failure."""

    def __init__(
        self,
        servers: Sequence[Server],
        *,
        handshake: EngineHandshake,
        pool: ThreadPoolExecutor,
        flush: Callable[[Server], None],
        probe_s: float,
    ):
        self.servers = servers
        self._probe_s = probe_s
        self._handshake = handshake
        self._pool = pool
        self._flush = flush

    def _ranks(self, rank_offset: int) -> list[tuple[Server, list[int]]]:
        out, rank = [], rank_offset
        for server in self.servers:
            out.append((server, list(range(rank, rank + server.info.tp_size))))
            rank += server.info.tp_size
        return out

    def refusal(self, plan: WeightSyncPlan, rank_offset: int) -> str | None:
        """Why this plan must not reach SGLang, or None; checked before anything is sent."""
        if not plan.sglang_load_format:
            return (
                "the trainer prepared this cuda_ipc sync for native engines (CUDA IPC handles, no SGLang "
                "payloads): give the trainer and the rollout service the same rollout.engine (sglang)"
            )
        remote = [s.url for s in self.servers if not is_loopback(s.url)]
        if remote:
            return (
                f"transport cuda_ipc needs SGLang on the trainer's host, and {', '.join(remote)} is not a loopback "
                f"address (CUDA IPC handles open only on the machine that made them); use weights.transport "
                f"nccl or disk"
            )
        engine_ranks = sum(s.info.tp_size for s in self.servers)
        for bucket in plan.buckets:
            if not any(m.nbytes for m in bucket.tensors):
                continue
            if len(bucket.sglang_payloads) != plan.world_size - 1 or rank_offset - 1 + engine_ranks > len(
                bucket.sglang_payloads
            ):
                return (
                    f"bucket {bucket.index} carries {len(bucket.sglang_payloads)} SGLang payload(s) for a world of "
                    f"{plan.world_size} (ranks {rank_offset}..{rank_offset + engine_ranks - 1} here)"
                )
            for i, payload in enumerate(bucket.sglang_payloads):
                problem = payload_problem(payload)
                if problem:
                    return f"bucket {bucket.index}'s payload for engine rank {i + 1} is {problem}"
        for server in self.servers:
            problems = checkpoint_problems(plan, server.info.model_path)
            if problems:
                return (
                    f"SGLang at {server.url} would fail to load this plan (and die: a bad tensor update kills "
                    f"its scheduler): " + "; ".join(problems)
                )
        return None

    def receive(self, plan: WeightSyncPlan, *, rank_offset: int, deadline: Deadline, ctx: SyncContext) -> None:
        ctl = self._handshake.ctl(plan, deadline=deadline, ctx=ctx)
        rendezvous.await_go(ctl, version=plan.version, deadline=deadline, ctx=ctx)  # the buffers are filled
        futures = [
            self._pool.submit(self._update_server, server, plan, ranks=ranks, deadline=deadline, ctx=ctx)
            for server, ranks in self._ranks(rank_offset)
        ]
        wait_for_all(futures)

    def _update_server(
        self, server: Server, plan: WeightSyncPlan, *, ranks: list[int], deadline: Deadline, ctx: SyncContext
    ) -> None:
        buckets = [b for b in plan.buckets if b.sglang_payloads]
        session = False
        try:
            session = begin_session(server, deadline)  # 0.5.23 and later; 0.5.17 has none
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                body = tensor_update_body(
                    payloads=[bucket.sglang_payloads[r - 1] for r in ranks],
                    load_format=plan.sglang_load_format,
                    weight_version=str(plan.version) if last else None,
                )
                server.client.post("/update_weights_from_tensor", body, timeout_s=max(0.001, deadline.remaining()))
            if session:
                server.client.post("/end_weight_update", {}, timeout_s=max(0.001, deadline.remaining()))
            self._flush(server)
            self._handshake.post_done(plan, ranks=ranks, deadline=deadline, ctx=ctx)
        except (SGLangError, BadAnswer) as exc:
            self._handshake.refuse(plan, ranks=ranks, reason=str(exc), ctx=ctx)
            if session:  # best effort: a session left open would refuse the next sync's begin
                with contextlib.suppress(SGLangError):
                    server.client.post("/end_weight_update", {}, timeout_s=self._probe_s)
            raise WeightSyncError(ctx.message(f"SGLang at {server.url}: {exc}")) from exc

"""The `sglang` engine: generation and weight updates through SGLang servers, behind the Engine interface.

Two ways to reach SGLang, one adapter: servers the user already runs (rollout.sglang.urls, one engine over all of
them) or one server the rollout service launches itself (`python -m sglang.launch_server`, launch.py).
The HTTP shapes, the supported versions (0.5.15 <= v < 0.6) and the SGLang source files they were recorded from
are in protocol.py; docs/sglang.md says what ran against a real SGLang 0.5.17 server and with which numbers.

- Generation: one POST /generate per chunk of `max_batch_size` prompts (token ids, return_logprob), chunks spread
  over the servers. Token ids and log-probs come from meta_info.output_token_logprobs, finish reasons from
  meta_info.finish_reason; samples are stamped with the weight version SGLang reports (meta_info.weight_version,
  which Tandem sets on every update), or the older of that and the version at the start of the call when an
  update landed while the call was parked (pause retract / in_place). The log-probs are of the tempered
  distribution, log_softmax(logits / T) over the whole vocabulary (`logprob_space`): the trainer scores that.
  A chunk SGLang aborted while it waited (499) comes back as aborted samples, as a pause(abort) would.
- Pause: `drain` (what the coordinator asks) stops admitting calls, waits for this adapter's calls to finish, then
  POST /pause_generation with rollout.sglang.pause_mode; abort / retract / in_place are sent as they are.
  Flush rule: no update request asks SGLang to flush (a failed flush inside one is an assert that kills its
  scheduler); after a sync the adapter calls /flush_cache itself, which SGLang refuses (400) while any request is
  running or waiting, and which is skipped after in_place (the parked requests keep their KV cache).
- Weights: transports gloo / nccl join SGLang's group protocol (weight_sync_group.py; the trainer's side and the
  store keys are in weight_send_group.py): ready and go over the trainer's store for the servers,
  /init_weights_update_group once per group, one /update_weights_from_distributed per plan bucket inside
  /begin_weight_update ... /end_weight_update where the server has them; cuda_ipc is /update_weights_from_tensor
  with the buckets the trainer serialised (weight_sync_tensor.py, same host only); disk maps to
  /update_weights_from_disk on the version's directory; verification is refused with the reason (`_refusal`).
- Memory: /release_memory_occupation and /resume_memory_occupation with tags; refused up front when a server
  was started without --enable-memory-saver (SGLang would answer success and free nothing), and when a server is
  not idle (its /flush_cache answers 400: a release on a busy scheduler is an assert that kills it). Released
  weights come back empty (unless --enable-weights-cpu-backup): the next sync refills them. The GPU memory a
  release gave back is measured on this host (nvidia-smi, before and after) when every server is local.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.contracts.config import ProcessGroupWeights, SGLangConfig, SGLangRolloutConfig, TimeoutsConfig
from services.contracts.sampling_spec import SamplingSpec
from services.rollout.engines.engine_errors import EngineUnavailable
from services.rollout.engines.gate import PauseGate, check_pause_mode
from services.rollout.engines.interface import (
    FINISH_ABORT,
    LOGPROB_TEMPERED,
    Engine,
    SampleOutput,
    WeightLoadStats,
    normalize_memory_tags,
)
from services.rollout.engines.sglang.gpu_memory import device_memory_used_bytes
from services.rollout.engines.sglang.http import (
    SGLangAborted,
    SGLangRequestError,
    is_loopback,
)
from services.rollout.engines.sglang.launch import LaunchedServer
from services.rollout.engines.sglang.protocol import (
    LOAD_FORMATS,
    SGLANG_PAUSE_MODES,
    BadAnswer,
    answer_version,
    disk_update_body,
    generate_body,
    inflight_refusal,
    memory_body,
    parse_weight_version,
    pause_body,
    sample_from_answer,
)
from services.rollout.engines.sglang.servers import Server, connect_server
from services.rollout.engines.sglang.weight_send_group import EngineHandshake
from services.rollout.engines.sglang.weight_sync_group import DistributedSync
from services.rollout.engines.sglang.weight_sync_tensor import TensorSync
from services.weights.transport_base import (
    Deadline,
    SyncContext,
    SyncStats,
    WeightSyncError,
    WeightSyncRefused,
    WeightSyncTimeout,
)

if TYPE_CHECKING:
    import torch

    from services.contracts.config import TandemConfig
    from services.contracts.weight_plan import WeightSyncPlan
    from services.weights.front_ends import WeightReceiver

log = logging.getLogger(__name__)

# Defaults of an engine built without a config (tests, benchmarks); from_config passes the run's.
_SGLANG, _TIMEOUTS, _WEIGHTS = SGLangConfig(), TimeoutsConfig(), ProcessGroupWeights()
_MANIFEST_POLL_S = 0.02  # disk sync: between looks for the trainer's manifest


def _check_settings(urls: Sequence[str], *, pause_mode: str, weight_load_format: str) -> None:
    if not urls:
        raise ValueError("the sglang engine needs at least one server URL")
    if pause_mode not in SGLANG_PAUSE_MODES:
        raise ValueError(f"rollout.sglang.pause_mode must be one of {', '.join(SGLANG_PAUSE_MODES)}")
    if weight_load_format not in LOAD_FORMATS:
        raise ValueError(f"rollout.sglang.weight_load_format must be one of {', '.join(LOAD_FORMATS)}")


def _check_inflight_update(servers: Sequence[Server], inflight_update: str) -> None:
    """rollout.inflight_update needs what every server must offer (its radix cache off): the first refusal."""
    refusals = [
        inflight_refusal(inflight_update, radix_cache_off=s.info.radix_cache_off, where=f"SGLang at {s.url}")
        for s in servers
    ]
    if any(refusals):
        raise ValueError(next(r for r in refusals if r))


class SGLangEngine(Engine):
    name = "sglang"
    logprob_space = LOGPROB_TEMPERED  # SGLang 0.5.x reports log_softmax(logits / T), never truncated

    def __init__(
        self,
        urls: Sequence[str],
        *,
        max_batch_size: int = 512,
        max_context_length: int | None = None,
        pause_mode: str = _SGLANG.pause_mode,
        request_timeout_s: float = _SGLANG.request_timeout_s,
        weight_load_format: str = _SGLANG.weight_load_format,
        startup_timeout_s: float = _SGLANG.startup_timeout_s,
        api_key: str | None = None,
        launched: LaunchedServer | None = None,
        timeouts: TimeoutsConfig = _TIMEOUTS,
        weights_timeout_s: float = _WEIGHTS.timeout_s,
        inflight_update: str = "off",
        eos_token_ids: Sequence[int] = (),
    ):
        """`timeouts`: services.timeouts (control_s for pause/continue/flush/server_info, probe_s for best-effort
        cleanup calls); `weights_timeout_s` bounds a sync whose plan names no deadline (weights.timeout_s);
        `eos_token_ids`: the model's end-of-generation ids, sent with each request (protocol.sampling_params)."""
        _check_settings(urls, pause_mode=pause_mode, weight_load_format=weight_load_format)
        self._launched, self._eos_token_ids = launched, tuple(eos_token_ids)
        deadline = time.monotonic() + startup_timeout_s
        self._control_s, self._probe_s = timeouts.control_s, timeouts.probe_s
        self._weights_timeout_s = weights_timeout_s
        self.servers = [connect_server(u, api_key=api_key, deadline=deadline, control_s=self._control_s) for u in urls]
        _check_inflight_update(self.servers, inflight_update)
        self.max_batch_size, self._pause_mode = max_batch_size, pause_mode
        self._sglang_mode = ""  # the mode SGLang was last paused with ("" = running)
        self._request_timeout_s, self._load_format = request_timeout_s, weight_load_format
        known = [s.max_model_len for s in self.servers if s.max_model_len]
        self._max_context = min([max_context_length or 1 << 30, *known])
        versions = [parse_weight_version(s.info.weight_version) for s in self.servers]
        self._version = min((v for v in versions if v is not None), default=0)
        self._gate = PauseGate(engine="the sglang engine")
        self._weights_lock = threading.Lock()
        self._released: set[str] = set()
        self._weights_empty = False  # resumed without --enable-weights-cpu-backup and not synced since
        self._generated = 0
        self._local = all(is_loopback(s.url) for s in self.servers)  # GPU memory is measurable here
        self._handshake = EngineHandshake(refuse_timeout_s=timeouts.probe_s)
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.servers)), thread_name_prefix="sglang-gen")
        self._control = ThreadPoolExecutor(max_workers=len(self.servers), thread_name_prefix="sglang-ctl")
        self._weight_pool = ThreadPoolExecutor(max_workers=len(self.servers), thread_name_prefix="sglang-weights")
        self._distributed = DistributedSync(
            self.servers,
            handshake=self._handshake,
            pool=self._weight_pool,
            load_format=weight_load_format,
            probe_s=timeouts.probe_s,
            flush=self._flush_after_sync,
        )
        self._tensor = TensorSync(
            self.servers,
            handshake=self._handshake,
            pool=self._weight_pool,
            flush=self._flush_after_sync,
            probe_s=timeouts.probe_s,
        )

    # ---- properties --------------------------------------------------------------------------------

    @property
    def engine_ranks(self) -> int:
        return sum(s.info.tp_size for s in self.servers)

    @property
    def model_path(self) -> str:
        return self.servers[0].info.model_path

    @property
    def device_label(self) -> str:
        return " ".join(s.url for s in self.servers)

    # ---- generation --------------------------------------------------------------------------------

    def _generate_admitted(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec, budgets: Sequence[int]
    ) -> list[SampleOutput]:
        if self._released:
            raise EngineUnavailable(
                f"SGLang memory is released ({', '.join(sorted(self._released))}); call ResumeMemory first"
            )
        if self._weights_empty:
            raise EngineUnavailable(
                "SGLang's weights came back empty from ResumeMemory (its servers run without "
                "--enable-weights-cpu-backup): sync weights before generating"
            )
        blind = [s.url for s in self.servers if s.info.skip_tokenizer_init]
        if sampling.stop and blind:
            raise ValueError(
                f"sampling.stop: SGLang at {blind[0]} runs with --skip-tokenizer-init, so it cannot "
                "match stop strings; restart it with its tokenizer or drop the stop strings"
            )
        start = self._version
        starts = range(0, len(prompts), self.max_batch_size)
        futures = [
            self._pool.submit(
                self._generate_chunk,
                self.servers[k % len(self.servers)],
                prompts[i : i + self.max_batch_size],
                sampling,
                start,
                budgets[i : i + self.max_batch_size],
            )
            for k, i in enumerate(starts)
        ]
        out = [sample for f in futures for sample in f.result()]
        self._generated += len(out)
        return out

    def _generate_chunk(
        self,
        server: Server,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingSpec,
        start: int,
        budgets: Sequence[int],
    ) -> list[SampleOutput]:
        body = generate_body(
            prompts, sampling, max_context=self._max_context, budgets=budgets, eos_token_ids=self._eos_token_ids
        )
        try:
            answer = server.client.post("/generate", body, timeout_s=self._request_timeout_s)
        except SGLangAborted:  # a pause(abort) reached the call while it waited: as aborted samples (retried)
            return [
                SampleOutput(token_ids=(), log_probs=(), finish_reason=FINISH_ABORT, weight_version=start)
                for _ in prompts
            ]
        items = answer.body
        where = f"SGLang /generate at {server.url}"
        if not isinstance(items, list) or len(items) != len(prompts):
            raise BadAnswer(f"{where}: expected a list of {len(prompts)} answers, got {str(items)[:200]}")
        version = answer_version(items, fallback=start)
        if self._version != start:  # an update landed while the call was parked: the samples began earlier
            version = min(version, start)
        return [sample_from_answer(item, version=version, where=where) for item in items]

    # ---- pause -------------------------------------------------------------------------------------

    def pause(self, mode: str = "drain", *, timeout_s: float | None = None) -> None:
        mode = check_pause_mode(mode)
        sglang_mode = self._pause_mode if mode == "drain" else mode
        self._gate.close(mode)
        if mode == "drain":
            self._gate.drain(timeout_s)
        self._each("/pause_generation", pause_body(sglang_mode), timeout_s=timeout_s or self._control_s)
        self._sglang_mode = sglang_mode

    def resume(self) -> None:
        self._each("/continue_generation", {}, timeout_s=self._control_s)
        self._sglang_mode = ""
        self._gate.open()

    def _each(self, path: str, body: Any, *, timeout_s: float) -> list[Any]:
        """The same call on every server, concurrently; the first failure is raised after all have answered."""
        futures = [self._control.submit(s.client.post, path, body, timeout_s=timeout_s) for s in self.servers]
        errors = []
        answers = []
        for f in futures:
            try:
                answers.append(f.result())
            except Exception as exc:  # noqa: BLE001 - collected, the first is raised
                errors.append(exc)
        if errors:
            raise errors[0]
        return answers

    def _flush_after_sync(self, server: Server) -> None:
        """Best effort, after a server's last update: SGLang refuses (400) while requests run or wait; after
        in_place the parked requests keep their KV cache, so it is not asked."""
        if self._sglang_mode == "in_place":
            return
        try:
            server.client.post("/flush_cache", {}, timeout_s=self._control_s)
        except SGLangRequestError as exc:
            log.warning(
                "SGLang at %s kept its prefix cache after the weight update (not idle): %s", server.url, exc.reason
            )

    # ---- weights -----------------------------------------------------------------------------------

    def update_weights_from_disk(self, path: str | Path, *, version: int) -> WeightLoadStats:
        """Every server loads the safetensors in `path` (a path as the servers see it) and serves `version`."""
        started = time.monotonic()
        with self._weights_lock:
            self._check_weights_resident()
            self._load_disk(str(path), version=version, timeout_s=self._request_timeout_s)
            self._version = int(version)
            self._weights_empty = False
        return WeightLoadStats(version=self._version, tensors=0, bytes=0, seconds=time.monotonic() - started)

    def _load_disk(self, path: str, *, version: int, timeout_s: float) -> None:
        body = disk_update_body(model_path=path, weight_version=str(version))

        def load(server: Server) -> None:
            server.client.post("/update_weights_from_disk", body, timeout_s=timeout_s)
            self._flush_after_sync(server)

        for f in [self._weight_pool.submit(load, s) for s in self.servers]:
            f.result()

    def _check_weights_resident(self) -> None:
        if "weights" in self._released:
            raise EngineUnavailable("SGLang's weights are released; call ResumeMemory before loading weights")

    @property
    def compute_device(self) -> torch.device:
        """SGLang computes in its own processes on the GPU: this one only prepares requests and scores rewards."""
        import torch

        return torch.device("cuda")

    def receive_weights(self, plan: WeightSyncPlan, *, rank_offset: int, receiver: WeightReceiver) -> SyncStats:
        """Takes part in the trainer's transfer for every server of this engine. SGLang receives into its own
        weights; of `receiver` only `accepted_trainer_id` is used."""
        started = time.monotonic()
        deadline = Deadline(plan.timeout_s if plan.timeout_s > 0 else self._weights_timeout_s)
        ranks = list(range(rank_offset, rank_offset + self.engine_ranks))
        ctx = SyncContext(
            plan.transport,
            plan.version,
            f"SGLang engine rank(s) {ranks}",
            f"trainer {plan.trainer_id or '?'} at {plan.master_addr}:{plan.master_port}",
            plan.timeout_s,
        )
        refusal = plan_refusal(
            plan,
            rank_offset,
            engine_ranks=self.engine_ranks,
            accepted_trainer_id=receiver.accepted_trainer_id,
            weights_released="weights" in self._released,
            tensor_refusal=self._tensor.refusal if plan.transport == "cuda_ipc" else None,
        )
        if refusal is not None:
            kind, reason = refusal
            if plan.transport != "disk":  # the trainer fails now, with the reason, instead of at its deadline
                self._handshake.refuse(plan, ranks=ranks, reason=f"SGLang engine refuses: {reason}", ctx=ctx)
            raise kind(ctx.message(reason))
        with self._weights_lock:
            match plan.transport:
                case "disk":
                    self._receive_disk(plan, deadline=deadline, ctx=ctx)
                case "cuda_ipc":
                    self._tensor.receive(plan, rank_offset=rank_offset, deadline=deadline, ctx=ctx)
                case _:
                    self._distributed.receive(plan, rank_offset=rank_offset, deadline=deadline, ctx=ctx)
            self._version = int(plan.version)
            self._weights_empty = False
        return SyncStats(
            version=self._version,
            bytes=int(plan.total_bytes),
            seconds=time.monotonic() - started,
            transport=plan.transport,
        )

    def _receive_disk(self, plan: WeightSyncPlan, *, deadline: Deadline, ctx: SyncContext) -> None:
        path = await_disk_manifest(plan, deadline=deadline, ctx=ctx)
        self._load_disk(str(path), version=plan.version, timeout_s=max(0.1, deadline.remaining()))

    # ---- memory / state ----------------------------------------------------------------------------

    def release_memory(self, tags: Sequence[str] = ()) -> None:
        """Releases `tags` (empty = all) not released yet, once every server is idle (SGLang asserts that in its
        scheduler: a release on a busy server kills it, so a failed /flush_cache stops here with the reason)."""
        wanted = [t for t in normalize_memory_tags(tags) if t not in self._released]
        lacking = [s.url for s in self.servers if not s.info.enable_memory_saver]
        if lacking:
            raise EngineUnavailable(
                f"release_memory_occupation needs SGLang started with --enable-memory-saver; {', '.join(lacking)} "
                f"report enable_memory_saver false (SGLang would answer success and free nothing). Add the flag to "
                f"rollout.sglang.launch_args or to the server's command line"
            )
        if not wanted:
            return
        with self._weights_lock:
            if self._gate.admitted:
                raise EngineUnavailable(
                    f"cannot release SGLang's memory while {self._gate.admitted} generate call(s) "
                    f"of this adapter run; release between steps"
                )
            for server in self.servers:
                try:
                    server.client.post("/flush_cache", {}, timeout_s=self._control_s)
                except SGLangRequestError as exc:
                    raise EngineUnavailable(
                        f"SGLang at {server.url} is not idle ({exc.reason}), so nothing was released: its "
                        f"release_memory_occupation asserts an idle scheduler and would crash it. Requests of another "
                        f"client, or parked by pause retract / in_place, must finish first"
                    ) from exc
            before = self._gpu_memory_used()
            self._each("/release_memory_occupation", memory_body(tuple(wanted)), timeout_s=self._request_timeout_s)
            self._released.update(wanted)
            after = self._gpu_memory_used()
            self._freed_bytes = max(0, before - after) if before is not None and after is not None else 0

    def resume_memory(self, tags: Sequence[str] = ()) -> None:
        """Resumes the released ones among `tags` (SGLang raises, and dies, on a tag it did not release)."""
        wanted = [t for t in normalize_memory_tags(tags) if t in self._released]
        if not wanted:
            return
        with self._weights_lock:
            self._each("/resume_memory_occupation", memory_body(tuple(wanted)), timeout_s=self._request_timeout_s)
            self._released.difference_update(wanted)
            if "weights" in wanted and not all(s.info.weights_cpu_backup for s in self.servers):
                self._weights_empty = True

    def _gpu_memory_used(self) -> int | None:
        return device_memory_used_bytes(timeout_s=self._probe_s) if self._local else None

    def close(self) -> None:
        self._handshake.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._control.shutdown(wait=False, cancel_futures=True)
        self._weight_pool.shutdown(wait=False, cancel_futures=True)
        if self._launched is not None:
            self._launched.stop()


def engine_from_config(config: TandemConfig, *, eos_token_ids: Sequence[int] = ()) -> SGLangEngine:
    """rollout.sglang.urls, or a server launched here when none are given."""
    from services.rollout.engines.sglang.launch import LaunchSpec, launch_args
    from services.rpc.ports import free_port

    ro = config.rollout
    if not isinstance(ro, SGLangRolloutConfig):
        raise ValueError(f"the SGLang engine needs rollout.engine sglang, not {ro.engine}")
    sg = ro.sglang
    launched = None
    urls = list(sg.urls)
    if not urls:
        spec = LaunchSpec(
            model_path=config.model.path, port=free_port(), api_key=sg.api_key, extra_args=launch_args(config)
        )
        launched = LaunchedServer(spec, timeouts=config.services.timeouts)
        urls = [spec.url]
    try:
        if launched is not None:
            launched.wait_healthy(timeout_s=sg.startup_timeout_s)
        return SGLangEngine(
            urls,
            max_batch_size=ro.max_batch_size,
            max_context_length=ro.max_context_length,
            pause_mode=sg.pause_mode,
            request_timeout_s=sg.request_timeout_s,
            weight_load_format=sg.weight_load_format,
            startup_timeout_s=sg.startup_timeout_s,
            api_key=sg.api_key,
            launched=launched,
            timeouts=config.services.timeouts,
            weights_timeout_s=config.weights.timeout_s,
            inflight_update=ro.inflight_update,
            eos_token_ids=eos_token_ids,
        )
    except BaseException:
        if launched is not None:
            launched.stop()
        raise


def plan_refusal(
    plan: WeightSyncPlan,
    rank_offset: int,
    *,
    engine_ranks: int,
    accepted_trainer_id: str | None,
    weights_released: bool,
    tensor_refusal: Callable[[WeightSyncPlan, int], str | None] | None,
) -> tuple[type[Exception], str] | None:
    """Why this engine will not take part in `plan` (the exception to raise and the reason), or None."""
    if accepted_trainer_id and plan.trainer_id != accepted_trainer_id:
        return WeightSyncRefused, f"trainer {plan.trainer_id!r} is not the accepted trainer {accepted_trainer_id!r}"
    if plan.transport not in ("gloo", "nccl", "cuda_ipc", "disk"):
        return ValueError, (
            f"transport {plan.transport!r} is not one the sglang engine speaks (gloo, nccl, cuda_ipc, disk)"
        )
    if plan.verify:
        return ValueError, (
            "weights.check_weight_update_equal is not supported with rollout.engine sglang: the "
            "adapter cannot read bit-exact checksums of SGLang's weights (its /weights_checker "
            "hashes SGLang's own, possibly fused, tensors); set it to false"
        )
    if weights_released:
        return EngineUnavailable, "SGLang's weights are released; call ResumeMemory before a weight sync"
    if tensor_refusal is not None:
        reason = tensor_refusal(plan, rank_offset)
        if reason is not None:
            return ValueError, reason
    if plan.transport != "disk" and (rank_offset < 1 or rank_offset + engine_ranks > plan.world_size):
        return ValueError, (
            f"rank_offset {rank_offset} with {engine_ranks} engine rank(s) does not fit the "
            f"plan's world of {plan.world_size}"
        )
    return None


def await_disk_manifest(plan: WeightSyncPlan, *, deadline: Deadline, ctx: SyncContext) -> Path:
    """The disk transport's directory once the trainer's manifest of this plan is there (it is written last)."""
    path = Path(plan.disk_path)
    manifest = path / "manifest.json"
    while not manifest.exists():
        if deadline.expired():
            raise WeightSyncTimeout(ctx.message(f"{manifest} did not appear within {plan.timeout_s:g}s"))
        time.sleep(_MANIFEST_POLL_S)
    written = json.loads(manifest.read_text())
    if written.get("version") != plan.version or (plan.trainer_id and written.get("trainer_id") != plan.trainer_id):
        raise WeightSyncError(
            ctx.message(
                f"{path} holds version {written.get('version')} of trainer "
                f"{written.get('trainer_id')!r}, not the planned one"
            )
        )
    return path

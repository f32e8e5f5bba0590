"""A contract test server for the sglang engine: SGLang's native HTTP API, as recorded from SGLang's source.

    python tests/helpers/sglang_contract_server.py --profile 0.5.23 [--enable-memory-saver] [--vocab 22]

Listens on 127.0.0.1 (a free port unless --port) and prints `SGLANG_CONTRACT_READY <port>`. It is a real HTTP server
in its own process that implements the request and answer shapes of the SGLang versions the adapter supports; it
imports nothing from Tandem, so a mistake in the adapter's shapes is not mirrored here. Generation is a fixed
deterministic rule (no model): token i of a sample is (last prompt token + 1 + i) mod vocab.

Recorded from (versions as read; see services/rollout/engines/sglang_protocol.py for the adapter's side):
- python/sglang/srt/entrypoints/http_server.py (0.5.3rc2 and a later 0.5.x): routes, status codes, answer bodies,
  the 400 shapes (`{"success": false, "message"}` for weight/group routes, `{"error": {"message"}}` from
  _create_error_response, `{"object": "error", "message", "type": "Bad Request", "param", "code": 400}` for request
  validation), 404 `{"detail": "Not Found"}` for unknown routes, /flush_cache's text answers;
- python/sglang/srt/managers/io_struct.py (0.5.x): the request fields and defaults of GenerateReqInput,
  PauseGenerationReqInput, ContinueGenerationReqInput, InitWeightsUpdateGroupReqInput,
  UpdateWeightsFromDistributedReqInput, DestroyWeightsUpdateGroupReqInput, UpdateWeightFromDiskReqInput,
  Release/ResumeMemoryOccupationReqInput;
- python/sglang/srt/managers/tokenizer_manager.py: /generate's `{"text", "output_ids", "meta_info"}` items;
- python/sglang/srt/sampling/sampling_params.py: accepted sampling keys and SamplingParams.verify()'s checks;
- python/sglang/srt/utils (init_custom_process_group) and model_runner.update_weights_from_distributed (0.5.x): the
  group join and the per-tensor / flattened_bucket receive, copied below as SGLang runs them;
- 0.5.23's begin/end_weight_update session rule: /work/shared/FACTS.md (checked in the 0.5.23 wheel).

Deviations, on purpose: unknown request fields are refused with 400 (SGLang ignores them) so that an adapter typo
cannot pass silently; the group join uses --pg-timeout-s (SGLang uses torch's default_pg_timeout, 30 min); tensors
are received on --device (cpu unless told; SGLang receives on its GPU); only tp_size 1 (a tp>1 server joins one rank
per scheduler process). Profiles: 0.4.10 only answers version queries (for the unsupported-version test); 0.5.15
serves /get_server_info but not /server_info and has no begin/end routes; 0.5.23 serves both info routes and
requires begin/end around distributed updates.

Test instrumentation, not SGLang: GET /_contract/weights (received tensors: dtype, shape, blake2b-128 of the raw
bytes), GET /_contract/log (every request), GET /_contract/state, POST /_contract/configure ({"hang": [paths],
"fail": {path: message}, "token_delay_s": s}) — a hung route answers nothing until it is configured away.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

PROFILES = ("0.4.10", "0.5.15", "0.5.23")
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "min_new_tokens", "stop",
                 "stop_token_ids", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                 "no_stop_trim", "n", "frequency_penalty", "presence_penalty", "repetition_penalty",
                 "sampling_seed", "json_schema", "regex", "ebnf", "custom_params", "stream_interval", "logit_bias"}
_MISSING = object()


class Reject(Exception):
    def __init__(self, status: int, body: Any, *, text: bool = False):
        super().__init__(str(body))
        self.status, self.body, self.text = status, body, text


def validation_error(message: str) -> Reject:
    """FastAPI's RequestValidationError as SGLang's handler answers it (400, not 422)."""
    return Reject(400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400})


def failure(message: str, **extra: Any) -> Reject:
    return Reject(400, {"success": False, "message": message, **extra})


def error_response(message: str) -> Reject:
    return Reject(400, {"error": {"message": message}})


def fields(body: Any, spec: dict[str, tuple[tuple[type, ...], Any]]) -> dict[str, Any]:
    """Checks a JSON body against a request dataclass: (allowed types, default or _MISSING) per field."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise validation_error(f"body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(spec))
    if unknown:
        raise validation_error(f"unknown field(s) {unknown} (the contract server refuses what SGLang would ignore)")
    out = {}
    for name, (types, default) in spec.items():
        if name not in body:
            if default is _MISSING:
                raise validation_error(f"[{{'type': 'missing', 'loc': ('body', '{name}'), 'msg': 'Field required'}}]")
            out[name] = default
            continue
        value = body[name]
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            raise validation_error(f"field {name!r}: {value!r} is not of type {[t.__name__ for t in types]}")
        out[name] = value
    return out


def init_custom_process_group(backend: str, init_method: str, timeout: datetime.timedelta, world_size: int,
                              rank: int, group_name: str) -> dist.ProcessGroup:
    """SGLang's sglang.srt.utils.init_custom_process_group, the store-is-None path it takes from
    ModelRunner.init_weights_update_group(init_method=f"tcp://{master_address}:{master_port}")."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    backend = Backend(backend)
    rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
    store, rank, world_size = next(rendezvous_iterator)
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # The options argument was renamed pg_options -> backend_options in torch 2.6. (Older SGLang copies compared
    # version strings, which misreads torch >= 2.10; the release tuple is compared here.)
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    pg_options_param_name = "backend_options" if release >= (2, 6) else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                      **{pg_options_param_name: None}, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def blake2b_hex(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(memoryview(data), digest_size=16).hexdigest()


class Server:
    """The state of one fake SGLang server; every route is a method taking the JSON body (and the query)."""

    def __init__(self, args: argparse.Namespace):
        self.profile: str = args.profile
        self.vocab, self.eos, self.context = args.vocab, args.eos, args.context
        self.memory_saver = args.enable_memory_saver
        self.pg_timeout = datetime.timedelta(seconds=args.pg_timeout_s)
        self.model_path = args.model_path
        self.device = torch.device(args.device)   # where received tensors live (SGLang: the model's GPU)
        self.cv = threading.Condition()
        self.paused: str | None = None        # pause_generation mode, None = generating
        self.running = 0                      # generate requests inside the scheduler
        self.parked = 0                       # of those, stopped by retract / in_place
        self.weight_version = "default"
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.released: set[str] = set()
        self.session_open = False
        self.flushes = 0
        self.hang: set[str] = set()
        self.fail: dict[str, str] = {}
        self.token_delay_s = 0.0
        self.log: list[dict[str, Any]] = []
        self.next_rid = 0

    def routes(self) -> dict[tuple[str, str], Callable[[Any, dict], Any]]:
        r: dict[tuple[str, str], Callable[[Any, dict], Any]] = {
            ("GET", "/health_generate"): self.health, ("GET", "/health"): self.health,
            ("GET", "/get_server_info"): self.server_info, ("GET", "/v1/models"): self.models,
            ("GET", "/get_model_info"): self.model_info,
            ("POST", "/generate"): self.generate, ("PUT", "/generate"): self.generate,
            ("GET", "/flush_cache"): self.flush_cache, ("POST", "/flush_cache"): self.flush_cache,
            ("POST", "/pause_generation"): self.pause, ("POST", "/continue_generation"): self.resume,
            ("POST", "/init_weights_update_group"): self.init_group,
            ("POST", "/destroy_weights_update_group"): self.destroy_group,
            ("POST", "/update_weights_from_distributed"): self.update_distributed,
            ("POST", "/update_weights_from_disk"): self.update_disk,
            ("GET", "/_contract/weights"): self.contract_weights, ("GET", "/_contract/log"): lambda b, q: self.log,
            ("GET", "/_contract/state"): self.contract_state, ("POST", "/_contract/configure"): self.configure,
        }
        for method in ("GET", "POST"):
            r[(method, "/release_memory_occupation")] = self.release_memory
            r[(method, "/resume_memory_occupation")] = self.resume_memory
        if self.profile == "0.5.23":
            r[("GET", "/server_info")] = self.server_info
            r[("GET", "/model_info")] = self.model_info
            r[("POST", "/begin_weight_update")] = self.begin_session
            r[("POST", "/end_weight_update")] = self.end_session
        if self.profile == "0.4.10":   # only what version detection reads
            r = {k: v for k, v in r.items() if k[1] in ("/health_generate", "/get_server_info") or "_contract" in k[1]}
        return r

    # ---- info ---------------------------------------------------------------------------------------

    def health(self, body: Any, query: dict) -> Any:
        return Reject(200, "", text=True)   # Response(status_code=200): no body

    def server_info(self, body: Any, query: dict) -> Any:
        # {**dataclasses.asdict(server_args), **scheduler_info, "internal_states": [...], "version": __version__}
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "host": "127.0.0.1",
                "tp_size": 1, "dp_size": 1, "pp_size": 1, "context_length": None,
                "enable_memory_saver": self.memory_saver, "weight_version": self.weight_version,
                "skip_tokenizer_init": False, "max_total_num_tokens": 4096, "max_req_input_len": self.context - 1,
                "internal_states": [{"last_gen_throughput": 0.0}], "version": self.profile}

    def model_info(self, body: Any, query: dict) -> Any:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version}

    def models(self, body: Any, query: dict) -> Any:
        return {"object": "list", "data": [{"id": self.model_path, "object": "model", "created": 0,
                                            "owned_by": "sglang", "root": self.model_path,
                                            "max_model_len": self.context}]}

    def contract_weights(self, body: Any, query: dict) -> Any:
        return {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "checksum": blake2b_hex(t)}
                for n, t in self.weights.items()}

    def contract_state(self, body: Any, query: dict) -> Any:
        return {"paused": self.paused, "running": self.running, "parked": self.parked, "flushes": self.flushes,
                "released": sorted(self.released), "session_open": self.session_open, "groups": sorted(self.groups),
                "weight_version": self.weight_version}

    def configure(self, body: Any, query: dict) -> Any:
        with self.cv:
            self.hang = set(body.get("hang", self.hang))
            self.fail = dict(body.get("fail", self.fail))
            self.token_delay_s = float(body.get("token_delay_s", self.token_delay_s))
            self.cv.notify_all()
        return {"ok": True}

    # ---- generation ---------------------------------------------------------------------------------

    def _sampling(self, params: Any) -> dict[str, Any]:
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise validation_error("sampling_params must be an object (or a list of objects)")
        unknown = sorted(set(params) - SAMPLING_KEYS)
        if unknown:   # SamplingParams(**sampling_params) raises TypeError
            raise error_response(f"SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'")
        p = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 128, "stop_token_ids": None,
             "ignore_eos": False, **params}
        if p["temperature"] < 0:   # SamplingParams.verify()
            raise error_response(f"temperature must be non-negative, got {p['temperature']}.")
        if not 0 < p["top_p"] <= 1:
            raise error_response(f"top_p must be in (0, 1], got {p['top_p']}.")
        if p["top_k"] < 1 and p["top_k"] != -1:
            raise error_response(f"top_k must be -1 (disable), or at least 1, got {p['top_k']}.")
        if p["max_new_tokens"] is not None and p["max_new_tokens"] < 0:
            raise error_response(f"max_new_tokens must be at least 0, got {p['max_new_tokens']}.")
        return p

    def generate(self, body: Any, query: dict) -> Any:
        req = fields(body, {"input_ids": ((list,), _MISSING), "sampling_params": ((dict, list), None),
                            "return_logprob": ((bool, list), False), "stream": ((bool,), False),
                            "rid": ((str, list), None), "logprob_start_len": ((int, list), None)})
        if req["stream"]:
            raise validation_error("the contract server does not stream")
        ids = req["input_ids"]
        single = bool(ids) and isinstance(ids[0], int)
        prompts = [ids] if single else ids
        if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
            raise validation_error("input_ids must be a non-empty list of ints or of lists of ints")
        params = req["sampling_params"]
        samplings = [self._sampling(p) for p in params] if isinstance(params, list) else \
            [self._sampling(params)] * len(prompts)
        for p in prompts:
            if len(p) >= self.context:   # TokenizerManager._validate_one_request
                raise error_response(f"The input ({len(p)} tokens) is longer than the model's context length "
                                     f"({self.context} tokens).")
            if max(p) >= self.vocab:
                raise error_response(f"The input_ids {p} contains values greater than the vocab size ({self.vocab}).")
        with self.cv:   # a request that arrives while paused waits (TokenizerManager.is_pause_cond)
            self.cv.wait_for(lambda: self.paused is None)
            self.running += 1
        try:
            logprob = bool(req["return_logprob"])
            items = [self._one(p, s, logprob=logprob) for p, s in zip(prompts, samplings, strict=False)]
        finally:
            with self.cv:
                self.running -= 1
                self.cv.notify_all()
        return items[0] if single else items

    def _one(self, prompt: list[int], p: dict[str, Any], *, logprob: bool) -> dict[str, Any]:
        self.next_rid += 1
        stops = set(p["stop_token_ids"] or ()) | (set() if p["ignore_eos"] else {self.eos})
        budget = min(p["max_new_tokens"], self.context - len(prompt))
        tokens: list[int] = []
        finish: dict[str, Any] = {"type": "length", "length": budget}
        for i in range(budget):
            if self._boundary():
                finish = {"type": "abort", "message": "Abort by pause_generation.", "status_code": None,
                          "err_type": None}
                break
            token = (prompt[-1] + 1 + i) % self.vocab
            tokens.append(token)
            if token in stops:
                finish = {"type": "stop", "matched": token}
                break
        meta = {"id": f"rid-{self.next_rid}", "finish_reason": finish, "prompt_tokens": len(prompt),
                "weight_version": self.weight_version, "completion_tokens": len(tokens), "cached_tokens": 0,
                "e2e_latency": 0.0}
        if logprob:
            meta["output_token_logprobs"] = [[-(0.25 + 0.01 * t), t, None] for t in tokens]
        return {"text": " ".join(str(t) for t in tokens), "output_ids": tokens, "meta_info": meta}

    def _boundary(self) -> bool:
        """Between tokens: True = aborted; retract / in_place park the request until continue_generation."""
        if self.token_delay_s:
            time.sleep(self.token_delay_s)
        with self.cv:
            if self.paused == "abort":
                return True
            if self.paused in ("retract", "in_place"):
                self.parked += 1
                self.cv.notify_all()
                self.cv.wait_for(lambda: self.paused not in ("retract", "in_place"))
                self.parked -= 1
                return self.paused == "abort"
        return False

    def pause(self, body: Any, query: dict) -> Any:
        req = fields(body, {"mode": ((str,), "abort"), "rid": ((str, type(None)), None)})
        if req["mode"] not in ("abort", "retract", "in_place"):   # Literal["abort", "retract", "in_place"]
            raise validation_error(f"Input should be 'abort', 'retract' or 'in_place', got {req['mode']!r}")
        with self.cv:
            self.paused = req["mode"]
            self.cv.notify_all()
            if req["mode"] != "abort":   # the scheduler stops at its next step
                self.cv.wait_for(lambda: self.parked == self.running, timeout=10)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body: Any, query: dict) -> Any:
        fields(body, {"torch_empty_cache": ((bool,), True), "rid": ((str, type(None)), None)})
        with self.cv:
            self.paused = None
            self.cv.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _flush(self) -> bool:
        """Scheduler.flush_cache: refused while requests hold KV cache in the running batch (in_place)."""
        with self.cv:
            if self.paused == "in_place" and self.parked:
                return False
            self.flushes += 1
            return True

    def flush_cache(self, body: Any, query: dict) -> Any:
        if not self._flush():
            raise Reject(400, "Cache not flushed: there are running requests (pause mode in_place).\n", text=True)
        return Reject(200, "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                           "waiting requests, the operation will not be performed.)\n", text=True)

    # ---- weights ------------------------------------------------------------------------------------

    def init_group(self, body: Any, query: dict) -> Any:
        req = fields(body, {"master_address": ((str,), _MISSING), "master_port": ((int,), _MISSING),
                            "rank_offset": ((int,), _MISSING), "world_size": ((int,), _MISSING),
                            "group_name": ((str,), "weight_update_group"), "backend": ((str,), "nccl"),
                            "rid": ((str, type(None)), None)})
        if not req["group_name"]:
            return failure("Failed to initialize custom process group: Group name cannot be empty.")
        rank = req["rank_offset"] + 0   # rank_offset + tp_rank (tp_size 1)
        try:
            pg = init_custom_process_group(req["backend"], f"tcp://{req['master_address']}:{req['master_port']}",
                                           self.pg_timeout, req["world_size"], rank, req["group_name"])
        except Exception as exc:  # noqa: BLE001 - ModelRunner.init_weights_update_group's answer
            return failure(f"Failed to initialize custom process group: {exc}.")
        self.groups[req["group_name"]] = pg
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body: Any, query: dict) -> Any:
        req = fields(body, {"group_name": ((str,), "weight_update_group"), "rid": ((str, type(None)), None)})
        pg = self.groups.pop(req["group_name"], None)
        if pg is None:
            return failure(f"Group {req['group_name']} not in {sorted(self.groups)}.")
        dist.destroy_process_group(pg)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_distributed(self, body: Any, query: dict) -> Any:
        req = fields(body, {"names": ((list,), _MISSING), "dtypes": ((list,), _MISSING), "shapes": ((list,), _MISSING),
                            "group_name": ((str,), "weight_update_group"), "flush_cache": ((bool,), True),
                            "abort_all_requests": ((bool,), False), "weight_version": ((str, type(None)), None),
                            "load_format": ((str, type(None)), None), "torch_empty_cache": ((bool,), False),
                            "rid": ((str, type(None)), None)})
        if not len(req["names"]) == len(req["dtypes"]) == len(req["shapes"]):
            return failure("names, dtypes and shapes must have the same length")
        if self.profile == "0.5.23" and not self.session_open:
            return failure("update_weights_from_distributed must be called between begin_weight_update and "
                           "end_weight_update")
        if req["group_name"] not in self.groups:
            return failure(f"Group {req['group_name']} not in {sorted(self.groups)}. Please call "
                           f"`init_weights_update_group` first.")
        try:
            dtypes = [getattr(torch, d) for d in req["dtypes"]]
            assert all(isinstance(d, torch.dtype) for d in dtypes)
            shapes = [[int(x) for x in s] for s in req["shapes"]]
        except (AttributeError, AssertionError, TypeError, ValueError) as exc:
            return failure(f"Failed to update parameter online: {exc!r}.")
        pg = self.groups[req["group_name"]]
        try:
            receive = self._receive_flattened if req["load_format"] == "flattened_bucket" else self._receive_per_tensor
            received = receive(pg, req["names"], dtypes, shapes, device=self.device)
        except Exception as exc:  # noqa: BLE001 - ModelRunner's answer to a failed receive
            return failure(f"Failed to update parameter online: {exc}. The full weights of the ModelRunner are "
                           f"partially updated. Please discard the whole weights.")
        return self._loaded(received, req, message="Succeeded to update parameter online.")

    @staticmethod
    def _receive_per_tensor(pg: dist.ProcessGroup, names: list[str], dtypes: list[torch.dtype],
                            shapes: list[list[int]], *, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        """ModelRunner.update_weights_from_distributed: one async broadcast per announced tensor, then wait."""
        weights, handles = [], []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=False):
            weight = torch.empty(shape, dtype=dtype, device=device)
            handles.append(dist.broadcast(weight, src=0, group=pg, async_op=True))
            weights.append((name, weight))
        for handle in handles:
            handle.wait()
        return weights

    @staticmethod
    def _receive_flattened(pg: dist.ProcessGroup, names: list[str], dtypes: list[torch.dtype],
                           shapes: list[list[int]], *, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        """_update_bucketed_weights_from_distributed: FlattenedTensorBucket (supports_multi_dtypes: each tensor
        flattened, viewed as uint8, concatenated without padding), one broadcast, then reconstruct_tensors()."""
        named = [(n, torch.empty(s, dtype=d, device=device)) for n, d, s in zip(names, dtypes, shapes, strict=False)]
        flattened = torch.cat([t.flatten().view(torch.uint8) for _, t in named], dim=0)
        dist.broadcast(flattened, src=0, group=pg)
        out, start = [], 0
        for name, t in named:
            end = start + t.numel() * t.element_size()
            out.append((name, flattened[start:end].view(t.dtype).reshape(t.shape).clone()))
            start = end
        return out

    def _loaded(self, received: list[tuple[str, torch.Tensor]], req: dict[str, Any], *, message: str,
                **extra: Any) -> Any:
        self.weights.update({name: t for name, t in received})
        if req["flush_cache"] and not self._flush():   # the scheduler asserts the flush after an update
            return failure("Cache flush failed after updating weights: requests are still in the running batch "
                           "(pause mode in_place keeps them)", **extra)
        if req["weight_version"] is not None:
            self.weight_version = req["weight_version"]
            message += f" Weight version updated to {req['weight_version']}."
        return {"success": True, "message": message, **extra}

    def update_disk(self, body: Any, query: dict) -> Any:
        req = fields(body, {"model_path": ((str,), _MISSING), "load_format": ((str, type(None)), None),
                            "abort_all_requests": ((bool,), False), "weight_version": ((str, type(None)), None),
                            "is_async": ((bool,), False), "torch_empty_cache": ((bool,), False),
                            "keep_pause": ((bool,), False), "recapture_cuda_graph": ((bool,), False),
                            "token_step": ((int,), 0), "flush_cache": ((bool,), True),
                            "manifest": ((dict, type(None)), None), "rid": ((str, type(None)), None)})
        from safetensors.torch import load_file

        files = sorted(Path(req["model_path"]).glob("*.safetensors"))
        if not files:
            return failure(f"Failed to get weights iterator: Cannot find any model weights with "
                           f"`{req['model_path']}`", num_paused_requests=0)
        received = [item for f in files for item in load_file(str(f)).items()]
        return self._loaded(received, req, message="Succeeded to update model weights.", num_paused_requests=0)

    def begin_session(self, body: Any, query: dict) -> Any:
        fields(body, {"selector": ((str,), "all"), "rid": ((str, type(None)), None)})
        if self.session_open:
            return failure("A weight update session is already open.")
        self.session_open = True
        return {"success": True, "message": "Weight update session started."}

    def end_session(self, body: Any, query: dict) -> Any:
        fields(body, {"rid": ((str, type(None)), None)})
        if not self.session_open:
            return failure("No weight update session is open.")
        self.session_open = False
        return {"success": True, "message": "Weight update session ended."}

    # ---- memory -------------------------------------------------------------------------------------

    def _tags(self, body: Any) -> list[str]:
        req = fields(body, {"tags": ((list, type(None)), None), "rid": ((str, type(None)), None)})
        tags = req["tags"] if req["tags"] is not None else list(MEMORY_TAGS)
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise error_response(f"unknown memory tag(s) {bad}")
        return tags

    def release_memory(self, body: Any, query: dict) -> Any:
        tags = self._tags(body)
        with self.cv:
            if self.running and not self.paused:
                raise error_response("release_memory_occupation: the scheduler is not idle")
        if self.memory_saver:   # without --enable-memory-saver the adapter is a no-op and answers success
            self.released.update(tags)
        return None

    def resume_memory(self, body: Any, query: dict) -> Any:
        tags = self._tags(body)
        if self.memory_saver:
            self.released.difference_update(tags)
        return None


def make_handler(state: Server, *, api_key: str | None) -> type[BaseHTTPRequestHandler]:
    routes = state.routes()
    paths = {p for _, p in routes}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, body: Any, *, text: bool = False) -> None:
            raw = (body if isinstance(body, str) else "").encode() if text else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8" if text else "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _dispatch(self, method: str) -> None:
            path = urlsplit(self.path).path
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if api_key and not path.startswith("/_contract/") and \
                    self.headers.get("Authorization") != f"Bearer {api_key}":
                return self._send(401, {"error": "Unauthorized"})
            try:
                body = json.loads(raw) if raw.strip() else None
            except ValueError:
                return self._send(400, validation_error("JSON decode error").body)
            if not path.startswith("/_contract/"):
                state.log.append({"method": method, "path": path, "body": body})
            with state.cv:   # a hung route answers nothing until it is configured away
                state.cv.wait_for(lambda: path not in state.hang)
            if path in state.fail:
                message = state.fail[path]
                reply = failure(message) if "weight" in path or "group" in path else error_response(message)
                return self._send(reply.status, reply.body)
            route = routes.get((method, path))
            if route is None:
                status, detail = (405, "Method Not Allowed") if path in paths else (404, "Not Found")
                return self._send(status, {"detail": detail})
            try:
                result = route(body, {})
            except Reject as exc:
                result = exc
            if isinstance(result, Reject):
                return self._send(result.status, result.body, text=result.text)
            return self._send(200, result)

    return Handler


class ContractServer:
    """The test's handle on a contract server process (started here, stopped by `stop`)."""

    def __init__(self, *args: str, startup_timeout_s: float = 60.0):
        import os
        import queue
        import subprocess

        env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], stdout=subprocess.PIPE,
                                     text=True, env=env)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        try:
            line = lines.get(timeout=startup_timeout_s)
        except queue.Empty:
            self.stop()
            raise TimeoutError(f"contract server {args} did not start within {startup_timeout_s}s") from None
        if not line.startswith("SGLANG_CONTRACT_READY "):
            self.stop()
            raise RuntimeError(f"contract server said {line!r}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def call(self, method: str, path: str, body: Any = None, *, timeout_s: float = 30.0) -> Any:
        import urllib.request

        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return json.loads(answer.read() or b"null")

    def configure(self, **settings: Any) -> None:
        self.call("POST", "/_contract/configure", settings)

    def weights(self) -> dict[str, dict[str, Any]]:
        return self.call("GET", "/_contract/weights")

    def log(self) -> list[dict[str, Any]]:
        return self.call("GET", "/_contract/log")

    def state(self) -> dict[str, Any]:
        return self.call("GET", "/_contract/state")

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)   # in case a test stopped it
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=PROFILES, default="0.5.23")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=22)
    parser.add_argument("--eos", type=int, default=2)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--model-path", default="/models/contract-tiny")
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--pg-timeout-s", type=float, default=30.0)
    parser.add_argument("--device", default="cpu", help="where received tensors live; cuda:N for backend nccl")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))   # as SGLang's scheduler process has its GPU set
    state = Server(args)
    httpd = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(state, api_key=args.api_key))
    httpd.daemon_threads = True
    print(f"SGLANG_CONTRACT_READY {httpd.server_address[1]}", flush=True)
    try:
        httpd.serve_forever(poll_interval=0.1)
    finally:
        httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

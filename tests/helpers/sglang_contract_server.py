"""A contract test server for the sglang engine: SGLang's native HTTP API, as recorded from SGLang's source.

    python tests/helpers/sglang_contract_server.py --profile 0.5.17 [--enable-memory-saver] [--vocab 22]

Listens on 127.0.0.1 (a free port unless --port) and prints `SGLANG_CONTRACT_READY <port>`. It is a real HTTP server
in its own process that implements the request and answer shapes of the SGLang versions the adapter supports; it
imports nothing from Tandem, so a mistake in the adapter's shapes is not mirrored here. Generation is a fixed
deterministic rule (no model): token i of a sample is (last prompt token + 1 + i) mod vocab, and its log-prob
-(0.25 + 0.01 token + 0.1 v) under the weights of version v that computed it (so a weight update that lands while a
request is parked by retract / in_place shows in the later tokens' log-probs, as a real model's would).

Recorded from (versions as read; see services/rollout/engines/sglang/protocol.py for the adapter's side):
- the SGLang 0.5.17 wheel, read whole (/work/notes/sglang_0517.md; a real 0.5.17 server ran on an H200, see
  docs/sglang.md): routes of that version, /generate's meta_info fields, the finish reasons of a running and a
  waiting abort, 400 when input + max_new_tokens exceed the context, 499 for a request aborted while it waited,
  500 for an unknown sampling key, /flush_cache failing whenever a request runs or waits, and the places where its
  scheduler raises instead of answering (a release while busy, resuming a tag that was not released, a failed flush
  inside an update, a tensor payload it cannot read): this server dies there too (exit 70, see `crash`);
- python/sglang/srt/entrypoints/http_server.py (0.5.3rc2 and a later 0.5.x): the 400 shapes (`{"success": false,
  "message"}` for weight/group routes, `{"error": {"message"}}` from _create_error_response, `{"object": "error",
  "message", "type": "Bad Request", "param", "code": 400}` for request validation), 404 `{"detail": "Not Found"}`;
- python/sglang/srt/managers/io_struct.py (0.5.x): the request fields and defaults of every route served;
- python/sglang/srt/sampling/sampling_params.py: accepted sampling keys and SamplingParams.verify()'s messages;
  normalize()'s stop_str_max_len (tokens of the longest stop string);
- python/sglang/srt/managers/schedule_batch.py (0.5.x Req.check_finished): a stop string is searched in the decoded
  tail of stop_str_max_len + 1 output tokens (special tokens kept) after each token; the token that completes it
  ends the request and stays in output_ids / output_token_logprobs, finish_reason {"type": "stop", "matched":
  "<the string>"}; detokenizer_manager.trim_matched_stop cuts `text` before the string (with --tokenizer DIR only);
- python/sglang/srt/utils (init_custom_process_group) and model_runner.update_weights_from_distributed (0.5.x): the
  group join and the per-tensor / flattened_bucket receive (sglang_contract_weights.py);
- 0.5.23's begin/end_weight_update session rule: /work/shared/FACTS.md (checked in the 0.5.23 wheel).

Deviations, on purpose: unknown request fields are refused with 400 (SGLang ignores them) so that an adapter typo
cannot pass silently; the group join uses --pg-timeout-s (SGLang uses torch's default_pg_timeout, 30 min); tensors
are received on --device (cpu unless told; SGLang receives on its GPU); only tp_size 1; tensor payloads are checked,
never loaded (sglang_contract_weights.py). Profiles: 0.4.10 only answers version queries (for the
unsupported-version test); 0.5.15 serves /get_server_info but not /server_info; 0.5.17 serves both info routes and
/update_weights_from_tensor, and no begin/end routes; 0.5.23 also requires begin/end around distributed and tensor
updates. `--server-arg KEY=JSON` adds a ServerArgs field to /server_info (e.g. rl_on_policy_target="fsdp").

Test instrumentation, not SGLang: GET /_contract/weights (received tensors: dtype, shape, blake2b-128 of the raw
bytes), GET /_contract/log (every request), GET /_contract/state, POST /_contract/configure ({"hang": [paths],
"fail": {path: message}, "token_delay_s": s}) — a hung route answers nothing until it is configured away.
"""

from __future__ import annotations

import argparse
import datetime
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

PROFILES = ("0.4.10", "0.5.15", "0.5.17", "0.5.23")
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
SAMPLING_KEYS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_new_tokens",
    "min_new_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "sampling_seed",
    "json_schema",
    "regex",
    "ebnf",
    "custom_params",
    "stream_interval",
    "logit_bias",
}

if __package__:  # imported as tests/helpers' module, or run as a script (its directory is then on sys.path)
    from .sglang_contract_weights import (
        _MISSING,
        Reject,
        WeightRoutes,
        blake2b_hex,
        crash,
        error_response,
        failure,
        fields,
        validation_error,
    )
else:
    from sglang_contract_weights import (  # type: ignore[no-redef]
        _MISSING,
        Reject,
        WeightRoutes,
        blake2b_hex,
        crash,
        error_response,
        failure,
        fields,
        validation_error,
    )

__all__ = ["ContractServer", "blake2b_hex"]


class Server(WeightRoutes):
    """The state of one fake SGLang server; every route is a method taking the JSON body (and the query)."""

    def __init__(self, args: argparse.Namespace):
        self.profile: str = args.profile
        self.vocab, self.eos, self.context = args.vocab, args.eos, args.context
        self.memory_saver = args.enable_memory_saver
        self.weights_cpu_backup = args.enable_weights_cpu_backup
        self.extra_args = dict(args.server_arg)
        self.pg_timeout = datetime.timedelta(seconds=args.pg_timeout_s)
        self.model_path = args.model_path
        self.tokenizer = None  # SGLang's tokenizer manager loads it with AutoTokenizer; needed for stop strings
        if args.tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        self.device = torch.device(args.device)  # where received tensors live (SGLang: the model's GPU)
        self.cv = threading.Condition()
        self.paused: str | None = None  # pause_generation mode, None = generating
        self.aborts = 0  # pause_generation(abort) calls so far
        self.running = 0  # generate requests inside the scheduler
        self.parked = 0  # of those, stopped by retract / in_place
        self.weight_version = "default"
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.tensor_updates: list[dict[str, Any]] = []
        self.weights_lost = False  # resumed without --enable-weights-cpu-backup, no update since
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
            ("GET", "/health_generate"): self.health,
            ("GET", "/health"): self.health,
            ("GET", "/get_server_info"): self.server_info,
            ("GET", "/v1/models"): self.models,
            ("GET", "/get_model_info"): self.model_info,
            ("POST", "/generate"): self.generate,
            ("PUT", "/generate"): self.generate,
            ("GET", "/flush_cache"): self.flush_cache,
            ("POST", "/flush_cache"): self.flush_cache,
            ("POST", "/pause_generation"): self.pause,
            ("POST", "/continue_generation"): self.resume,
            ("POST", "/init_weights_update_group"): self.init_group,
            ("POST", "/destroy_weights_update_group"): self.destroy_group,
            ("POST", "/update_weights_from_distributed"): self.update_distributed,
            ("POST", "/update_weights_from_disk"): self.update_disk,
            ("GET", "/_contract/weights"): self.contract_weights,
            ("GET", "/_contract/log"): lambda b, q: self.log,
            ("GET", "/_contract/state"): self.contract_state,
            ("POST", "/_contract/configure"): self.configure,
        }
        for method in ("GET", "POST"):
            r[(method, "/release_memory_occupation")] = self.release_memory
            r[(method, "/resume_memory_occupation")] = self.resume_memory
        if self.profile in ("0.5.17", "0.5.23"):
            r[("GET", "/server_info")] = self.server_info
            r[("GET", "/model_info")] = self.model_info
            r[("POST", "/update_weights_from_tensor")] = self.update_tensor
        if self.profile == "0.5.23":
            r[("POST", "/begin_weight_update")] = self.begin_session
            r[("POST", "/end_weight_update")] = self.end_session
        if self.profile == "0.4.10":  # only what version detection reads
            r = {k: v for k, v in r.items() if k[1] in ("/health_generate", "/get_server_info") or "_contract" in k[1]}
        return r

    # ---- info ---------------------------------------------------------------------------------------

    def health(self, body: Any, query: dict) -> Any:
        return Reject(200, "", text=True)  # Response(status_code=200): no body

    def server_info(self, body: Any, query: dict) -> Any:
        # {**dataclasses.asdict(server_args), **scheduler_info, "internal_states": [...], "version": __version__}
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "host": "127.0.0.1",
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "context_length": None,
            "enable_memory_saver": self.memory_saver,
            "enable_weights_cpu_backup": self.weights_cpu_backup,
            "rl_on_policy_target": None,
            "enable_deterministic_inference": False,
            "weight_version": self.weight_version,
            "skip_tokenizer_init": False,
            "max_total_num_tokens": 4096,
            "max_req_input_len": self.context - 1,
            **self.extra_args,
            "internal_states": [{"last_gen_throughput": 0.0}],
            "version": self.profile,
        }

    def model_info(self, body: Any, query: dict) -> Any:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
        }

    def models(self, body: Any, query: dict) -> Any:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_path,
                    "object": "model",
                    "created": 0,
                    "owned_by": "sglang",
                    "root": self.model_path,
                    "max_model_len": self.context,
                }
            ],
        }

    def contract_weights(self, body: Any, query: dict) -> Any:
        return {
            n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "checksum": blake2b_hex(t)}
            for n, t in self.weights.items()
        }

    def contract_state(self, body: Any, query: dict) -> Any:
        return {
            "paused": self.paused,
            "running": self.running,
            "parked": self.parked,
            "flushes": self.flushes,
            "released": sorted(self.released),
            "session_open": self.session_open,
            "groups": sorted(self.groups),
            "weight_version": self.weight_version,
            "weights_lost": self.weights_lost,
            "tensor_updates": self.tensor_updates,
        }

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
        if unknown:  # SamplingParams(**...) raises TypeError, which no handler catches: FastAPI's plain 500
            raise Reject(500, "Internal Server Error", text=True)
        p = {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": 128,
            "stop_token_ids": None,
            "ignore_eos": False,
            **params,
        }
        if p["temperature"] < 0:  # SamplingParams.verify()
            raise error_response(f"temperature must be a non-negative finite number, got {p['temperature']}.")
        if not 0 < p["top_p"] <= 1:
            raise error_response(f"top_p must be in (0, 1], got {p['top_p']}.")
        if p["top_k"] < 1 and p["top_k"] != -1:
            raise error_response(f"top_k must be -1 (disable) or at least 1, got {p['top_k']}.")
        if p["max_new_tokens"] is not None and p["max_new_tokens"] < 0:
            raise error_response(f"max_new_tokens must be at least 0, got {p['max_new_tokens']}.")
        return self._stop_strings(p)

    def _stop_strings(self, p: dict[str, Any]) -> dict[str, Any]:
        """SamplingParams.normalize: `stop` as a list, and stop_str_max_len = the most tokens one encodes to."""
        stops = p.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        if stops and self.tokenizer is None:  # a deviation: this server has a tokenizer only with --tokenizer
            raise error_response("the contract server matches stop strings only when started with --tokenizer")
        p["stop_strs"] = stops
        tokenizer = self.tokenizer
        p["stop_str_max_len"] = (
            max((len(tokenizer.encode(s, add_special_tokens=False)) for s in stops), default=0)
            if tokenizer is not None
            else 0
        )
        return p

    def _matched_stop(self, tokens: list[int], p: dict[str, Any]) -> str | None:
        """Req.check_finished: the tail of stop_str_max_len + 1 tokens, decoded with its special tokens."""
        if not p["stop_strs"] or self.tokenizer is None:
            return None
        tail = self.tokenizer.decode(tokens[-(p["stop_str_max_len"] + 1) :])
        return next((s for s in p["stop_strs"] if s in tail), None)

    def _text(self, tokens: list[int], finish: dict[str, Any], p: dict[str, Any]) -> str:
        """The detokenizer's text: special tokens skipped, cut before a matched stop string (no_stop_trim off)."""
        if self.tokenizer is None:
            return " ".join(str(t) for t in tokens)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence
        matched = finish.get("matched")
        if isinstance(matched, str) and matched in text and not p.get("no_stop_trim"):
            text = text[: text.find(matched)]
        return text

    def _validate_lengths(self, prompt: list[int], max_new_tokens: int | None) -> None:
        """TokenizerManager._validate_one_request (validate_total_tokens, no auto-truncation)."""
        if len(prompt) >= self.context:
            raise error_response(
                f"The input ({len(prompt)} tokens) is longer than the model's context length ({self.context} tokens)."
            )
        if max_new_tokens is not None and len(prompt) + max_new_tokens > self.context:
            raise error_response(
                f"Requested token count exceeds the model's maximum context length of {self.context} tokens. You "
                f"requested a total of {len(prompt) + max_new_tokens} tokens: {len(prompt)} tokens from the input "
                f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in the "
                f"input messages or the completion to fit within the limit."
            )
        if max(prompt) >= self.vocab:
            raise error_response(f"The input_ids {prompt} contains values greater than the vocab size ({self.vocab}).")

    def generate(self, body: Any, query: dict) -> Any:
        req = fields(
            body,
            {
                "input_ids": ((list,), _MISSING),
                "sampling_params": ((dict, list), None),
                "return_logprob": ((bool, list), False),
                "stream": ((bool,), False),
                "rid": ((str, list), None),
                "logprob_start_len": ((int, list), None),
            },
        )
        if req["stream"]:
            raise validation_error("the contract server does not stream")
        ids = req["input_ids"]
        single = bool(ids) and isinstance(ids[0], int)
        prompts = [ids] if single else ids
        if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
            raise validation_error("input_ids must be a non-empty list of ints or of lists of ints")
        params = req["sampling_params"]
        samplings = (
            [self._sampling(p) for p in params] if isinstance(params, list) else [self._sampling(params)] * len(prompts)
        )
        for p, sp in zip(prompts, samplings, strict=False):
            self._validate_lengths(p, sp["max_new_tokens"])
        with self.cv:  # a request that arrives while paused waits (TokenizerManager.is_pause_cond) ...
            aborts = self.aborts
            self.cv.wait_for(lambda: self.paused is None)
            if self.aborts != aborts:  # ... and one a pause(abort) reached meanwhile fails after continue
                self.next_rid += 1
                raise error_response(f"Request rid-{self.next_rid} was aborted", status=499)
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
        # the scheduler's clamp (0.5.17 scheduler.py): at most max_req_len (context - 1) - input - 1 new tokens, so
        # a request the tokenizer manager let through may still end 2 tokens short of the context
        budget = max(0, min(p["max_new_tokens"], self.context - 1 - len(prompt) - 1))
        tokens: list[int] = []
        log_probs: list[float] = []  # of the weights that computed each token: an update may land while parked
        finish: dict[str, Any] = {"type": "length", "length": budget}
        for i in range(budget):
            if self._boundary():  # a running request's abort (a waiting one's says "Abort in waiting queue")
                finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                break
            token = (prompt[-1] + 1 + i) % self.vocab
            tokens.append(token)
            log_probs.append(-(0.25 + 0.01 * token + 0.1 * self.version_number()))
            if token in stops:
                finish = {"type": "stop", "matched": token}
                break
            matched = self._matched_stop(tokens, p)
            if matched is not None:  # FINISH_MATCHED_STR: the completing token stays in output_ids
                finish = {"type": "stop", "matched": matched}
                break
        meta: dict[str, Any] = {
            "id": f"rid-{self.next_rid}",
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "weight_version": self.weight_version,
            "num_retractions": 0,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "reasoning_tokens": 0,
            "e2e_latency": 0.0,
        }
        if logprob:  # logprob_start_len -1 starts at the input's end: no input log-probs
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(log_probs, tokens, strict=True)]
            meta["output_token_logprobs_length"] = len(tokens)
        return {"text": self._text(tokens, finish, p), "output_ids": tokens, "meta_info": meta}

    def version_number(self) -> int:
        """The weight version as a number ("default" and other non-numbers: 0)."""
        return int(self.weight_version) if self.weight_version.isdigit() else 0

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
        if req["mode"] not in ("abort", "retract", "in_place"):  # Literal["abort", "retract", "in_place"]
            raise validation_error(f"Input should be 'abort', 'retract' or 'in_place', got {req['mode']!r}")
        with self.cv:
            self.paused = req["mode"]
            self.aborts += req["mode"] == "abort"
            self.cv.notify_all()
            if req["mode"] == "abort":  # it returns once no request holds the model-update lock
                self.cv.wait_for(lambda: self.running == 0, timeout=10)
            else:  # the scheduler stops at its next step
                self.cv.wait_for(lambda: self.parked == self.running, timeout=10)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body: Any, query: dict) -> Any:
        fields(body, {"torch_empty_cache": ((bool,), True), "rid": ((str, type(None)), None)})
        with self.cv:
            self.paused = None
            self.cv.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def idle(self) -> bool:
        """Scheduler.is_fully_idle: nothing running, parked (in_place keeps it in the running batch) or waiting
        (retract puts it back in the waiting queue)."""
        with self.cv:
            return self.running == 0

    def _flush(self) -> bool:
        """Scheduler.flush_cache: refused unless the scheduler is fully idle."""
        if not self.idle():
            return False
        with self.cv:
            self.flushes += 1
        return True

    def flush_cache(self, body: Any, query: dict) -> Any:
        if not self._flush():
            raise Reject(400, "Flush cache failed.\n", text=True)
        return Reject(
            200,
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n",
            text=True,
        )

    # ---- memory -------------------------------------------------------------------------------------

    def _tags(self, body: Any) -> list[str]:
        req = fields(body, {"tags": ((list, type(None)), None), "rid": ((str, type(None)), None)})
        tags = req["tags"] if req["tags"] else list(MEMORY_TAGS)  # null or [] = all
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise error_response(f"unknown memory tag(s) {bad}")
        return tags

    def release_memory(self, body: Any, query: dict) -> Any:
        tags = self._tags(body)
        if not self.idle():
            crash("AssertionError: release_memory_occupation should be called only when server is idle.")
        self.released.update(tags)  # offload_tags, also without --enable-memory-saver (its adapter frees nothing)
        return None

    def resume_memory(self, body: Any, query: dict) -> Any:
        tags = self._tags(body)
        missing = [t for t in tags if t not in self.released]
        if missing:  # offload_tags.remove(tag)
            crash(f"KeyError: {missing[0]!r}")
        self.released.difference_update(tags)
        if "weights" in tags and self.memory_saver and not self.weights_cpu_backup:
            self.weights_lost = True  # the pages come back, their contents do not
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
            if (
                api_key
                and not path.startswith("/_contract/")
                and self.headers.get("Authorization") != f"Bearer {api_key}"
            ):
                return self._send(401, {"error": "Unauthorized"})
            try:
                body = json.loads(raw) if raw.strip() else None
            except ValueError:
                return self._send(400, validation_error("JSON decode error").body)
            if not path.startswith("/_contract/"):
                state.log.append({"method": method, "path": path, "body": body})
            with state.cv:  # a hung route answers nothing until it is configured away
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
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *args], stdout=subprocess.PIPE, text=True, env=env
        )
        lines: queue.Queue[str] = queue.Queue()
        stdout = self.proc.stdout
        assert stdout is not None

        def read_lines() -> None:
            for line in stdout:
                lines.put(line)

        threading.Thread(target=read_lines, daemon=True).start()
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
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
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
            self.proc.send_signal(signal.SIGCONT)  # in case a test stopped it
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=PROFILES, default="0.5.17")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=22)
    parser.add_argument("--eos", type=int, default=2)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--model-path", default="/models/contract-tiny")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory: stop strings and text as SGLang")
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        type=lambda kv: (kv.split("=", 1)[0], json.loads(kv.split("=", 1)[1])),
        help="KEY=JSON: an extra /server_info field",
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--pg-timeout-s", type=float, default=30.0)
    parser.add_argument("--device", default="cpu", help="where received tensors live; cuda:N for backend nccl")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))  # as SGLang's scheduler process has its GPU set
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

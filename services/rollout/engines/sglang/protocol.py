"""SGLang's native HTTP API as the `sglang` engine uses it: supported versions, request bodies, answer mapping.

Pure functions, no I/O. Recorded from SGLang's source (SGLang has no CPU backend: CPU CI runs the adapter against
the contract server; bench/sglang_smoke.py checks these shapes on a real 0.5.17, docs/sglang.md). Sources, by the
version they were read at:

- `python/sglang/srt/entrypoints/http_server.py` — a 0.5.3rc2 snapshot and a later 0.5.x one:
  GET /health_generate (200 | 503); GET /server_info (later) and /get_server_info (both; later a deprecated alias)
  answer `{**server_args, **scheduler_info, "internal_states": [...], "version": __version__}`;
  GET /model_info (later) and /get_model_info (both) carry "weight_version"; GET /v1/models carries
  `data[0].max_model_len`; POST /generate; GET|POST /flush_cache; POST /pause_generation,
  /continue_generation; POST /init_weights_update_group, /destroy_weights_update_group,
  /update_weights_from_distributed, /update_weights_from_disk, /update_weights_from_tensor answer
  `{"success", "message"}` (+ "num_paused_requests" for disk) with 200 or 400; GET|POST
  /release_memory_occupation and /resume_memory_occupation answer 200 (body `null`) or 400 `{"error": ...}`.
- `python/sglang/srt/managers/io_struct.py` (0.5.x): GenerateReqInput (input_ids: list of lists for a batch,
  sampling_params, return_logprob), PauseGenerationReqInput(mode: "abort" | "retract" | "in_place", default
  "abort"), ContinueGenerationReqInput, InitWeightsUpdateGroupReqInput(master_address, master_port,
  rank_offset, world_size, group_name, backend), UpdateWeightsFromDistributedReqInput(names, dtypes, shapes,
  group_name, flush_cache=True, abort_all_requests=False, weight_version, load_format),
  UpdateWeightFromDiskReqInput(model_path, load_format, abort_all_requests, weight_version, flush_cache),
  Release/ResumeMemoryOccupationReqInput(tags: list | None).
- `python/sglang/srt/managers/tokenizer_manager.py` (`_handle_batch_output`): each /generate answer item is
  `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "weight_version", ...,
  "output_token_logprobs": [[logprob, token_id, text | null], ...]}}`; finish_reason is
  `{"type": "stop", "matched": ...}`, `{"type": "length", "length": n}` or `{"type": "abort", "message": ...}`.
- `python/sglang/srt/sampling/sampling_params.py`: top_k -1 disables it (0 is invalid), temperature 0 is greedy,
  `sampling_seed` (0.5.x).
- /begin_weight_update and /end_weight_update: in 0.5.23 update_weights_from_distributed/_tensor fail outside
  such a session and older 0.5.x lack the methods (checked in the 0.5.23 wheel, /work/shared/FACTS.md). Their
  bodies (`{}`; BeginWeightUpdateReqInput's `selector` defaults to "all") and `{"success", "message"}` answers
  follow miles' client (miles/backends/sglang_utils/sglang_engine.py); SGLang's own route source was not read.

- The 0.5.17 wheel (read whole; /work/notes/sglang_0517.md): both info routes, no begin/end routes,
  /update_weights_from_tensor (`serialized_named_tensors`: one base64 MultiprocessingSerializer string per TP rank,
  `load_format` null | "flattened_bucket", `flush_cache`, `weight_version`); /generate answers 400 when
  len(input) + max_new_tokens exceeds the context (it does not clamp) and 499 for a request aborted while it waited;
  every flush_cache inside an update is an assert in the scheduler (a failed flush kills the server), so updates
  never ask for one: the adapter flushes with its own /flush_cache, which answers 400 whenever SGLang is not idle.
  Reported log-probs are log_softmax(logits / T) over the whole vocabulary (no top-k/top-p truncation), T = 1 for
  greedy; `rl_on_policy_target` (bf16 log-probs) and `enable_deterministic_inference` (one seed, 42, for every
  request unless each carries its own) are refused when /server_info shows them.

Supported: 0.5.15 <= version < 0.6 (pyproject's `sglang` extra pins >=0.5.15). From 0.5.23 on the adapter
wraps every distributed update in begin/end; between 0.5.15 and 0.5.23 it probes /begin_weight_update once per
server and uses the session only where the route exists.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from services.contracts.sampling_spec import SamplingSpec
from services.contracts.untyped import JsonObject, JsonValue
from services.rollout.engines.interface import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SampleOutput

MIN_VERSION = (0, 5, 15)
END_VERSION = (0, 6, 0)  # exclusive
SESSION_VERSION = (0, 5, 23)  # begin/end_weight_update required from here on
SUPPORTED_RANGE = ">=0.5.15, <0.6"
SGLANG_PAUSE_MODES = ("abort", "retract", "in_place")
LOAD_FORMATS = ("tensor", "flattened_bucket")

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


class UnsupportedSGLangVersion(ValueError):
    """The server runs an SGLang version whose API this adapter does not know."""


@dataclass(frozen=True)
class ApiProfile:
    version: str
    release: tuple[int, int, int]

    @property
    def session(self) -> str:
        """How distributed weight updates are wrapped: "required" (>= 0.5.23) or "probe"."""
        return "required" if self.release >= SESSION_VERSION else "probe"


def parse_release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of "0.5.23", "0.5.15.post1", "0.5.16rc2", "0.5.23.dev40+g1a2b"; pre- and post-release
    suffixes count as their release."""
    match = _VERSION.match(version or "")
    if not match:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def profile_for(version: str, *, url: str) -> ApiProfile:
    release = parse_release(version)
    if release is None:
        raise UnsupportedSGLangVersion(
            f"SGLang at {url} reports version {version!r}, which is not a version number; "
            f"the sglang engine supports SGLang {SUPPORTED_RANGE}"
        )
    if not MIN_VERSION <= release < END_VERSION:
        raise UnsupportedSGLangVersion(
            f"SGLang at {url} runs version {version}; the sglang engine supports SGLang {SUPPORTED_RANGE} (the "
            f"request and answer shapes of other versions were not recorded — see docs/sglang.md)"
        )
    return ApiProfile(version=version, release=release)


@dataclass(frozen=True)
class ServerInfo:
    version: str
    model_path: str
    tp_size: int
    enable_memory_saver: bool
    weight_version: str
    weights_cpu_backup: bool = False  # --enable-weights-cpu-backup: weights survive a release
    skip_tokenizer_init: bool = False  # --skip-tokenizer-init: no tokenizer, so no stop strings
    radix_cache_off: bool = False  # --disable-radix-cache: no prefix cache (retract then recomputes)


# Server settings that change what SGLang reports or samples, refused with the reason (their /server_info keys).
REFUSED_SERVER_SETTINGS = {
    "rl_on_policy_target": "--rl-on-policy-target makes SGLang report bf16 log-probs of logits/T, which an fp32 "
    "trainer cannot match",
    "enable_deterministic_inference": "--enable-deterministic-inference samples with one seed (42) for every request "
    "that carries none, so every sample of a GRPO group would be the same",
}


def inflight_refusal(inflight_update: str, *, radix_cache_off: bool, where: str) -> str | None:
    """rollout.inflight_update with SGLang 0.5.x, whose pause modes do it: keep is /pause_generation in_place (the
    parked requests keep their KV cache); recompute is retract, which recomputes only without the radix cache: a
    retracted request waits in the queue, so the adapter's /flush_cache fails, and on continue it finds the KV of
    its own tokens, computed by the old weights, in the prefix cache. One line, or None."""
    if inflight_update == "recompute" and not radix_cache_off:
        return (
            f"rollout.inflight_update: recompute needs SGLang without its radix cache ({where} has it on): a "
            "request retracted for the update would reuse its own old-weights KV from the prefix cache; start "
            "SGLang with --disable-radix-cache, or use inflight_update: keep"
        )
    return None


def parse_server_info(info: JsonValue, *, url: str) -> ServerInfo:
    """What the adapter needs from /server_info; refuses layouts whose weight-update ranks it cannot map."""
    if not isinstance(info, dict) or not isinstance(info.get("version"), str):
        raise UnsupportedSGLangVersion(
            f"SGLang at {url}: /server_info has no 'version' string; is this an SGLang "
            f"server? (the sglang engine supports SGLang {SUPPORTED_RANGE})"
        )
    for key in ("dp_size", "pp_size"):
        if int(info.get(key) or 1) != 1:
            raise ValueError(
                f"SGLang at {url} runs with {key}={info[key]}; the sglang engine maps weight-update "
                f"ranks for tensor parallelism only (dp_size 1, pp_size 1): run one server per "
                f"data-parallel replica and list each in rollout.sglang.urls"
            )
    for key, why in REFUSED_SERVER_SETTINGS.items():
        if info.get(key):
            raise ValueError(f"SGLang at {url} runs with {key}={info[key]!r}: {why}; restart it without that flag")
    return ServerInfo(
        version=info["version"],
        model_path=str(info.get("model_path") or ""),
        tp_size=int(info.get("tp_size") or 1),
        enable_memory_saver=bool(info.get("enable_memory_saver", False)),
        weight_version=str(info.get("weight_version") or ""),
        weights_cpu_backup=bool(info.get("enable_weights_cpu_backup", False)),
        skip_tokenizer_init=bool(info.get("skip_tokenizer_init", False)),
        radix_cache_off=bool(info.get("disable_radix_cache", False)),
    )


def parse_weight_version(value: JsonValue) -> int | None:
    """SGLang's weight_version is a free string ("default" until the first update); Tandem writes integers."""
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() else None


# ---- requests -------------------------------------------------------------------------------------


def sampling_params(options: SamplingSpec, *, eos_token_ids: Sequence[int] = ()) -> JsonObject:
    """`eos_token_ids` (the model's, generation_config.json's included) are sent as stop_token_ids unless ignore_eos:
    SGLang versions differ in which of them they stop on by themselves. Stop strings go as `stop`: SGLang ends a
    sample at the token that completes one and keeps it in output_ids (its `text` is cut before the string, which
    the adapter does not read)."""
    params: JsonObject = {
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k if options.top_k > 0 else -1,
        "max_new_tokens": options.max_new_tokens,
        "ignore_eos": options.ignore_eos,
    }
    stop_ids = sorted(set(options.stop_token_ids) | (set() if options.ignore_eos else set(eos_token_ids)))
    if stop_ids:
        params["stop_token_ids"] = stop_ids
    if options.stop:
        params["stop"] = list(options.stop)
    if options.seed is not None:
        params["sampling_seed"] = int(options.seed)
    return params


def generate_body(
    prompts: Sequence[Sequence[int]],
    options: SamplingSpec,
    *,
    max_context: int | None = None,
    budgets: Sequence[int] | None = None,
    eos_token_ids: Sequence[int] = (),
) -> JsonObject:
    """A batch request: input_ids as a list of lists (even for one prompt, so the answer is always a list).

    `budgets`: each prompt's own max_new_tokens (a data row's cap), sent as per-prompt sampling params. SGLang refuses
    the whole request (400) when one prompt's length + max_new_tokens exceeds the context, where the native engine
    stops that sample at the context: prompts that would are sent with their own sampling params, max_new_tokens cut
    to what the context leaves (the prompts are validated shorter than the context). SGLang's scheduler then ends
    such a sample 2 tokens before the context (its max_req_len is the context - 1)."""
    params = sampling_params(options, eos_token_ids=eos_token_ids)
    body: JsonObject = {
        "input_ids": [[int(t) for t in p] for p in prompts],
        "sampling_params": params,
        "return_logprob": True,
        "stream": False,
    }
    caps = list(budgets) if budgets is not None else [options.max_new_tokens] * len(prompts)
    if max_context is not None:
        caps = [max(1, min(c, max_context - len(p))) for c, p in zip(caps, prompts, strict=True)]
    if any(c != options.max_new_tokens for c in caps):
        body["sampling_params"] = [{**params, "max_new_tokens": c} for c in caps]
    return body


def pause_body(mode: str) -> JsonObject:
    if mode not in SGLANG_PAUSE_MODES:
        raise ValueError(f"SGLang pause mode must be one of {', '.join(SGLANG_PAUSE_MODES)}, got {mode!r}")
    return {"mode": mode}


def init_group_body(
    *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> JsonObject:
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def distributed_update_body(
    *,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    group_name: str,
    weight_version: str | None,
    load_format: str,
) -> JsonObject:
    """flush_cache is always false: SGLang asserts that a requested flush succeeds (module docstring)."""
    body: JsonObject = {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(s) for s in shapes],
        "group_name": group_name,
        "flush_cache": False,
        "abort_all_requests": False,
    }
    if weight_version is not None:
        body["weight_version"] = weight_version
    if load_format == "flattened_bucket":
        body["load_format"] = "flattened_bucket"
    return body


def disk_update_body(*, model_path: str, weight_version: str) -> JsonObject:
    return {
        "model_path": model_path,
        "weight_version": weight_version,
        "flush_cache": False,
        "abort_all_requests": False,
    }


def tensor_update_body(*, payloads: Sequence[str], load_format: str, weight_version: str | None) -> JsonObject:
    """/update_weights_from_tensor for one bucket: `payloads` holds one serialised bucket per TP rank of the server
    (SGLang's rank r reads entry r only), as the trainer wrote them; the adapter never decodes them."""
    body: JsonObject = {
        "serialized_named_tensors": list(payloads),
        "load_format": "flattened_bucket" if load_format == "flattened_bucket" else None,
        "flush_cache": False,
        "abort_all_requests": False,
    }
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def memory_body(tags: Sequence[str]) -> JsonObject:
    return {"tags": list(tags) if tags else None}


# ---- answers --------------------------------------------------------------------------------------


class BadAnswer(RuntimeError):
    """An answer that does not have the recorded shape (a server of another version, or not SGLang)."""


def _finish(meta: JsonObject, *, where: str) -> str:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    mapping = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}
    if kind not in mapping:
        raise BadAnswer(f"{where}: finish_reason {reason!r} is none of stop / length / abort")
    return mapping[kind]


def sample_from_answer(item: JsonValue, *, version: int, where: str) -> SampleOutput:
    """One /generate answer item -> SampleOutput. Token ids and log-probs both come from
    meta_info.output_token_logprobs ([logprob, token_id, text] per generated token, the finishing stop token
    included); output_ids, when present, must agree. `version` is what the sample is stamped with."""
    if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        raise BadAnswer(f"{where}: an answer item has no meta_info: {str(item)[:200]}")
    meta = item["meta_info"]
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise BadAnswer(f"{where}: meta_info has no output_token_logprobs list (return_logprob was sent)")
    try:
        tokens = tuple(int(e[1]) for e in entries)
        log_probs = tuple(float(e[0]) for e in entries)
    except (TypeError, ValueError, IndexError) as exc:
        raise BadAnswer(f"{where}: output_token_logprobs entries are not [logprob, token_id, text]: {exc}") from exc
    output_ids = item.get("output_ids")
    if output_ids is not None and [int(t) for t in output_ids] != list(tokens):
        raise BadAnswer(
            f"{where}: output_ids {list(output_ids)[:8]}... disagree with output_token_logprobs' ids "
            f"{list(tokens)[:8]}..."
        )
    return SampleOutput(
        token_ids=tokens, log_probs=log_probs, finish_reason=_finish(meta, where=where), weight_version=version
    )


def answer_version(items: Sequence[JsonValue], *, fallback: int) -> int:
    """The weight version SGLang reports on a batch (meta_info.weight_version); the lowest if they differ;
    `fallback` where it is absent or not an integer (e.g. "default" before any update)."""
    versions = [
        parse_weight_version(i.get("meta_info", {}).get("weight_version")) for i in items if isinstance(i, dict)
    ]
    known = [v for v in versions if v is not None]
    return min(known) if known else fallback

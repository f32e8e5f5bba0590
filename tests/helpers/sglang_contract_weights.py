"""The contract server's shared answer shapes and its weight routes (see sglang_contract_server.py, which runs them).

Weight routes, as SGLang 0.5.x runs them (0.5.17 read whole from its wheel; /work/notes/sglang_0517.md):
/init_weights_update_group and /destroy_weights_update_group, /update_weights_from_distributed (per tensor or one
flattened uint8 bucket, received over the group exactly as SGLang's ModelRunner does), /update_weights_from_disk,
/update_weights_from_tensor and 0.5.23's /begin_weight_update ... /end_weight_update.

/update_weights_from_tensor checks the body as far as that is possible WITHOUT unpickling (this process unpickles
nothing, as Tandem): one base64 string per TP rank (tp 1 here), each a pickle (protocol header 0x80), whose globals,
read with pickletools, all lie in SGLang's SafeUnpickler allow-list (ALLOWED_PREFIXES below, copied from 0.5.17's
sglang/srt/utils/common.py); the strings the pickle holds are recorded, so a test can check the tensor names. It
cannot hold the tensors (CUDA IPC handles need CUDA and an unpickler), so /_contract/weights does not list them.

Where SGLang's scheduler raises instead of answering, this server dies the same way (`crash`: a message on stderr,
exit code 70): a requested flush_cache inside an update that finds the server busy (`assert flush_cache_success`),
which the adapter must never ask for.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import os
import pickletools
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_MISSING = object()
CRASH_EXIT = 70
# SGLang 0.5.17 SafeUnpickler (sglang/srt/utils/common.py): ALLOWED_MODULE_PREFIXES, matched as
# (module + ".").startswith(prefix), and DENY_CLASSES
ALLOWED_PREFIXES = (
    "builtins.",
    "collections.",
    "copyreg.",
    "functools.",
    "itertools.",
    "operator.",
    "types.",
    "weakref.",
    "torch.",
    "multiprocessing.resource_sharer.",
    "multiprocessing.reduction.",
    "pickletools.",
    "peft.",
    "transformers.",
    "huggingface_hub.",
    "sglang.srt.weight_sync.tensor_bucket.",
    "sglang.srt.model_executor.model_runner.",
    "sglang.srt.model_executor.model_runner_components.weight_updater.",
    "sglang.srt.layers.",
    "sglang.srt.utils.",
    "sglang.srt.disaggregation.",
    "sglang.srt.managers.",
    "torch_npu.",
)
DENY_CLASSES = {
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "compile"),
    ("os", "system"),
    ("subprocess", "Popen"),
    ("subprocess", "run"),
    ("codecs", "decode"),
    ("types", "CodeType"),
    ("types", "FunctionType"),
}


class Reject(Exception):
    def __init__(self, status: int, body: Any, *, text: bool = False):
        super().__init__(str(body))
        self.status, self.body, self.text = status, body, text


def validation_error(message: str) -> Reject:
    """FastAPI's RequestValidationError as SGLang's handler answers it (400, not 422)."""
    return Reject(400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400})


def failure(message: str, **extra: Any) -> Reject:
    return Reject(400, {"success": False, "message": message, **extra})


def error_response(message: str, status: int = 400) -> Reject:
    return Reject(status, {"error": {"message": message}})


def crash(why: str) -> None:
    """What SGLang does when its scheduler raises: the server goes away (run_scheduler_process sends SIGQUIT)."""
    print(f"SGLANG_CONTRACT_CRASH {why}", file=sys.stderr, flush=True)
    os._exit(CRASH_EXIT)


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


def init_custom_process_group(
    backend: str, init_method: str, timeout: datetime.timedelta, world_size: int, rank: int, group_name: str
) -> dist.ProcessGroup:
    """SGLang's sglang.srt.utils.init_custom_process_group, the store-is-None path it takes from
    ModelRunner.init_weights_update_group(init_method=f"tcp://{master_address}:{master_port}")."""
    from torch.distributed.distributed_c10d import (
        Backend,
        GroupName,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    backend = Backend(backend)
    rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
    store, rank, world_size = next(rendezvous_iterator)
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # The options argument was renamed pg_options -> backend_options in torch 2.6. (Older SGLang copies compared
    # version strings, which misreads torch >= 2.10; the release tuple is compared here.)
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    pg_options_param_name = "backend_options" if release >= (2, 6) else "pg_options"
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        store,
        group_name=GroupName(group_name),
        **{pg_options_param_name: None},
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def blake2b_hex(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


def inspect_pickle(data: bytes) -> tuple[list[tuple[str, str]], list[str]]:
    """(the globals a pickle names, as (module, name); the str values it holds), read op by op, nothing executed."""
    memo: dict[int, Any] = {}
    stack: list[Any] = []  # only what GLOBAL lookups need: the last pushed values (str or None)
    names: list[tuple[str, str]] = []
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(data):
        match op.name:
            case "SHORT_BINUNICODE" | "BINUNICODE" | "BINUNICODE8" | "UNICODE":
                stack.append(arg)
                strings.append(str(arg))
            case "GLOBAL":
                module, name = str(arg).split(" ", 1)
                names.append((module, name))
                stack.append(None)
            case "STACK_GLOBAL":
                module, name = stack[-2], stack[-1]
                names.append((str(module), str(name)))
                for s in (module, name):
                    if s in strings:
                        strings.remove(s)
                stack.append(None)
            case "MEMOIZE":
                memo[len(memo)] = stack[-1] if stack else None
            case "BINPUT" | "LONG_BINPUT" | "PUT":
                memo[int(str(arg))] = stack[-1] if stack else None
            case "BINGET" | "LONG_BINGET" | "GET":
                stack.append(memo.get(int(str(arg))))
            case _:
                stack.append(None)
    return names, strings


def payload_problem(payload: Any) -> str | None:
    """Why `payload` would not pass SGLang's normalize + SafeUnpickler, judged without unpickling; None when fine."""
    if not isinstance(payload, str):
        return f"a {type(payload).__name__}, not a base64 string"
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        return f"not base64: {exc}"
    if len(raw) < 2 or raw[0] != 0x80 or raw[1] > 5:
        return f"not a pickle (starts with {raw[:2].hex()})"
    try:
        names, _ = inspect_pickle(raw)
    except Exception as exc:  # noqa: BLE001 - a malformed pickle is a refusal
        return f"not a readable pickle: {exc}"
    blocked = [f"{m}.{n}" for m, n in names if (m, n) in DENY_CLASSES or not (m + ".").startswith(ALLOWED_PREFIXES)]
    if blocked:
        return f"Blocked unsafe class loading ({blocked[0]}), to prevent exploitation of CVE-2025-10164"
    return None


class WeightRoutes:
    """Mixed into the contract server's Server (which provides profile, groups, weights, pg_timeout, device,
    session_open, weight_version, flushes, tensor_updates, weights_lost, `_flush` and `idle`)."""

    profile: str
    groups: dict[str, dist.ProcessGroup]
    weights: dict[str, torch.Tensor]
    tensor_updates: list[dict[str, Any]]
    session_open: bool
    weight_version: str
    weights_lost: bool
    pg_timeout: datetime.timedelta
    device: torch.device

    def _flush(self) -> bool:
        raise NotImplementedError

    def init_group(self, body: Any, query: dict) -> Any:
        req = fields(
            body,
            {
                "master_address": ((str,), _MISSING),
                "master_port": ((int,), _MISSING),
                "rank_offset": ((int,), _MISSING),
                "world_size": ((int,), _MISSING),
                "group_name": ((str,), "weight_update_group"),
                "backend": ((str,), "nccl"),
                "rid": ((str, type(None)), None),
            },
        )
        if not req["group_name"]:
            return failure("Failed to initialize custom process group: Group name cannot be empty.")
        rank = req["rank_offset"] + 0  # rank_offset + tp_rank (tp_size 1)
        try:
            pg = init_custom_process_group(
                req["backend"],
                f"tcp://{req['master_address']}:{req['master_port']}",
                self.pg_timeout,
                req["world_size"],
                rank,
                req["group_name"],
            )
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

    def _needs_session(self, route: str) -> Reject | None:
        if self.profile == "0.5.23" and not self.session_open:
            return failure(f"{route} must be called between begin_weight_update and end_weight_update")
        return None

    def update_distributed(self, body: Any, query: dict) -> Any:
        req = fields(
            body,
            {
                "names": ((list,), _MISSING),
                "dtypes": ((list,), _MISSING),
                "shapes": ((list,), _MISSING),
                "group_name": ((str,), "weight_update_group"),
                "flush_cache": ((bool,), True),
                "abort_all_requests": ((bool,), False),
                "weight_version": ((str, type(None)), None),
                "load_format": ((str, type(None)), None),
                "torch_empty_cache": ((bool,), False),
                "rid": ((str, type(None)), None),
            },
        )
        if not len(req["names"]) == len(req["dtypes"]) == len(req["shapes"]):
            return failure("names, dtypes and shapes must have the same length")
        refused = self._needs_session("update_weights_from_distributed")
        if refused is not None:
            return refused
        if req["group_name"] not in self.groups:
            return failure(
                f"Group {req['group_name']} not in {sorted(self.groups)}. Please call "
                f"`init_weights_update_group` first."
            )
        try:
            dtypes = [getattr(torch, d) for d in req["dtypes"]]
            assert all(isinstance(d, torch.dtype) for d in dtypes)
            shapes = [[int(x) for x in s] for s in req["shapes"]]
        except (AttributeError, AssertionError, TypeError, ValueError) as exc:
            return failure(f"Failed to update parameter online: {exc!r}.")
        pg = self.groups[req["group_name"]]
        try:
            receive = _receive_flattened if req["load_format"] == "flattened_bucket" else _receive_per_tensor
            received = receive(pg, req["names"], dtypes, shapes, device=self.device)
        except Exception as exc:  # noqa: BLE001 - ModelRunner's answer to a failed receive
            return failure(
                f"Failed to update parameter online: {exc}. The full weights of the ModelRunner are "
                f"partially updated. Please discard the whole weights."
            )
        return self._loaded(received, req, message="Succeeded to update parameter online.")

    def _loaded(
        self, received: list[tuple[str, torch.Tensor]], req: dict[str, Any], *, message: str, **extra: Any
    ) -> Any:
        self.weights.update({name: t for name, t in received})
        self.weights_lost = False
        if req["flush_cache"] and not self._flush():  # the scheduler asserts the flush after an update
            crash("AssertionError: Cache flush failed after updating weights")
        if req["weight_version"] is not None:
            self.weight_version = req["weight_version"]
            message += f" Weight version updated to {req['weight_version']}."
        return {"success": True, "message": message, **extra}

    def update_disk(self, body: Any, query: dict) -> Any:
        req = fields(
            body,
            {
                "model_path": ((str,), _MISSING),
                "load_format": ((str, type(None)), None),
                "abort_all_requests": ((bool,), False),
                "weight_version": ((str, type(None)), None),
                "is_async": ((bool,), False),
                "torch_empty_cache": ((bool,), False),
                "keep_pause": ((bool,), False),
                "recapture_cuda_graph": ((bool,), False),
                "token_step": ((int,), 0),
                "flush_cache": ((bool,), True),
                "manifest": ((dict, type(None)), None),
                "rid": ((str, type(None)), None),
            },
        )
        from safetensors.torch import load_file

        files = sorted(Path(req["model_path"]).glob("*.safetensors"))
        if not files:
            return failure(
                f"Failed to get weights iterator: Cannot find any model weights with `{req['model_path']}`",
                num_paused_requests=0,
            )
        received = [item for f in files for item in load_file(str(f)).items()]
        return self._loaded(received, req, message="Succeeded to update model weights.", num_paused_requests=0)

    def update_tensor(self, body: Any, query: dict) -> Any:
        """UpdateWeightsFromTensorReqInput (0.5.17), the payloads checked without unpickling (module docstring)."""
        req = fields(
            body,
            {
                "serialized_named_tensors": ((list,), _MISSING),
                "load_format": ((str, type(None)), None),
                "flush_cache": ((bool,), True),
                "abort_all_requests": ((bool,), False),
                "weight_version": ((str, type(None)), None),
                "disable_draft_model": ((bool, type(None)), None),
                "torch_empty_cache": ((bool,), False),
                "rid": ((str, type(None)), None),
            },
        )
        refused = self._needs_session("update_weights_from_tensor")
        if refused is not None:
            return refused
        payloads = req["serialized_named_tensors"]
        if req["load_format"] not in (None, "direct", "flattened_bucket"):
            crash(f"NotImplementedError: Unknown load_format={req['load_format']}")
        if len(payloads) != 1:  # TP rank r reads entry r: a shorter list is an IndexError in the scheduler
            crash(f"IndexError: {len(payloads)} serialized_named_tensors for tp_size 1")
        problem = payload_problem(payloads[0])
        if problem is not None:  # _deserialize_own_rank is not wrapped either: the scheduler dies
            crash(f"deserialising the tensor payload failed: {problem}")
        _, strings = inspect_pickle(base64.b64decode(payloads[0]))
        self.tensor_updates.append(
            {
                "strings": strings,
                "load_format": req["load_format"],
                "flush_cache": req["flush_cache"],
                "weight_version": req["weight_version"],
            }
        )
        return self._loaded([], req, message="Success")

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


def _receive_per_tensor(
    pg: dist.ProcessGroup, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], *, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """ModelRunner.update_weights_from_distributed: one async broadcast per announced tensor, then wait."""
    weights, handles = [], []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=False):
        weight = torch.empty(shape, dtype=dtype, device=device)
        handles.append(dist.broadcast(weight, src=0, group=pg, async_op=True))
        weights.append((name, weight))
    for handle in handles:
        handle.wait()
    return weights


def _receive_flattened(
    pg: dist.ProcessGroup, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], *, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
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

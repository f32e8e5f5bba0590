"""The facts the contract server (tests/helpers/sglang_contract_server.py) encodes, checked against a real SGLang.

    python bench/sglang_smoke.py          # the servers of bench/sglang_servers.py (SGLANG_SERVERS; the GPU suite)

One PASS/FAIL line per check, then a table; exit 1 when a check failed, 0 (and "skipped") without sglang or a
server. Against the q05 server: version and routes, /generate's meta_info fields and finish-reason shapes, the
400 for input + max_new_tokens over the context (and the adapter's cut), 500 for an unknown sampling key, 499 for a
request a pause(abort) reached while it waited, /flush_cache refused while a request runs, what the reported
log-probs are (compared with log_softmax(logits / T) and with the truncated distribution, from the same weights in
this process), and /update_weights_from_tensor with the trainer's serialisation (the same weights leave the weight
fingerprint of bench_sglang.py unchanged, a zeroed lm_head changes it, the originals bring it back). Against the
small server (--enable-memory-saver): release and resume of memory (GPU memory freed, by nvidia-smi) and weights
refilled by a tensor sync after resuming them.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_sglang import (
    FINGERPRINT_TOL,
    fingerprint_diff,
    publisher_for,
    sync_once,
    trainer_weights,
    weight_fingerprint,
)
from sglang_servers import load

from services.contracts.sampling_spec import SamplingSpec
from services.contracts.untyped import HFCausalLM
from services.rollout.engines.sglang.engine import SGLangEngine
from services.rollout.engines.sglang.http import SGLangClient, SGLangError

RESULTS: list[tuple[str, bool, str]] = []
META_FIELDS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "input_token_logprobs",
    "output_token_logprobs",
    "output_token_logprobs_length",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "e2e_latency",
}  # what the contract server answers (0.5.17 profile)


def check(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
    try:
        ok, detail = fn()
    except Exception as exc:  # noqa: BLE001 - a check that raises is a FAIL with its reason
        ok, detail = False, f"{type(exc).__name__}: {str(exc)[:400]}"
        traceback.print_exc()
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def status_of(client: SGLangClient, path: str, body: Any, timeout_s: float = 30.0) -> tuple[int, str]:
    try:
        answer = client.post(path, body, timeout_s=timeout_s)
        return answer.status, answer.text[:300]
    except SGLangError as exc:
        return exc.status, exc.reason[:300]


def generation_checks(url: str) -> None:
    client = SGLangClient(url)

    def version() -> tuple[bool, str]:
        info = client.get("/server_info", timeout_s=10).body
        old = client.get("/get_server_info", timeout_s=10).status
        begin, _ = status_of(client, "/begin_weight_update", {})
        return (
            info["version"].startswith("0.5.17") and old == 200 and begin == 404,
            f"version {info['version']}, /get_server_info {old}, /begin_weight_update {begin}",
        )

    def meta() -> tuple[bool, str]:
        items = client.post(
            "/generate",
            {
                "input_ids": [[5, 6, 7]],
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                "return_logprob": True,
            },
            timeout_s=60,
        ).body
        keys = set(items[0]["meta_info"])
        stop = client.post(
            "/generate",
            {
                "input_ids": [[5, 6]],
                "sampling_params": {"max_new_tokens": 4, "stop_token_ids": list(range(22))},
                "return_logprob": True,
            },
            timeout_s=60,
        ).body
        length, stopped = items[0]["meta_info"]["finish_reason"], stop[0]["meta_info"]["finish_reason"]
        entry = items[0]["meta_info"]["output_token_logprobs"][0]
        ok = (
            keys >= META_FIELDS
            and length == {"type": "length", "length": 4}
            and stopped["type"] == "stop"
            and isinstance(stopped["matched"], int)
            and len(entry) == 3
            and entry[2] is None
            and items[0]["meta_info"]["input_token_logprobs"] == []
        )
        return ok, (
            f"missing {sorted(META_FIELDS - keys)}, extra {sorted(keys - META_FIELDS)}, finish {length} / "
            f"{stopped}, entry {entry}"
        )

    def context() -> tuple[bool, str]:
        limit = SGLangEngine([url]).max_context_length
        status, reason = status_of(
            client, "/generate", {"input_ids": [[5] * (limit - 8)], "sampling_params": {"max_new_tokens": 9}}
        )
        engine = SGLangEngine([url])
        out = engine.generate([[5] * (limit - 8)], SamplingSpec(max_new_tokens=9, ignore_eos=True))
        engine.close()
        # the adapter asks for the 8 the context leaves; SGLang's scheduler clamps to context - 1 - prompt - 1
        return (
            status == 400 and "Requested token count exceeds" in reason and len(out[0].token_ids) == 6,
            f"context {limit}: raw {status} {reason[:90]!r}; adapter made {len(out[0].token_ids)} tokens",
        )

    def unknown_key() -> tuple[bool, str]:
        status, reason = status_of(client, "/generate", {"input_ids": [[5]], "sampling_params": {"temprature": 1}})
        return status == 500, f"{status} {reason[:120]!r}"

    def aborted_wait() -> tuple[bool, str]:
        client.post("/pause_generation", {"mode": "retract"}, timeout_s=10)
        box: dict[str, Any] = {}
        waiting = threading.Thread(
            target=lambda: box.update(
                r=status_of(
                    client, "/generate", {"input_ids": [[5]], "sampling_params": {"max_new_tokens": 2}}, timeout_s=60
                )
            )
        )
        waiting.start()
        time.sleep(1.0)
        client.post("/pause_generation", {"mode": "abort"}, timeout_s=30)
        client.post("/continue_generation", {}, timeout_s=10)
        waiting.join(60)
        status, reason = box.get("r", (0, "no answer"))
        return status == 499, f"{status} {reason[:120]!r}"

    def busy_flush() -> tuple[bool, str]:
        box: dict[str, Any] = {}
        long = SGLangEngine([url]).max_context_length - 8  # as long as the context allows
        running = threading.Thread(
            target=lambda: box.update(
                r=status_of(
                    client,
                    "/generate",
                    {"input_ids": [[5]], "sampling_params": {"max_new_tokens": long, "ignore_eos": True}},
                    timeout_s=120,
                )
            )
        )
        running.start()
        time.sleep(1.0)
        status, reason = status_of(client, "/flush_cache", {})
        client.post("/pause_generation", {"mode": "abort"}, timeout_s=30)
        client.post("/continue_generation", {}, timeout_s=10)
        running.join(60)
        idle, _ = status_of(client, "/flush_cache", {})
        return status == 400 and idle == 200, f"busy {status} {reason.strip()!r}, idle {idle}"

    for name, fn in (
        ("version_and_routes", version),
        ("meta_info_and_finish_reasons", meta),
        ("context_limit_400_and_adapter_cut", context),
        ("unknown_sampling_key_500", unknown_key),
        ("aborted_wait_499", aborted_wait),
        ("flush_refused_while_busy", busy_flush),
    ):
        check(name, fn)


def logprob_check(url: str, model: Path) -> None:
    """SGLang's reported log-probs at T=0.7 / top-p 0.9 against this process's forward of the same bf16 weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.tensors.sampling_dist import sampling_log_probs

    def run() -> tuple[bool, str]:
        engine = SGLangEngine([url])
        spec = SamplingSpec(temperature=0.7, top_p=0.9, max_new_tokens=16, ignore_eos=True)
        prompts = [[4 + (i * 7 + j) % 18 for j in range(6)] for i in range(64)]
        outs = engine.generate(prompts, spec)
        engine.close()
        loaded: HFCausalLM = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
        hf = loaded.cuda().eval()
        tempered, truncated = [], []
        with torch.inference_mode():
            for prompt, out in zip(prompts, outs, strict=True):
                ids = torch.tensor([prompt + list(out.token_ids)], device="cuda")
                logits = hf(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                target = ids[0, len(prompt) :]
                reported = torch.tensor(out.log_probs, device="cuda")
                t = torch.log_softmax(logits / 0.7, -1).gather(-1, target[:, None]).squeeze(-1)
                s = sampling_log_probs(logits, spec).gather(-1, target[:, None]).squeeze(-1)
                tempered.append((reported - t).abs())
                truncated.append((reported - s).abs())
        del hf
        torch.cuda.empty_cache()
        t_diff, s_diff = torch.cat(tempered).mean().item(), torch.cat(truncated).mean().item()
        # bf16 on both sides, SGLang's triton attention against HF's sdpa: a few 1e-3 (more at T < 1) is kernel noise;
        # the truncated distribution differs by -log(kept mass), ~0.05-0.1 at top-p 0.9
        return (
            t_diff < 0.02 and s_diff > 3 * t_diff,
            f"mean |reported - log_softmax(logits/T)| {t_diff:.4f}, |reported - truncated| {s_diff:.4f}",
        )

    check("reported_logprobs_are_tempered_untruncated", run)


def sync_one(engine: SGLangEngine, named: list[tuple[str, Any]], *, transport: str) -> None:
    """One sync of `named` to the engine's server by `transport` (load format tensor), with its own publisher."""
    publisher = publisher_for(transport, "tensor", work=Path("/tmp"), timeout_s=60, bucket_mb=64)
    try:
        sync_once(engine, publisher, named, version=engine.weight_version + 1, timeout_s=60)
    finally:
        publisher.close()


def tensor_update_checks(server: dict[str, Any]) -> None:
    import torch

    def run() -> tuple[bool, str]:
        named = trainer_weights(Path(server["model"]))
        url = server["url"]
        loaded = weight_fingerprint(url)  # the checkpoint the server started from: what every format must restore
        details = []
        ok = True
        for load_format in ("tensor", "flattened_bucket"):
            engine = SGLangEngine([url], weight_load_format=load_format)
            publisher = publisher_for("cuda_ipc", load_format, work=Path("/tmp"), timeout_s=60, bucket_mb=64)
            version = engine.weight_version + 1
            try:
                sync_once(engine, publisher, named, version=version, timeout_s=60)
                same = fingerprint_diff(weight_fingerprint(url), loaded)
                zeroed = [(n, torch.zeros_like(t) if n == "lm_head.weight" else t) for n, t in named]
                sync_once(engine, publisher, zeroed, version=version + 1, timeout_s=60)
                changed = fingerprint_diff(weight_fingerprint(url), loaded)
                sync_once(engine, publisher, named, version=version + 2, timeout_s=60)
                back = fingerprint_diff(weight_fingerprint(url), loaded)
            finally:
                publisher.close()
                engine.close()
            ok &= same <= FINGERPRINT_TOL and changed > FINGERPRINT_TOL and back <= FINGERPRINT_TOL
            details.append(
                f"{load_format}: max |Δ log-prob| vs the checkpoint after the same weights {same:.4f}, "
                f"after a zeroed lm_head {changed:.4f}, after the originals {back:.4f}"
            )
        if not ok:  # leave the server as it started for the stages after this one
            restore = SGLangEngine([url])
            try:
                sync_one(restore, named, transport="disk")
            finally:
                restore.close()
        return ok, "; ".join(details)

    check(f"update_weights_from_tensor_{server['name']}", run)


def memory_checks(server: dict[str, Any]) -> None:

    def run() -> tuple[bool, str]:
        engine = SGLangEngine([server["url"]])
        before = weight_fingerprint(server["url"])
        t = time.perf_counter()
        engine.release_memory([])
        release_s = time.perf_counter() - t
        freed = engine.get_state().memory_freed_bytes / 2**30
        t = time.perf_counter()
        engine.resume_memory(["weights"])
        sync_one(engine, trainer_weights(Path(server["model"])), transport="cuda_ipc")
        engine.resume_memory(["kv_cache", "cuda_graph"])
        resume_s = time.perf_counter() - t
        diff = fingerprint_diff(weight_fingerprint(server["url"]), before)
        engine.close()
        return (
            freed > 0.5 and diff <= FINGERPRINT_TOL,
            f"freed {freed:.2f} GiB in {release_s:.2f} s; resume weights + tensor sync + caches {resume_s:.2f} s; "
            f"max |Δ log-prob| after vs before {diff:.4f}",
        )

    check(f"release_resume_memory_{server['name']}", run)


def main() -> int:
    servers = {k: v for k, v in load().items() if v.get("startup_s") is not None}
    if importlib.util.find_spec("sglang") is None:
        print("skipped: the sglang package is not importable (source bench/gpu_env.sh sglang)")
        return 0
    if not servers:
        print(f"skipped: no healthy SGLang server (SGLANG_SERVERS: {json.dumps(load())[:500]})")
        return 0
    if "q05" in servers:
        generation_checks(servers["q05"]["url"])
        logprob_check(servers["q05"]["url"], Path(servers["q05"]["model"]))
        tensor_update_checks(servers["q05"])
    if "small" in servers:
        memory_checks(servers["small"])
    print("\n| check | result | detail |\n|---|---|---|")
    for name, ok, detail in RESULTS:
        print(f"| {name} | {'PASS' if ok else 'FAIL'} | {detail.replace('|', '/')} |")
    return 0 if all(ok for _, ok, _ in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())

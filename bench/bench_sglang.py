"""SGLang next to the native engine (tokens/s, same model and prompts), SGLang's start-up, and sync ms per transport.

    python bench/bench_sglang.py                         # the servers of bench/sglang_servers.py (SGLANG_SERVERS)
    python bench/bench_sglang.py --url http://127.0.0.1:30000 --model DIR [--small-url URL --small-model DIR]

bench/gpu_suite.py --only sglang_bench runs it against the two servers it launched once for all SGLang stages
(bench/sglang_servers.py: random-init q05 and small presets, bf16, triton attention, pytorch sampling, CUDA graphs
on). Without a server, or without the sglang package, it prints that it measured nothing and exits 0.

- generate (the q05 server): --batch prompts of --prompt-len random token ids, temperature 1, EOS ignored, so every
  sequence makes --new-tokens tokens; tokens/s = generated tokens / wall time of one engine.generate through the
  rollout adapter (services/rollout/engines/sglang/engine.py), median of --repeats after a warm-up call of the same
  batch (SGLang's JIT and the native engine's CUDA-graph capture are that first call, reported apart). The native engine
  runs in this process on the same GPU, once per --native-decode mode (default graph; compile: the torch.compile'd
  step, whose first call per bucket compiles), bf16, the same weights and prompts.
- weights (both servers): this process is the trainer. It loads the server's own checkpoint onto the GPU as bf16 and
  syncs it --sync-repeats times per transport, each with the coordinator's pause (drain) and resume: disk
  (/update_weights_from_disk), cuda_ipc (/update_weights_from_tensor, load format tensor and flattened_bucket), gloo
  (SGLang's group protocol: works with trainer and SGLang on one GPU), and nccl last (NCCL refuses two ranks of a
  communicator on one GPU: measured where it works, else its error is reported). ms = prepare + pause + transfer +
  resume, the median; after each transport the server's weight fingerprint (`weight_fingerprint`: teacher-forced
  log-probs of a fixed sequence) must equal the one before, within FINGERPRINT_TOL (the same weights went back).
Tables go to stdout, numbers to $OUT/bench_sglang.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.contracts.sampling_spec import SamplingSpec
from services.rollout.engines.sglang.engine import SGLangEngine

TRANSPORTS = (("disk", "tensor"), ("cuda_ipc", "tensor"), ("cuda_ipc", "flattened_bucket"), ("gloo", "tensor"))
SCORED = [4 + (7 * i) % 18 for i in range(48)]  # a fixed sequence whose prefill log-probs fingerprint the weights
FINGERPRINT_TOL = 1e-2  # the same weights and request give the same numbers; other weights differ by ~0.1-3


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(batch)
    return [[rng.randrange(4, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def timed_generate(generate, prompts: list[list[int]], opts: SamplingSpec) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = generate(prompts, opts)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == opts.max_new_tokens for o in outs), "a sequence stopped early (EOS ignored?)"
    return elapsed


def bench_generate(engine: SGLangEngine, model: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per batch: SGLang's tokens/s and each --native-decode mode's, one native engine at a time."""
    rows = [{"batch": b, "tokens": b * args.new_tokens, "native": {}} for b in args.batch]
    opts = SamplingSpec(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    for row in rows:
        prompts = prompts_for(row["batch"], args.prompt_len, _vocab(model))
        row["sglang_first_s"], row["sglang_tok_s"] = _measure(engine.generate, prompts, opts, row["tokens"], args)
    for mode in args.native_decode:
        _bench_native(mode, model, rows, opts, args)
    return rows


def _measure(generate: Any, prompts: list[list[int]], opts: SamplingSpec, tokens: int, args: argparse.Namespace):
    """(first call s, tokens/s as the median of --repeats calls after it)."""
    first = timed_generate(generate, prompts, opts)
    return first, tokens / statistics.median(timed_generate(generate, prompts, opts) for _ in range(args.repeats))


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def _bench_native(
    mode: str, model: Path, rows: list[dict[str, Any]], opts: SamplingSpec, args: argparse.Namespace
) -> None:
    import torch

    from services.rollout.engines.native.engine import NativeEngine

    native = NativeEngine(model, device="cuda", dtype="bfloat16", max_batch_size=max(args.batch), decode=mode)
    try:
        for row in rows:
            prompts = prompts_for(row["batch"], args.prompt_len, native.vocab_size)
            first, tok_s = _measure(native.generate, prompts, opts, row["tokens"], args)
            row["native"][mode] = {"first_s": first, "tok_s": tok_s}
    finally:
        native.close()
        del native
        torch.cuda.empty_cache()


def trainer_weights(model: Path) -> list[tuple[str, Any]]:
    """The server's checkpoint as the trainer would export it: bf16, on the GPU, in file order."""
    import torch
    from safetensors.torch import load_file

    named = []
    for f in sorted(model.glob("*.safetensors")):
        named += [(n, t.to(torch.bfloat16)) for n, t in load_file(str(f), device="cuda").items()]
    return named


def sync_once(
    engine: SGLangEngine, publisher: Any, named: list[tuple[str, Any]], *, version: int, timeout_s: float
) -> dict[str, float]:
    """One sync as the coordinator runs it: prepare, pause (drain), engine and trainer concurrently, resume."""
    from services.weights import WeightReceiver, specs_from_tensors

    start = time.perf_counter()
    plan = publisher.prepare(specs_from_tensors(named), version, engine.engine_ranks)
    engine.pause("drain", timeout_s=timeout_s)
    try:
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(engine.receive_weights, plan, rank_offset=1, receiver=WeightReceiver())
            try:
                sent = publisher.publish(plan, named)
            except BaseException:
                received.exception(timeout=timeout_s + 10)
                raise
            received.result(timeout=timeout_s + 10)
    finally:
        engine.resume()
    return {"seconds": time.perf_counter() - start, "transfer_s": sent.seconds, "bytes": float(plan.total_bytes)}


def publisher_for(transport: str, load_format: str, *, work: Path, timeout_s: float, bucket_mb: float) -> Any:
    from services.contracts.config import weights_config
    from services.weights import WeightPublisher

    disk = {"disk_dir": str(work / "weights")} if transport == "disk" else {}
    config = weights_config(transport=transport, bucket_mb=bucket_mb, timeout_s=timeout_s, **disk)
    return WeightPublisher(config=config, run_dir=work, trainer_id="bench", sglang_load_format=load_format)


def weight_fingerprint(url: str) -> list[float]:
    """SGLang's log-prob of each token of SCORED given the ones before it (one prefill; logprob_start_len 0 keeps
    the radix cache from serving the prefix). Greedy answers are no such check: a random-init model's logits have
    bf16 near-ties, and which token wins can change with the kernels' reduction order."""
    from services.rollout.engines.sglang.http import SGLangClient

    body = {
        "input_ids": SCORED,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    meta = SGLangClient(url).post("/generate", body, timeout_s=60).body["meta_info"]
    return [float(entry[0]) for entry in meta["input_token_logprobs"][1:]]  # the first token has none


def fingerprint_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def bench_syncs(
    server: dict[str, Any], args: argparse.Namespace, *, transports: tuple, version: int
) -> tuple[list[dict[str, Any]], int]:
    import torch

    named = trainer_weights(Path(server["model"]))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        for transport, load_format in transports:
            engine = SGLangEngine([server["url"]], weight_load_format=load_format, request_timeout_s=args.timeout_s)
            before = weight_fingerprint(server["url"])
            publisher = publisher_for(
                transport,
                load_format,
                work=Path(tmp),
                timeout_s=args.sync_timeout_s if transport == "nccl" else args.timeout_s,
                bucket_mb=args.bucket_mb,
            )
            row: dict[str, Any] = {"server": server["name"], "transport": transport, "format": load_format}
            try:
                runs = []
                for _ in range(args.sync_repeats + 1):  # the first: groups joined, buffers allocated
                    version += 1
                    runs.append(sync_once(engine, publisher, named, version=version, timeout_s=args.timeout_s))
                runs = runs[1:]
                row.update(
                    ms=1000 * statistics.median(r["seconds"] for r in runs),
                    transfer_ms=1000 * statistics.median(r["transfer_s"] for r in runs),
                    gb=runs[0]["bytes"] / 1e9,
                    weights_diff=fingerprint_diff(weight_fingerprint(server["url"]), before),
                )
            except Exception as exc:  # noqa: BLE001 - a transport that fails is reported, the others still run
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            finally:
                publisher.close()
                engine.close()
            rows.append(row)
            print(f"[bench_sglang] {row}", flush=True)
    del named
    torch.cuda.empty_cache()
    return rows, version


def print_tables(
    startup: list[dict[str, Any]], gen: list[dict[str, Any]], syncs: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    import torch

    print(
        f"\nSGLang vs native — {torch.cuda.get_device_name()}, bf16, q05 (Qwen2-0.5B-shaped, random init), prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens, EOS ignored, median of {args.repeats}"
    )
    print(
        "| batch | native decode | SGLang tok/s | native tok/s | native / SGLang | SGLang first call s "
        "| native first call s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in gen:
        for mode, n in r["native"].items():
            print(
                f"| {r['batch']} | {mode} | {r['sglang_tok_s']:,.0f} | {n['tok_s']:,.0f} | "
                f"{n['tok_s'] / r['sglang_tok_s']:.2f} | {r['sglang_first_s']:.2f} | {n['first_s']:.2f} |"
            )
    print("\n| SGLang server | model | start-up s (launch to healthy) |")
    print("|---|---|---|")
    for s in startup:
        seconds = "not healthy" if s["startup_s"] is None else f"{s['startup_s']:.0f}"
        print(f"| {s['name']} | {s['preset']} | {seconds} |")
    print(
        f"\n| server | transport | load format | GB | sync ms | transfer ms | weights after (max \\|Δ log-prob\\|) "
        f"|  (median of {args.sync_repeats})"
    )
    print("|---|---|---|---|---|---|---|")
    for r in syncs:
        if "error" in r:
            print(f"| {r['server']} | {r['transport']} | {r['format']} | – | failed | {r['error'][:120]} | – |")
        else:
            print(
                f"| {r['server']} | {r['transport']} | {r['format']} | {r['gb']:.3f} | {r['ms']:.1f} | "
                f"{r['transfer_ms']:.1f} | {same_text(r['weights_diff'])} |"
            )


def same_text(diff: float) -> str:
    return f"{'same' if diff <= FINGERPRINT_TOL else 'DIFFERENT'} ({diff:.4f})"


def servers_from(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    from sglang_servers import load

    if args.url:
        out = {"q05": {"name": "q05", "preset": "?", "url": args.url, "model": str(args.model), "startup_s": None}}
        if args.small_url:
            out["small"] = {
                "name": "small",
                "preset": "?",
                "url": args.small_url,
                "model": str(args.small_model),
                "startup_s": None,
            }
        return out
    return {k: v for k, v in load().items() if v.get("startup_s") is not None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running SGLang server (its --model-path is --model)")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--small-url")
    parser.add_argument("--small-model", type=Path)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--native-decode",
        nargs="+",
        default=["graph"],
        choices=["graph", "compile", "static"],
        help="the native engine's decode mode(s), one row each (compile: its first call per bucket compiles)",
    )
    parser.add_argument("--sync-repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--sync-timeout-s", type=float, default=20.0, help="the nccl attempt's deadline per sync")
    parser.add_argument("--no-nccl", action="store_true")
    parser.add_argument("--nccl-only", action="store_true", help=argparse.SUPPRESS)  # the child of nccl_attempt
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."))
    args = parser.parse_args()
    servers = servers_from(args)
    if args.nccl_only:
        rows, _ = bench_syncs(servers["q05"], args, transports=(("nccl", "tensor"),), version=10_000)
        print("NCCL_ROW " + json.dumps(rows[0]), flush=True)
        os._exit(0)  # a refused NCCL communicator may leave threads that hold the exit
    if importlib.util.find_spec("sglang") is None and not args.url:
        print("skipped: the sglang package is not importable (source bench/gpu_env.sh sglang); nothing was measured")
        return 0
    if "q05" not in servers:
        print("skipped: no healthy SGLang server (SGLANG_SERVERS or --url); nothing was measured")
        return 0
    startup = [{"name": s["name"], "preset": s["preset"], "startup_s": s["startup_s"]} for s in servers.values()]
    engine = SGLangEngine([servers["q05"]["url"]], request_timeout_s=args.timeout_s)
    try:
        gen = bench_generate(engine, Path(servers["q05"]["model"]), args)
        version = max(engine.weight_version, 0)
    finally:
        engine.close()
    syncs: list[dict[str, Any]] = []
    for name in ("small", "q05"):
        if name in servers:
            rows, version = bench_syncs(servers[name], args, transports=TRANSPORTS, version=version)
            syncs += rows
    if not args.no_nccl:  # last: a refused NCCL communicator may leave the q05 server unusable
        syncs.append(nccl_attempt(args))
    print_tables(startup, gen, syncs, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_sglang.json").write_text(
        json.dumps({"startup": startup, "generate": gen, "syncs": syncs}, indent=1)
    )
    return 0


def nccl_attempt(args: argparse.Namespace) -> dict[str, Any]:
    """nccl in a child process with a deadline: NCCL refuses two ranks of a communicator on one GPU, and a refused
    communicator can abort its process or hang its exit."""
    import subprocess

    cmd = [sys.executable, __file__, "--nccl-only", "--sync-repeats", "1", "--timeout-s", str(args.sync_timeout_s)]
    row: dict[str, Any] = {"server": "q05", "transport": "nccl", "format": "tensor"}
    limit = args.sync_timeout_s * 2 + 30  # two syncs at most, plus start-up
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"no answer within {limit:g}s"}
    found = [ln for ln in out.stdout.splitlines() if ln.startswith("NCCL_ROW ")]
    if found:
        return json.loads(found[-1].removeprefix("NCCL_ROW "))
    return {**row, "error": f"exit {out.returncode}: {(out.stderr or out.stdout)[-300:]}"}


if __name__ == "__main__":
    sys.exit(main())

"""Generate tokens/s and weight-update time of the `sglang` rollout engine against a real SGLang server.

    python -m sglang.launch_server --model-path MODEL --port 30000 [--enable-memory-saver] &    # SGLang's GPUs
    python bench/bench_sglang.py --url http://127.0.0.1:30000                                  # generation only
    CUDA_VISIBLE_DEVICES=1 python bench/bench_sglang.py --url http://127.0.0.1:30000 \\
        --weights MODEL --transport nccl --bucket-mb 512 --load-format flattened_bucket        # + weight updates

Without --url (or SGLANG_URL) it measures nothing and says so: SGLang does not run on the machines this was
written on (no CPU backend), so this script has not produced a number yet. It drives the server exactly as the
rollout service does (services/rollout/engines/sglang.py), so what it measures includes the adapter's overhead.

- generate: --batch prompts of --prompt-len random token ids (below --vocab-hi), sampled at temperature 1 with EOS
  ignored so every sequence makes --new-tokens tokens; tokens/s = generated tokens / wall time of one
  engine.generate, the median of --repeats after one warm-up.
- weights (with --weights DIR, an HF directory holding the server's model): this process is the trainer. It loads
  the safetensors (on cuda:0 for nccl: give it a GPU SGLang does not use) and syncs them --repeats times through
  WeightPublisher -> SGLangEngine.receive_weights, each with a pause (drain + rollout.sglang.pause_mode) and
  resume as the coordinator does. Reported: seconds per sync (prepare + transfer + resume) and GB/s of the
  transfer. The server must reach --master-addr (default 127.0.0.1) on the trainer's store port.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.contracts.sampling import SamplingSpec
from services.rollout.engines.sglang import SGLangEngine


def bench_generate(engine: SGLangEngine, *, batch: int, prompt_len: int, new_tokens: int, vocab_hi: int,
                   repeats: int) -> dict[str, float]:
    rng = random.Random(batch)
    prompts = [[rng.randrange(10, vocab_hi) for _ in range(prompt_len)] for _ in range(batch)]
    opts = SamplingSpec(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts[: min(batch, 8)], opts)   # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = engine.generate(prompts, opts)
        elapsed = time.perf_counter() - start
        rates.append(sum(len(o.token_ids) for o in outs) / elapsed)
        assert all(len(o.log_probs) == len(o.token_ids) for o in outs)
    return {"tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates)}


def load_weights(model_dir: Path, *, device: str) -> list[tuple[str, object]]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"--weights {model_dir}: no *.safetensors files")
    named = []
    for f in files:
        named += sorted(load_file(str(f), device=device).items())
    return named


def bench_weights(engine: SGLangEngine, named: list, *, transport: str, bucket_mb: float, master_addr: str,
                  repeats: int, timeout_s: float) -> list[dict[str, float]]:
    from services.contracts.config import WeightsConfig
    from services.weights import WeightPublisher, specs_from_tensors

    run_dir = Path(tempfile.mkdtemp(prefix="bench-sglang-"))
    config = WeightsConfig(transport=transport, bucket_mb=bucket_mb, timeout_s=timeout_s, master_addr=master_addr,
                           disk_dir=str(run_dir / "weights"))
    publisher = WeightPublisher(config=config, run_dir=run_dir, trainer_id="bench")
    specs = specs_from_tensors(named)
    rows = []
    try:
        for version in range(1, repeats + 1):
            start = time.perf_counter()
            plan = publisher.prepare(specs, version, engine.engine_ranks)
            engine.pause("drain", timeout_s=timeout_s)
            with ThreadPoolExecutor(1) as pool:
                received = pool.submit(engine.receive_weights, plan, rank_offset=1, receiver=None)
                sent = publisher.publish(plan, named)
                received.result(timeout=timeout_s + 10)
            engine.resume()
            rows.append({"version": version, "seconds": time.perf_counter() - start, "transfer_s": sent.seconds,
                         "gbps": sent.gbps, "bytes": plan.total_bytes})
    finally:
        publisher.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("SGLANG_URL"), help="a running SGLang server")
    parser.add_argument("--api-key", default=os.environ.get("SGLANG_API_KEY"))
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--vocab-hi", type=int, default=30_000, help="prompt token ids are drawn below this")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", type=Path, help="HF model directory of the server's model (enables the sync)")
    parser.add_argument("--transport", choices=["nccl", "gloo", "disk"], default="nccl")
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--load-format", choices=["tensor", "flattened_bucket"], default="tensor")
    parser.add_argument("--pause-mode", choices=["abort", "retract", "in_place"], default="retract")
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    if not args.url:
        print("skipped: no SGLang server given (--url or SGLANG_URL); nothing was measured. Start one with "
              "`python -m sglang.launch_server --model-path MODEL --port 30000` (SGLang >=0.5.15, <0.6, a GPU).")
        return 0
    engine = SGLangEngine([args.url], api_key=args.api_key, pause_mode=args.pause_mode,
                          weight_load_format=args.load_format, request_timeout_s=args.timeout_s)
    try:
        server = engine.servers[0]
        print(f"SGLang {server.info.version} at {server.url}: model {server.info.model_path}, "
              f"tp {server.info.tp_size}, context {engine.max_context_length}")
        print(f"{'batch':>6} {'prompt':>6} {'new':>5} {'tok/s':>10} {'min':>10} {'max':>10}")
        for batch in args.batch:
            r = bench_generate(engine, batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                               vocab_hi=args.vocab_hi, repeats=args.repeats)
            print(f"{batch:>6} {args.prompt_len:>6} {args.new_tokens:>5} {r['tokens_per_s']:>10.0f} "
                  f"{r['min']:>10.0f} {r['max']:>10.0f}")
        if args.weights:
            device = "cuda:0" if args.transport == "nccl" else "cpu"
            named = load_weights(args.weights, device=device)
            rows = bench_weights(engine, named, transport=args.transport, bucket_mb=args.bucket_mb,
                                 master_addr=args.master_addr, repeats=args.repeats, timeout_s=args.timeout_s)
            print(f"weights over {args.transport} ({args.load_format}, {args.bucket_mb:g} MB buckets):")
            print(f"{'version':>7} {'GB':>7} {'sync s':>8} {'transfer s':>10} {'GB/s':>7}")
            for row in rows:
                print(f"{row['version']:>7} {row['bytes'] / 1e9:>7.2f} {row['seconds']:>8.2f} "
                      f"{row['transfer_s']:>10.2f} {row['gbps']:>7.2f}")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a weight sync costs the native engine mid-generation: drain (rollout.inflight_update off) against an update
that lands between two decode steps (keep: in_place, recompute: retract), side by side.

    python bench/bench_inflight.py                                  # small preset, CPU
    python bench/bench_inflight.py --preset small --batch 64 --new-tokens 256 --decode dynamic static

One generate call of --batch rows, each forced to --new-tokens tokens (EOS ignored), runs alone first (its time is
`gen alone`); then again, and after --at of that time a sync pauses the engine in the mode's way, loads a full state
dict of other weights (update_weights_from_tensors: the receive's copy without a transport) and resumes. Per mode:
- `pause`: until the pause returns: drain waits for the running call to finish, in_place / retract for it to park
  at the next token boundary;
- `sync`: pause + load + resume, what the coordinator's WeightSync waits (the trainer's side and the transport are
  the same in every mode and left out);
- `load`: the weights' copy while paused (the engine generates nothing meanwhile, in every mode);
- `gen stall`: how much longer the running call took than alone (parked while the weights load; retract also
  recomputes the KV cache of every row: one prefill of prompt + tokens so far); `extra cpu` the same in the process's
  CPU time, which a busy shared host disturbs less than wall time.
With drain the sync waits out the running call (its `pause` is the rest of the call), so the new weights, and in
one-step-off the trainer's next step, wait for the batch's slowest sample; in flight the sync waits one decode step
and the running call waits only the load. Medians over --repeat runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.contracts.sampling_spec import SamplingSpec
from services.modelinit.init_model import init_model
from services.rollout.engines.native.engine import NativeEngine

MODES = {"off": "drain", "keep": "in_place", "recompute": "retract"}


@dataclass(frozen=True)
class Timing:
    pause_s: float
    load_s: float
    sync_s: float
    gen_s: float
    cpu_s: float  # the process's CPU time over the run (all threads): steadier than wall time on a shared host


def run_once(
    engine: NativeEngine,
    prompts: list[list[int]],
    opts: SamplingSpec,
    *,
    pause_mode: str | None,
    at_s: float,
    state: dict[str, torch.Tensor],
    version: int,
) -> Timing:
    """One generate call; with pause_mode, a sync starts at_s seconds into it."""
    done: list[float] = []

    def generate() -> None:
        start = time.perf_counter()
        outs = engine.generate(prompts, opts)
        assert all(len(o.token_ids) == opts.max_new_tokens for o in outs)
        done.append(time.perf_counter() - start)

    cpu = time.process_time()
    thread = threading.Thread(target=generate)
    thread.start()
    pause_s = load_s = sync_s = 0.0
    if pause_mode is not None:
        time.sleep(at_s)
        start = time.perf_counter()
        engine.pause(pause_mode, timeout_s=600)
        pause_s = time.perf_counter() - start
        engine.update_weights_from_tensors(state.items(), version=version)
        load_s = time.perf_counter() - start - pause_s
        engine.resume()
        sync_s = time.perf_counter() - start
    thread.join()
    return Timing(pause_s=pause_s, load_s=load_s, sync_s=sync_s, gen_s=done[0], cpu_s=time.process_time() - cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--at", type=float, default=0.25, help="the sync starts at this fraction of the call")
    parser.add_argument("--decode", nargs="+", default=["dynamic"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        a = init_model(Path(tmp) / "a", preset=args.preset, seed=0)
        b = init_model(Path(tmp) / "b", preset=args.preset, seed=1)
        print(
            f"{args.preset}, {args.batch} rows x ({args.prompt_len} prompt + {args.new_tokens} new tokens), sync at "
            f"{args.at:.0%} of the call, {torch.get_num_threads()} threads, median of {args.repeat}"
        )
        header = (
            f"{'decode':8} {'inflight_update':16} {'gen alone s':>11} {'pause s':>9} {'load s':>9} "
            f"{'sync s':>9} {'gen stall s':>11} {'extra cpu s':>11}"
        )
        print(header)
        print("-" * len(header))
        for decode in args.decode:
            report(decode, a, b, args)
    return 0


def report(decode: str, a: Path, b: Path, args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    engine = NativeEngine(a, device="cpu", decode=decode)
    states = [load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))]
    vocab = engine.vocab_size
    prompts = [[1, *((i * 7 + j) % (vocab - 4) + 3 for j in range(args.prompt_len - 1))] for i in range(args.batch)]
    opts = SamplingSpec(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=1)
    engine.generate(prompts[:2], SamplingSpec(max_new_tokens=4, ignore_eos=True))  # warm-up
    runs: dict[str, list[Timing]] = {name: [] for name in ("alone", *MODES)}
    version = 0
    for _ in range(args.repeat):  # each repeat measures the call alone next to the modes (a shared host drifts)
        runs["alone"].append(run_once(engine, prompts, opts, pause_mode=None, at_s=0, state={}, version=0))
        for name, pause_mode in MODES.items():
            version += 1
            runs[name].append(
                run_once(
                    engine,
                    prompts,
                    opts,
                    pause_mode=pause_mode,
                    at_s=args.at * runs["alone"][-1].gen_s,
                    state=states[version % 2],
                    version=version,
                )
            )
    alone = statistics.median(r.gen_s for r in runs["alone"])
    for name in MODES:
        pause_s, load_s, sync_s = (
            statistics.median(getattr(r, k) for r in runs[name]) for k in ("pause_s", "load_s", "sync_s")
        )
        stall_s, cpu_s = (
            statistics.median(getattr(r, k) - getattr(a, k) for r, a in zip(runs[name], runs["alone"], strict=True))
            for k in ("gen_s", "cpu_s")
        )
        print(
            f"{decode:8} {name:16} {alone:11.3f} {pause_s:9.3f} {load_s:9.3f} {sync_s:9.3f} {stall_s:11.3f} "
            f"{cpu_s:11.3f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())

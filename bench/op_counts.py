"""How many aten ops a step dispatches, and where they come from: a proxy of kernel launches that holds on a CPU.

    python bench/op_counts.py [--vocab 22 151936] [--preset q05_narrow] [--length 512] [--samples 32]
                              [--prompt-len P] [--variant ds_z0_fp32] [--chunk-tokens auto|N] [--warmups 1] [--top 25]
    python bench/op_counts.py ... --json        # the counts alone, one JSON line: {"22": ops, "151936": ops}

One step of bench/bench_train_step.py's variant (Tandem's actor_step over the DeepSpeed backend, in this process)
under torch.profiler, per vocabulary, after --warmups steps: the count of aten ops that do work (views left out,
nested ops counted: `count_step_ops`, the figure of bench_train_step's "host ops" column and tests/test_op_budget.py),
then tables of the same ops by op name and by call site. --chunk-tokens unset: trainer.scoring_chunk_tokens'
default. A call site is the innermost frame of Tandem's code (services/), of a
model's modeling file, DeepSpeed or torch.optim above the op; ops that the autograd engine runs are filed under
their backward node (`bwd <Node>`), or under the Python frame of a custom Function's backward.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

VIEW_OPS = frozenset(
    {
        "aten::view",
        "aten::reshape",
        "aten::_reshape_alias",
        "aten::as_strided",
        "aten::detach",
        "aten::alias",
        "aten::narrow",
        "aten::slice",
        "aten::select",
        "aten::unsqueeze",
        "aten::squeeze",
        "aten::expand",
        "aten::t",
        "aten::transpose",
        "aten::permute",
    }
)
LAUNCHES = frozenset({"cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"})
# Python frames that name a call site, most specific first: Tandem's code, the model, DeepSpeed, torch.optim
SITE_FRAME = re.compile(
    r"(?P<file>(?:services/[\w/]+|transformers/models/\w+/modeling_\w+|deepspeed/[\w/]+|torch/optim/\w+)\.py)"
    r"\((?P<line>\d+)\): (?P<func>[\w<>]+)"
)
BACKWARD_NODE = "autograd::engine::evaluate_function: "


def is_work(name: str) -> bool:
    return name.startswith("aten::") and name not in VIEW_OPS


def profiler(device: torch.device, *, with_stack: bool = False) -> Any:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=acts, record_shapes=False, with_stack=with_stack)


def profile_tables(p: Any) -> str:
    """A profile's top 30 ops by device time (host time off a GPU) and by host time (self)."""
    avg = p.key_averages()
    dev = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    return (
        "## by device time\n"
        + avg.table(sort_by=dev, row_limit=30, max_name_column_width=70)
        + "\n## by host time (self)\n"
        + avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    )


PROFILE_TRIES = 3


def profiled_events(step: Callable[[], Any], device: torch.device, *, with_stack: bool = False) -> list[Any]:
    """The profiler's events of one more step. torch 2.13's profiler now and then fails to decode an event's name
    (UnicodeDecodeError while parsing its results, seen with Python stacks on): the step is profiled again, up to
    PROFILE_TRIES times (a step's op count does not depend on which step it is, once warm)."""
    for attempt in range(PROFILE_TRIES):
        with profiler(device, with_stack=with_stack) as prof:
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        try:
            return list(prof.events())
        except UnicodeDecodeError:
            if attempt == PROFILE_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def count_step_ops(step: Callable[[], Any], device: torch.device) -> dict[str, float]:
    """One more step under torch.profiler: the aten ops that do work (views left out; nested ops counted, so a
    proxy of the host's work that holds on a CPU too) and, on a GPU, the kernel launches."""
    names = [e.name for e in profiled_events(step, device)]
    return {
        "host_ops": float(sum(is_work(n) for n in names)),
        "launches": float(sum(n in LAUNCHES for n in names)) if device.type == "cuda" else float("nan"),
    }


def call_site(event: Any) -> str:
    """The innermost Tandem / model / DeepSpeed / torch.optim frame above `event`, else its backward node."""
    node = event.cpu_parent
    while node is not None:
        found = SITE_FRAME.search(node.name)
        if found:
            return f"{found['file'].rsplit('/', 1)[-1]}:{found['func']}"
        if node.name.startswith(BACKWARD_NODE):
            return "bwd " + node.name[len(BACKWARD_NODE) :].replace("torch::autograd::", "")
        node = node.cpu_parent
    return "(top level)"


def breakdown(step: Callable[[], Any], device: torch.device) -> tuple[collections.Counter[str], ...]:
    """One step under torch.profiler with Python stacks: counters of the working aten ops by name and by site."""
    by_name: collections.Counter[str] = collections.Counter()
    by_site: collections.Counter[str] = collections.Counter()
    for event in profiled_events(step, device, with_stack=True):
        if is_work(event.name):
            by_name[event.name] += 1
            by_site[call_site(event)] += 1
    return by_name, by_site


def side_by_side(title: str, counters: dict[int, collections.Counter[str]], top: int) -> list[str]:
    """A markdown table of the `top` keys (by their largest count) with one column per vocabulary."""
    vocabs = list(counters)
    keys = sorted({k for c in counters.values() for k in c}, key=lambda k: -max(c[k] for c in counters.values()))
    lines = [f"| {title} | " + " | ".join(f"vocab {v:,}" for v in vocabs) + " |", "|---|" + "---|" * len(vocabs)]
    for key in keys[:top]:
        lines.append(f"| `{key}` | " + " | ".join(f"{counters[v][key]:,}" for v in vocabs) + " |")
    rest = {v: sum(c[k] for k in keys[top:]) for v, c in counters.items()}
    lines.append("| (the rest) | " + " | ".join(f"{rest[v]:,}" for v in vocabs) + " |")
    lines.append("| **total** | " + " | ".join(f"**{sum(counters[v].values()):,}**" for v in vocabs) + " |")
    return lines


def step_of(args: argparse.Namespace, vocab: int, tmp: Path) -> tuple[Callable[[], Any], Any, int]:
    """(one actor step of the variant at `vocab`, its backend, the batch's tokens), after one warm-up step."""
    import functools

    from bench_train_step import algo_config, build_backend, make_model_dir, make_rollout
    from train_step_variants import VARIANTS

    from services.trainer.algo.actor import actor_step

    model_dir = make_model_dir(tmp, args.preset, vocab)
    batch = make_rollout(
        samples=args.samples, response_len=args.length, vocab=vocab, seed=0, prompt_len=args.prompt_len
    )
    variant = VARIANTS[args.variant]
    backend = build_backend(variant, model_dir, torch.device(args.device), tmp, args.chunk_tokens)
    budget = variant.get("micro_batch_tokens", 16384)
    step = functools.partial(
        actor_step,
        backend=backend,
        batch=batch,
        algo=algo_config(),
        ref_model=None,
        old_actor=None,
        token_budget=budget,
    )
    for _ in range(args.warmups):  # first-use work (allocations, lazy state) is not a step's
        step()
    return step, backend, batch.num_tokens


def main(argv: Iterable[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", nargs="+", type=int, default=[22, 151936])
    parser.add_argument("--preset", default="q05_narrow")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=None, help="every prompt's tokens (default 4-8)")
    parser.add_argument("--variant", default="ds_z0_fp32")
    parser.add_argument("--chunk-tokens", default=None, help="trainer.scoring_chunk_tokens (a number or auto)")
    parser.add_argument("--warmups", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", action="store_true", help="print the counts only, as one JSON line")
    args = parser.parse_args(None if argv is None else list(argv))
    if args.chunk_tokens not in (None, "auto"):
        args.chunk_tokens = int(args.chunk_tokens)
    names: dict[int, collections.Counter[str]] = {}
    sites: dict[int, collections.Counter[str]] = {}
    tokens, device = 0, torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp_name:
        for vocab in args.vocab:
            step, backend, tokens = step_of(args, vocab, Path(tmp_name))
            if args.json:
                names[vocab] = collections.Counter(ops=int(count_step_ops(step, device)["host_ops"]))
            else:
                names[vocab], sites[vocab] = breakdown(step, device)
            backend.close()
            print(f"[vocab {vocab}] {sum(names[vocab].values()):,} ops", flush=True)
    if args.json:
        print(json.dumps({str(v): names[v]["ops"] for v in args.vocab}))
        return 0
    print(
        f"\n# op_counts: {args.variant} {args.preset} L={args.length} x {args.samples} samples ({tokens:,} tokens), "
        f"scoring_chunk_tokens={args.chunk_tokens}\n"
    )
    print("\n".join(side_by_side("call site", sites, args.top)))
    print()
    print("\n".join(side_by_side("aten op", names, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

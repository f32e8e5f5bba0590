"""Weight-sync throughput between two real processes: Tandem's gloo and disk transports next to a bare
ProcessGroupGloo broadcast of one buffer of the same bytes.

    python bench/bench_weights.py [--mb 100] [--repeats 3] [--bucket-mb 4 16 64] [--threads 1] [--rows gloo disk cuda]
    python bench/bench_weights.py --handoff [--repeats 10] [--bucket-mb 64]     # GPU: same-GPU cuda_ipc hand-off

--handoff: the weights of a Qwen2-0.5B-shaped bf16 model (494M parameters, random values on the GPU) handed to
a receiver process on the same GPU through the real cuda_ipc transport, next to one torch device-to-device copy
of the same bytes (CUDA events). Rows vary the receiver (params as separate tensors, or views of one buffer laid
out like the buckets; mapping kept between syncs or not) and the sender (separate tensors, or views of one flat
buffer in spec order, as DeepSpeed's flat bf16 groups). The first sync of each row checks every tensor's
checksum on both sides (bit-identical); the timed ones do not.

The receiver is a separate process (helpers.weight_peer), already waiting when the publish starts.
"wall s" runs from publish() until the receiver has reported back (for disk: write, then read), GB/s is
bytes / wall, "vs raw" the ratio to the bare broadcast; send/recv s are each side's SyncStats.seconds.
Medians over repeats, after one untimed sync that builds the group and buffers. With a 4 MB bucket the
4 MB matrices of this model each fill a bucket alone and travel zero-copy (see pg.py); larger buckets
stage tensors through reused buffers (one copy on each side).
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers.weight_peer

from helpers.weight_peer import Peer, make_tensors, plan_to_text, specs_to_json

from services.contracts.config import CudaIpcWeights, weights_config
from services.weights import TensorSpec, WeightPublisher, torch_compat
from services.weights.transports.cuda_ipc import CudaIpcSender


def model_specs(total_mb: float) -> list[TensorSpec]:
    """A transformer-shaped mix: bf16 matrices of 4 MB, fp32 norms, one bf16 embedding of ~1/6 of the bytes."""
    embed_rows = max(1, int(total_mb * 2**20 / 6 / (1024 * 2)))
    specs = [TensorSpec("embed", "bfloat16", (embed_rows, 1024))]
    layer = 0
    while sum(s.nbytes for s in specs) < total_mb * 2**20:
        specs += [TensorSpec(f"l{layer}.norm", "float32", (1024,)), TensorSpec(f"l{layer}.w", "bfloat16", (1024, 2048))]
        layer += 1
    return specs


def bench_transport(
    *,
    transport: str,
    bucket_mb: float,
    specs: list[TensorSpec],
    repeats: int,
    peer: Peer,
    run_dir: Path,
    device: str = "cpu",
) -> dict[str, float]:
    config = weights_config(transport=transport, bucket_mb=bucket_mb, timeout_s=120)
    publisher = WeightPublisher(config=config, run_dir=run_dir, trainer_id="bench")
    tensors = {name: t.to(device) for name, t in make_tensors(specs, seed=0).items()}
    recv_s, send_s, wall_s = [], [], []
    for version in range(repeats + 1):  # the first sync builds the group and buffers: not timed
        plan = publisher.prepare(specs, version, 1, False)
        peer.send(op="receive", plan=plan_to_text(plan), rank=1, specs=specs_to_json(specs), device=device)
        time.sleep(0.2)  # let the receiver get to its rendezvous first
        started = time.perf_counter()
        sent = publisher.publish(plan, ((s.name, tensors[s.name]) for s in specs))
        got = peer.reply(timeout_s=300)
        wall = time.perf_counter() - started
        assert got["ok"], got
        if version:
            recv_s.append(got["stats"]["seconds"])
            send_s.append(sent.seconds)
            wall_s.append(wall)
    publisher.close()
    nbytes = sum(s.nbytes for s in specs)
    return {
        "bytes": nbytes,
        "send_s": statistics.median(send_s),
        "recv_s": statistics.median(recv_s),
        "wall_s": statistics.median(wall_s),
        "buckets": len(plan.buckets),
    }


def bench_raw_gloo(*, nbytes: int, repeats: int, peer: Peer) -> dict[str, float]:
    store = dist.TCPStore(
        host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    peer.send(
        op="raw_recv", addr="127.0.0.1", port=store.port, group="raw", nbytes=nbytes, repeats=repeats + 1, timeout_s=60
    )
    timeout = datetime.timedelta(seconds=60)
    pg = torch_compat.gloo_group(
        dist.PrefixStore("raw", store),
        rank=0,
        world_size=2,
        timeout=timeout,
        device=dist.ProcessGroupGloo.create_device(hostname="127.0.0.1"),
    )
    buffer = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    times = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        pg.broadcast(buffer, 0, timeout).wait()
        if i:
            times.append(time.perf_counter() - started)
    assert peer.reply(timeout_s=300)["ok"]
    pg.abort()
    return {
        "bytes": nbytes,
        "send_s": statistics.median(times),
        "recv_s": float("nan"),
        "wall_s": statistics.median(times),
        "buckets": 1,
    }


def qwen2_05b_specs() -> list[TensorSpec]:
    from bench_native_engine import QWEN2_05B  # a sibling script (its directory is on sys.path)
    from transformers import AutoModelForCausalLM, Qwen2Config

    from services.weights.layout import specs_from_tensors

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_05B), dtype=torch.bfloat16)
    return specs_from_tensors(model.named_parameters())


def gpu_tensors(specs: list[TensorSpec], *, flat: bool) -> dict[str, torch.Tensor]:
    """Random bf16 tensors on the GPU: separate allocations, or views of one buffer in spec order."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = [math.prod(s.shape) for s in specs]
    assert all(s.dtype == "bfloat16" for s in specs)
    if not flat:
        return {s.name: torch.randn(s.shape, generator=gen, device="cuda").to(torch.bfloat16) for s in specs}
    buffer = torch.randn(sum(sizes), generator=gen, device="cuda").to(torch.bfloat16)
    views, at = {}, 0
    for spec, n in zip(specs, sizes, strict=False):
        views[spec.name] = buffer[at : at + n].view(spec.shape)
        at += n
    return views


def d2d_copy_s(nbytes: int, repeats: int) -> tuple[float, float]:
    """One copy_ of the bytes: (device time by CUDA events, host wall time of launch + synchronize)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times, walls = [], []
    for i in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        wall = time.perf_counter() - t
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
            walls.append(wall)
    assert torch.equal(dst[-4096:], src[-4096:])
    return statistics.median(times), statistics.median(walls)


def handoff_row(
    *,
    publisher: WeightPublisher,
    peer: Peer,
    specs: list[TensorSpec],
    tensors: dict[str, torch.Tensor],
    flat_receiver: bool | str,
    repeats: int,
) -> dict[str, float]:
    recv_s, wall_s, copies, identical, timings = [], [], 0, False, []
    for version in range(repeats + 1):
        verify = version == 0
        plan = publisher.prepare(specs, version, 1, verify)
        peer.send(
            op="receive", plan=plan_to_text(plan), rank=1, specs=specs_to_json(specs), device="cuda", flat=flat_receiver
        )
        time.sleep(0.05)  # the receiver is waiting for "go" when publish starts
        started = time.perf_counter()
        sent = publisher.publish(plan, ((s.name, tensors[s.name]) for s in specs))
        got = peer.reply(timeout_s=300)
        wall = time.perf_counter() - started
        assert got["ok"], got
        if verify:
            identical = got["stats"]["checksums"] == sent.checksums and len(sent.checksums) == len(specs)
            continue
        recv_s.append(got["stats"]["seconds"])
        wall_s.append(wall)
        copies = got.get("copies", 0)
        timings.append(got.get("timings", {}))
    parts = {
        k: statistics.median(t.get(k, 0.0) for t in timings)
        for k in ("map_s", "plan_s", "launch_s", "sync_s", "done_post_s")
    }
    parts["after_go_s"] = statistics.median(
        t.get("launch_s", 0.0) + t.get("sync_s", 0.0) + t.get("done_post_s", 0.0) for t in timings
    )
    sender = publisher._transport
    assert isinstance(sender, CudaIpcSender)
    return {
        "recv_s": statistics.median(recv_s),
        "wall_s": statistics.median(wall_s),
        "copies": copies,
        **parts,
        "send_copies": sender.last_copies,
        "buckets": len(plan.buckets),
        "identical": identical,
    }


def handoff_main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("--handoff needs a CUDA device")
        return 2
    specs = qwen2_05b_specs()
    nbytes = sum(s.nbytes for s in specs)
    d2d, d2d_wall = d2d_copy_s(nbytes, repeats=max(args.repeats, 10))
    config = CudaIpcWeights(bucket_mb=args.bucket_mb[-1], timeout_s=120)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        publisher = WeightPublisher(config=config, run_dir=Path(tmp), trainer_id="bench")
        peers = {keep: Peer(env={"TANDEM_CUDA_IPC_KEEP_MAPPED": "1" if keep else "0"}) for keep in (False, True)}
        try:
            separate = gpu_tensors(specs, flat=False)
            # flat receiver: "recipe" = views of one buffer as a plain mapping (a copy per run of tensors),
            # True = FlatParams (whole bucket spans, NativeEngine's default after flatten_parameters)
            for name, flat_recv, kept in (
                ("separate -> separate params", False, False),
                ("separate -> flat params, recipe", "recipe", False),
                ("separate -> flat params, recipe, kept map", "recipe", True),
                ("separate -> FlatParams", True, False),
                ("separate -> FlatParams, kept map (default)", True, True),
            ):
                rows.append(
                    (
                        name,
                        handoff_row(
                            publisher=publisher,
                            peer=peers[kept],
                            specs=specs,
                            tensors=separate,
                            flat_receiver=flat_recv,
                            repeats=args.repeats,
                        ),
                    )
                )
            del separate
            flat = gpu_tensors(specs, flat=True)
            rows.append(
                (
                    "flat -> FlatParams, kept map (default)",
                    handoff_row(
                        publisher=publisher,
                        peer=peers[True],
                        specs=specs,
                        tensors=flat,
                        flat_receiver=True,
                        repeats=args.repeats,
                    ),
                )
            )
        finally:
            for peer in peers.values():
                peer.close()
            publisher.close()
    print(
        f"\nsame-GPU weight hand-off, cuda_ipc, Qwen2-0.5B-shaped bf16: {len(specs)} tensors, "
        f"{nbytes / 2**20:.1f} MiB, bucket {args.bucket_mb[-1]:g} MB, {torch.cuda.get_device_name()}, "
        f"median of {args.repeats}"
    )
    print(
        f"torch D2D copy of the same bytes (one copy_): {d2d * 1e3:.3f} ms by CUDA events = {nbytes / d2d / 1e9:.0f} "
        f"GB/s; {d2d_wall * 1e3:.3f} ms host wall (launch + synchronize)\n"
    )
    print(
        f"| {'sender -> receiver':44} | buckets | send copies | recv copies | bit-identical | recv ms | "
        f"recv / D2D | publish wall ms |"
    )
    print(
        f"|{'-' * 46}|---------|-------------|-------------|---------------|---------|------------|-----------------|"
    )
    for name, r in rows:
        print(
            f"| {name:44} | {r['buckets']:7} | {r['send_copies']:11} | {r['copies']:11} | "
            f"{'yes' if r['identical'] else 'NO':13} | {r['recv_s'] * 1e3:7.3f} | {r['recv_s'] / d2d:10.2f} | "
            f"{r['wall_s'] * 1e3:15.3f} |"
        )
    print(
        f"\nwhere the receiver's time went (ms, medians). Before go (the trainer is still filling its buckets): "
        f"map the handles, plan the copies. After go: launch, sync, done post. 'after go' is the hand-off's "
        f"critical path on the receiver\n\n| {'sender -> receiver':44} | map   | plan  | launch | sync  | "
        f"done post | after go | after go / D2D wall |\n"
        f"|{'-' * 46}|-------|-------|--------|-------|-----------|----------|---------------------|"
    )
    for name, r in rows:
        print(
            f"| {name:44} | {r['map_s'] * 1e3:5.3f} | {r['plan_s'] * 1e3:5.3f} | {r['launch_s'] * 1e3:6.3f} | "
            f"{r['sync_s'] * 1e3:5.3f} | {r['done_post_s'] * 1e3:9.3f} | {r['after_go_s'] * 1e3:8.3f} | "
            f"{r['after_go_s'] / d2d_wall:19.2f} |"
        )
    return 0 if all(r["identical"] for _, r in rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[4.0, 16.0, 64.0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    parser.add_argument(
        "--rows",
        nargs="+",
        default=["gloo", "disk", "cuda"],
        choices=["gloo", "disk", "cuda"],
        help="which transports to run next to the raw broadcast (cuda: when CUDA is available)",
    )
    parser.add_argument("--handoff", action="store_true", help="GPU: same-GPU cuda_ipc hand-off of a 0.5B model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.handoff:
        return handoff_main(args)
    specs = model_specs(args.mb)
    peer = Peer(env={"TANDEM_PEER_THREADS": str(args.threads)})
    rows = []
    try:
        raw = bench_raw_gloo(nbytes=sum(s.nbytes for s in specs), repeats=args.repeats, peer=peer)
        rows.append(("raw ProcessGroupGloo, 1 buffer", "-", raw))
        with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
            for bucket_mb in args.bucket_mb if "gloo" in args.rows else ():
                rows.append(
                    (
                        "tandem gloo",
                        f"{bucket_mb:g}",
                        bench_transport(
                            transport="gloo",
                            bucket_mb=bucket_mb,
                            specs=specs,
                            repeats=args.repeats,
                            peer=peer,
                            run_dir=Path(tmp),
                        ),
                    )
                )
            if "disk" in args.rows:
                rows.append(
                    (
                        "tandem disk (tmpdir)",
                        f"{args.bucket_mb[-1]:g}",
                        bench_transport(
                            transport="disk",
                            bucket_mb=args.bucket_mb[-1],
                            specs=specs,
                            repeats=args.repeats,
                            peer=peer,
                            run_dir=Path(tmp),
                        ),
                    )
                )
            # both processes on GPU 0; params and tensors in device memory
            if "cuda" in args.rows and torch.cuda.is_available():
                for transport in ("cuda_ipc", "gloo"):
                    rows.append(
                        (
                            f"tandem {transport} (cuda->cuda)",
                            f"{args.bucket_mb[-1]:g}",
                            bench_transport(
                                transport=transport,
                                bucket_mb=args.bucket_mb[-1],
                                specs=specs,
                                repeats=args.repeats,
                                peer=peer,
                                run_dir=Path(tmp),
                                device="cuda",
                            ),
                        )
                    )
    finally:
        peer.close()
    print(
        f"\n{len(specs)} tensors, {raw['bytes'] / 2**20:.1f} MiB, median of {args.repeats}, "
        f"torch threads {args.threads}\n"
    )
    print(
        f"{'path':32} {'bucket MB':>9} {'buckets':>7} {'send s':>8} {'recv s':>8} {'wall s':>8} {'GB/s':>7} "
        f"{'vs raw':>7}"
    )
    for name, bucket, row in rows:
        gbps = row["bytes"] / row["wall_s"] / 1e9
        print(
            f"{name:32} {bucket:>9} {row['buckets']:>7} {row['send_s']:>8.3f} {row['recv_s']:>8.3f} "
            f"{row['wall_s']:>8.3f} {gbps:>7.2f} {raw['wall_s'] / row['wall_s']:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

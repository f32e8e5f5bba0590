"""Where a same-GPU cuda_ipc hand-off spends its time: one copy of N bytes into a local buffer, from a buffer of
this process (plain D2D) next to the same copy from another process's allocation opened by CUDA IPC, by a few
copy methods. GPU only.

    python bench/bench_ipc_copy.py [--mb 942] [--repeats 20]

The owner process allocates the source and passes its IPC handle to a reader process as hex text on the
command line (no pickling). The reader times each method with CUDA events (device time) and with the host
clock around the launch alone and around launch + synchronize (host wall). Methods:
  copy_        dst.copy_(src): cudaMemcpyAsync
  chunks x8    eight copy_ calls of an eighth each, on one stream
  kernel       torch.bitwise_and(src_int64, -1, out=dst_int64): an SM load/store kernel, not the copy engine
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch


def _timed(fn, repeats: int) -> dict[str, float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    events, launch, wall = [], [], []
    fn()
    torch.cuda.synchronize()
    for _ in range(repeats):
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        events.append(start.elapsed_time(end))
        launch.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    return {
        "events_ms": statistics.median(events),
        "launch_ms": statistics.median(launch),
        "wall_ms": statistics.median(wall),
    }


def _methods(src: torch.Tensor, dst: torch.Tensor) -> dict:
    src64, dst64 = src.view(torch.int64), dst.view(torch.int64)
    step = src.numel() // 8

    def chunks() -> None:
        for i in range(8):
            hi = src.numel() if i == 7 else (i + 1) * step
            dst[i * step : hi].copy_(src[i * step : hi])

    return {
        "copy_": lambda: dst.copy_(src),
        "chunks x8": chunks,
        "kernel": lambda: torch.bitwise_and(src64, -1, out=dst64),
    }


def reader(args: argparse.Namespace) -> int:
    info = json.loads(args.reader)
    torch.cuda.set_device(0)
    storage = torch.UntypedStorage._new_shared_cuda(
        0, bytes.fromhex(info["handle"]), info["size"], info["offset"], b"", 0, bytes.fromhex(info["event"]), False
    )
    mapped = torch.empty(0, dtype=torch.uint8, device="cuda:0").set_(storage, 0, (info["size"],), (1,))
    local = torch.empty_like(mapped).copy_(mapped)
    dst = torch.empty_like(mapped)
    rows = []
    for source_name, src in (("local (same process)", local), ("CUDA IPC (other process)", mapped)):
        for method, fn in _methods(src, dst).items():
            rows.append({"source": source_name, "method": method, **_timed(fn, args.repeats)})
        assert torch.equal(dst, local), "copy differs from the source"
    print(json.dumps(rows))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=942.3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--reader", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reader:
        return reader(args)
    if not torch.cuda.is_available():
        print("bench_ipc_copy: needs a CUDA GPU", file=sys.stderr)
        return 2
    nbytes = int(args.mb * 2**20) // 8 * 8
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    _, handle, _size, offset, _, _, event, _ = src.untyped_storage()._share_cuda_()
    info = {"handle": handle.hex(), "size": nbytes, "offset": offset, "event": event.hex()}
    out = subprocess.run(
        [sys.executable, __file__, "--repeats", str(args.repeats), "--reader", json.dumps(info)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        print(out.stderr, file=sys.stderr)
        return out.returncode
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    base = rows[0]["events_ms"]
    gbps = lambda ms: nbytes / ms / 1e6  # noqa: E731
    print(f"{nbytes / 2**20:.1f} MiB, median of {args.repeats}, {torch.cuda.get_device_name(0)}\n")
    print(f"| {'source':26} | {'method':10} | events ms | GB/s  | vs local copy_ | launch ms | wall ms |")
    print(f"|{'-' * 28}|{'-' * 12}|-----------|-------|----------------|-----------|---------|")
    for r in rows:
        print(
            f"| {r['source']:26} | {r['method']:10} | {r['events_ms']:9.3f} | {gbps(r['events_ms']):5.0f} | "
            f"{r['events_ms'] / base:14.2f} | {r['launch_ms']:9.3f} | {r['wall_ms']:7.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

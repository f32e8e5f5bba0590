"""The SGLang servers the GPU suite's SGLang stages share: launched once per call, since each start costs 70-130 s.

    python bench/sglang_servers.py --work /tmp/tandem-sglang --out DIR     # launch, print, wait for Ctrl-C

Two random-init models (`tandem init-model`, the presets' own 22-token vocabulary) and one server each:
  q05    Qwen2-0.5B-shaped (preset q05): the throughput comparison with the native engine, the q05 weight syncs,
         the smoke checks of generation; CUDA graphs on (decode batches up to 256), no memory saver (its numbers
         are SGLang's plain speed);
  small  preset small: the small-preset syncs and the `tandem run`s (examples/digit_max_sglang_gpu.yaml), so it runs
         with --enable-memory-saver (the sync_offload run releases its memory) and CUDA graphs up to 512.
Both use triton attention and pytorch sampling (the bundle carries no flashinfer cubins: its README) and bf16.
`--mem-fraction-static` is a share of the memory free when a server profiles it, so the second server starts only
once the first has allocated its KV pool ("Memory pool end" in its log): started together, one could measure the
other's pool as its own headroom and fail with "Not enough memory".

Start-up seconds (launch to /health_generate answering 200) go to DIR/sglang_servers.json with the URLs, model
directories and log paths, which is what the stages read (SGLANG_SERVERS=that file).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--dtype",
    "bfloat16",
    "--log-level",
    "info",
]
SERVERS = {  # name -> (preset, launch args)
    "q05": ("q05", [*COMMON, "--mem-fraction-static", "0.3", "--context-length", "2048", "--cuda-graph-max-bs", "256"]),
    "small": (
        "small",
        [*COMMON, "--mem-fraction-static", "0.12", "--cuda-graph-max-bs", "512", "--enable-memory-saver"],
    ),
}
POOL_READY = "Memory pool end"


@dataclass
class Launched:
    name: str
    preset: str
    model: str
    url: str
    log: str
    pid: int
    startup_s: float | None = None  # launch to healthy; None = not healthy
    error: str = ""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wanted() -> list[str]:
    """SGLANG_SERVERS_ONLY=small (comma-separated names) launches only those: a short call pays one start-up."""
    only = [n for n in os.environ.get("SGLANG_SERVERS_ONLY", "").split(",") if n]
    unknown = [n for n in only if n not in SERVERS]
    if unknown:
        raise SystemExit(f"SGLANG_SERVERS_ONLY: unknown server(s) {unknown}; known: {', '.join(SERVERS)}")
    return only or list(SERVERS)


def init_models(work: Path) -> dict[str, Path]:
    from services.modelinit.init_model import init_model

    out = {}
    for name in wanted():
        preset = SERVERS[name][0]
        path = work / f"model_{preset}"
        if not (path / "config.json").is_file():
            init_model(path, preset=preset, seed=0)
        out[name] = path
    return out


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health_generate", timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


def log_says(log: Path, text: str) -> bool:
    return text in log.read_text(errors="replace")


def launch(name: str, model: Path, log_dir: Path) -> tuple[Launched, subprocess.Popen]:
    port = free_port()
    log = log_dir / f"sglang_{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SERVERS[name][1],
    ]
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_RETURN_ORIGINAL_LOGPROB"}
    proc = subprocess.Popen(
        cmd,
        stdout=open(log, "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    return Launched(
        name=name, preset=SERVERS[name][0], model=str(model), url=f"http://127.0.0.1:{port}", log=str(log), pid=proc.pid
    ), proc


def _wait(pred: Callable[[], bool], proc: subprocess.Popen, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.5)
    return False


@contextlib.contextmanager
def servers(work: Path, out: Path, *, timeout_s: float) -> Iterator[Path]:
    """Launches both servers (the second once the first holds its KV pool), waits until healthy or `timeout_s`,
    writes out/sglang_servers.json and yields its path; stops both on exit."""
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    models = init_models(work)
    deadline = time.monotonic() + timeout_s
    started: dict[str, tuple[Launched, subprocess.Popen, float]] = {}
    try:
        names = wanted()
        for name in names:
            t = time.monotonic()
            info, proc = launch(name, models[name], out)
            started[name] = (info, proc, t)
            if name != names[-1]:  # the next one profiles free memory only after this pool exists
                _wait(
                    functools.partial(log_says, Path(info.log), POOL_READY), proc, min(deadline, time.monotonic() + 120)
                )
        for info, proc, t in started.values():
            if _wait(functools.partial(healthy, info.url), proc, deadline):
                info.startup_s = time.monotonic() - t
            else:
                info.error = (
                    f"exited with code {proc.returncode}"
                    if proc.poll() is not None
                    else f"not healthy within {timeout_s:g}s"
                ) + f"; see {info.log}"
            state = f"healthy after {info.startup_s:.0f} s" if info.startup_s else info.error
            print(f"[sglang_servers] {info.name}: {info.url} {state}", flush=True)
        path = out / "sglang_servers.json"
        path.write_text(json.dumps({i.name: asdict(i) for i, _, _ in started.values()}, indent=1))
        yield path
    finally:
        for _, proc, _ in started.values():
            stop(proc)


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(timeout=grace_s)


def load(path: str | os.PathLike[str] | None = None) -> dict[str, dict]:
    """The servers a stage was given (SGLANG_SERVERS), {} when none."""
    path = path or os.environ.get("SGLANG_SERVERS")
    if not path or not Path(path).is_file():
        return {}
    return json.loads(Path(path).read_text())


def main() -> int:
    sys.path.insert(0, str(REPO))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/tandem-sglang"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/tandem-sglang"))
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    with servers(args.work, args.out, timeout_s=args.timeout_s) as path:
        print(path.read_text(), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())

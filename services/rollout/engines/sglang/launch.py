"""Launching an SGLang server for the rollout service (rollout.engine: sglang with no rollout.sglang.urls).

    python -m sglang.launch_server --model-path MODEL --host 127.0.0.1 --port PORT [--api-key K] [launch_args...]

Flags are those of `sglang/srt/server_args.py` (ServerArgs.add_cli_args; 0.5.x): --model-path, --host, --port,
--api-key, and whatever the user adds in rollout.sglang.launch_args (e.g. --tp-size 2, --mem-fraction-static 0.7);
--enable-memory-saver is added when loop.offload_rollout is on (release/resume of memory need it). Settings that
change what SGLang reports or runs are refused, here and by `tandem run`'s preflight (`launch_problems`). On the
machines this was written on SGLang cannot run (no CUDA GPU); the GPU suite starts it (docs/sglang.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.contracts.config import TimeoutsConfig
from services.rollout.engines.sglang.http import SGLangClient, SGLangError

if TYPE_CHECKING:
    from services.contracts.config import TandemConfig

log = logging.getLogger(__name__)

_TIMEOUTS = TimeoutsConfig()  # defaults of a launch without a config; the engine passes services.timeouts
_HEALTH_POLL_S = 1.0  # between /health_generate calls while the server starts

RESERVED_FLAGS = ("--model-path", "--host", "--port", "--api-key")
MEMORY_SAVER_FLAG = "--enable-memory-saver"
# launch_args the rollout engine refuses, with the reason (0.5.17's server_args.py and sampler.py)
REFUSED_FLAGS = {
    "--rl-on-policy-target": "it makes SGLang report bf16 log-probs of logits/T, which the fp32 trainer cannot match",
    "--enable-deterministic-inference": "it samples every request without a seed of its own with seed 42, so all "
    "samples of a GRPO group would be the same",
    "--enable-custom-logit-processor": "it lets requests run dill-pickled code in the server; Tandem sends no logit "
    "processor, so it only opens that door",
}
# environment variables of the launched server that change its reported log-probs
REFUSED_ENV = {
    "SGLANG_RETURN_ORIGINAL_LOGPROB": "it makes SGLang report log-probs of the raw logits (temperature 1), not of "
    "the distribution it samples from",
}
_TRUE = ("1", "true", "yes", "on")
JIT_NOTE = (
    "SGLang JIT-compiles its kernels on first use: on an H200 it took 70-130 s to become healthy (more with "
    "CUDA graphs to capture)"
)


def launch_problems(args: tuple[str, ...], environ: dict[str, str]) -> list[str]:
    """One line per launch setting the sglang engine cannot honour (flags of rollout.sglang.launch_args and the
    environment the server inherits)."""
    out = []
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in REFUSED_FLAGS:
            out.append(f"rollout.sglang.launch_args: {flag} is refused: {REFUSED_FLAGS[flag]}")
    for name, why in REFUSED_ENV.items():
        if environ.get(name, "").strip().lower() in _TRUE:
            out.append(
                f"{name}={environ[name]} in the environment is refused (the launched SGLang server inherits "
                f"it): {why}; unset it"
            )
    return out


def launch_args(config: TandemConfig) -> tuple[str, ...]:
    """rollout.sglang.launch_args, plus --enable-memory-saver when loop.offload_rollout asks for memory hand-back."""
    if config.rollout.engine != "sglang":
        return ()
    args = tuple(config.rollout.sglang.launch_args)
    if config.loop.offload_rollout and MEMORY_SAVER_FLAG not in args:
        args += (MEMORY_SAVER_FLAG,)
    return args


class SGLangNotInstalled(RuntimeError):
    pass


@dataclass(frozen=True)
class LaunchSpec:
    model_path: str
    port: int
    host: str = "127.0.0.1"
    api_key: str | None = None
    extra_args: tuple[str, ...] = ()
    python: str = sys.executable

    def command(self) -> list[str]:
        clash = [a for a in self.extra_args if a.split("=", 1)[0] in RESERVED_FLAGS]
        if clash:
            raise ValueError(
                f"rollout.sglang.launch_args must not set {', '.join(clash)}: the rollout service "
                f"sets the model path, host, port and API key of the server it launches"
            )
        cmd = [
            self.python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + list(self.extra_args)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def sglang_installed(python: str = sys.executable, *, timeout_s: float = _TIMEOUTS.control_s) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec("sglang") is not None
    probe = subprocess.run(
        [python, "-c", "import importlib.util,sys; sys.exit(importlib.util.find_spec('sglang') is None)"],
        capture_output=True,
        timeout=timeout_s,
    )
    return probe.returncode == 0


def require_sglang(python: str = sys.executable, *, timeout_s: float = _TIMEOUTS.control_s) -> None:
    if not sglang_installed(python, timeout_s=timeout_s):
        raise SGLangNotInstalled(
            f"rollout.engine is sglang and rollout.sglang.urls is empty, so the rollout service would launch "
            f"`{python} -m sglang.launch_server`, but the sglang package is not installed for {python}. Install it "
            f"(pip install 'tandem-rl[sglang]'; it needs a CUDA GPU — there is no CPU backend) or list running "
            f"servers in rollout.sglang.urls"
        )


class LaunchedServer:
    """A server process this rollout service started and owns (stopped with the engine)."""

    def __init__(self, spec: LaunchSpec, *, log_path: Path | None = None, timeouts: TimeoutsConfig = _TIMEOUTS):
        """`timeouts`: control_s bounds each probe of the server, a third of shutdown_s its graceful stop."""
        problems = launch_problems(spec.extra_args, dict(os.environ))
        if problems:
            raise ValueError("; ".join(problems))
        require_sglang(spec.python, timeout_s=timeouts.control_s)
        self.spec = spec
        self._timeouts = timeouts
        # its output goes where the rollout service's goes (tandem run keeps it in logs/), unless a file is given
        self._log = open(log_path, "ab") if log_path else None  # noqa: SIM115 - closed in stop()
        log.info("launching SGLang: %s", " ".join(spec.command()))
        self.process = subprocess.Popen(
            spec.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log else None,
            env={**os.environ},
            start_new_session=True,
        )

    def wait_healthy(self, *, timeout_s: float) -> None:
        client = SGLangClient(self.spec.url, api_key=self.spec.api_key)
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"the SGLang server launched for {self.spec.model_path} exited with code {code} "
                    f"before becoming healthy (command: {' '.join(self.spec.command())})"
                )
            try:
                client.get(
                    "/health_generate", timeout_s=min(self._timeouts.control_s, max(1.0, deadline - time.monotonic()))
                )
                return
            except SGLangError as exc:
                last = str(exc)
            time.sleep(_HEALTH_POLL_S)
        self.stop()
        raise TimeoutError(
            f"the SGLang server at {self.spec.url} was not healthy within {timeout_s:g}s "
            f"(rollout.sglang.startup_timeout_s; {JIT_NOTE}); last answer: {last}"
        )

    def stop(self, *, grace_s: float | None = None) -> None:
        # a third of shutdown_s: the rollout service stopping it has that budget for its whole stop
        grace_s = self._timeouts.shutdown_s / 3 if grace_s is None else grace_s
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(timeout=grace_s)
        if self._log is not None:
            self._log.close()

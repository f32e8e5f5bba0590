"""`docker compose up` for real: the CPU image (deploy/Dockerfile on a Debian bookworm base), deploy/docker-compose.yml
with deploy/docker-compose.local.yml (redis from a locally built image: no registry here), every service in its
own container on the compose network. One run, driven as a user would:

- it learns (eval reward up), and `tandem ctl --addr 127.0.0.1:50051` save and eval work from the host;
- the trainer container's process killed (kill -9, as an OOM kill or a crash): its restart policy starts it
  again, the coordinator (which sees a trainer that lost its state) is restarted too and resumes from the last
  checkpoint, and the books balance at the end (every rollout id trained once, nothing left in Redis). (`docker
  kill` is a manual stop to Docker: it disables the restart policy, so it cannot stand in for a crash);
- `docker compose down` then `up` resumes from the volumes.

Opt-in (`make compose-test`, ~10 minutes on 2 cores, more for the first image build): it installs the engine,
Compose and the base image (deploy/local/engine.sh) or skips in one line where it cannot. Timings go to the log
(`-s`): image build, start-up to the first trained step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from reliability_kit import assert_books_balance, wait_for

from services.buffer.stream import stream_key
from services.contracts.config import RedisConfig

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"

if os.environ.get("TANDEM_COMPOSE_TEST") != "1":
    pytest.skip("opt-in: `make compose-test` runs the stack under a real Docker engine", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

PROJECT = "tandem-compose-test"
IMAGE = "tandem-rl:cpu"
NUM_ROLLOUT = 240
SAVE_INTERVAL = 60
CTL_ADDR = "127.0.0.1:50051"
CONTAINER_UID = 1000  # the image's `tandem` user owns what the services write


def _run(cmd: list[str], *, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, **kw)
    if check:
        said = f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{said}"
    return out


@pytest.fixture(scope="module")
def images():
    """Engine + Compose + base image (or a one-line skip), then the CPU image and the local redis image. Returns
    the seconds the Tandem image build took (cached layers make a rebuild quick)."""
    ready = _run(["deploy/local/engine.sh", sys.executable], check=False, timeout=900)
    if ready.returncode != 0:
        pytest.skip((ready.stderr.strip().splitlines() or ["no container engine"])[-1])
    start = time.monotonic()
    built = _run(["deploy/build-image.sh", "--cpu", IMAGE], timeout=3600, env={**os.environ, "PYTHON": sys.executable})
    build_s = time.monotonic() - start
    print(f"\n[compose-test] {built.stdout.strip().splitlines()[-1]} (wall {build_s:.0f} s)")
    return build_s


class Stack:
    """`docker compose` on the users' compose file plus the local-images override, with an env file the test
    writes: the CPU image, a run config and host directories for models, checkpoints and runs."""

    def __init__(self, root: Path, config: dict):
        self.root = root
        for name in ("models", "checkpoints", "runs"):
            (root / name).mkdir()
            os.chown(root / name, CONTAINER_UID, CONTAINER_UID)
        (root / "run.yaml").write_text(yaml.safe_dump(config))
        self.run_dir = root / "runs" / "digit_max"
        env = {
            "TANDEM_IMAGE": IMAGE,
            "TANDEM_CONFIG": root / "run.yaml",
            "TANDEM_MODELS": root / "models",
            "TANDEM_CHECKPOINTS": root / "checkpoints",
            "TANDEM_RUNS": root / "runs",
            "TANDEM_RUN": "digit_max",
            "COORDINATOR_PORT": CTL_ADDR.rsplit(":", 1)[1],
            "TANDEM_MEMLOCK": memlock_limit(),
        }
        (root / "test.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        self.base = [
            "docker",
            "compose",
            "-p",
            PROJECT,
            "--project-directory",
            str(DEPLOY),
            "--env-file",
            str(root / "test.env"),
            "-f",
            str(DEPLOY / "docker-compose.yml"),
            "-f",
            str(DEPLOY / "docker-compose.local.yml"),
        ]

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run([*self.base, *args], timeout=timeout, check=check)

    def container(self, service: str) -> str:
        return self("ps", "-q", "--all", service).stdout.strip()

    def inspect(self, service: str, fmt: str) -> str:
        return _run(["docker", "inspect", "--format", fmt, self.container(service)]).stdout.strip()

    def logs(self, service: str) -> str:
        return self("logs", "--no-color", service, check=False).stdout

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def trained(self) -> list[int]:
        return [r["rollout_id"] for r in self.metrics() if "train/loss" in r]

    def wait_trained(self, count: int, timeout_s: float = 600) -> None:
        wait_for(
            lambda: len(self.trained()) >= count,
            timeout_s=timeout_s,
            every_s=0.5,
            what=f"{count} trained steps\n{self.logs('coordinator')[-3000:]}",
        )

    def checkpoints(self) -> list[Path]:
        root = self.root / "checkpoints" / "actor"
        return sorted(p for p in root.glob("rollout_*") if p.is_dir()) if root.exists() else []

    def redis_leftovers(self, stream: str) -> tuple[int, int]:
        def cli(*args: str) -> str:
            return self("exec", "-T", "redis", "redis-cli", *args).stdout.strip()

        if cli("EXISTS", stream) == "0":
            return 0, 0
        return int(cli("XLEN", stream)), int(cli("XPENDING", stream, "actor").splitlines()[0])


def memlock_limit() -> int:
    """Unlimited where this host allows it, else its hard limit: a container may not raise it (this sandbox)."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    return -1 if hard == resource.RLIM_INFINITY else hard


def ctl(action: str) -> subprocess.CompletedProcess[str]:
    return _run(
        [sys.executable, "-m", "services.cli", "ctl", "--addr", CTL_ADDR, "--timeout", "120", action], timeout=180
    )


def run_config() -> dict:
    config = yaml.safe_load((DEPLOY / "config" / "compose.yaml").read_text())
    config["loop"].update(num_rollout=NUM_ROLLOUT, save_interval=SAVE_INTERVAL, eval_interval=40)
    return config


@pytest.mark.usefixtures("images")  # built once, before the stack starts
def test_compose_stack_learns_survives_a_trainer_kill_and_resumes_after_down_up():
    root = Path(tempfile.mkdtemp(prefix="tandem-compose-", dir="/var/tmp"))
    root.chmod(0o755)  # the containers' user reads the run config and writes the directories
    stack = Stack(root, run_config())
    stack("down", "-v", "--remove-orphans", check=False)
    try:
        start = time.monotonic()
        stack("up", "-d", timeout=900)
        stack.wait_trained(1)
        print(
            f"[compose-test] start-up to the first trained step: {time.monotonic() - start:.0f} s "
            f"(`docker compose up -d` of redis, init, trainer, rollout, coordinator)"
        )

        # The control API from the host, through the published 127.0.0.1 port. save_interval is far off: the
        # checkpoint that appears now is the one `ctl save` asked for.
        saved = json.loads(ctl("save").stdout)
        assert saved["ok"] is True, saved
        wait_for(stack.checkpoints, what="the checkpoint `ctl save` asked for", timeout_s=300, every_s=0.5)
        assert int(stack.checkpoints()[0].name.removeprefix("rollout_")) < SAVE_INTERVAL - 1
        evaluated = ctl("eval").stdout
        assert "eval/reward_mean" in evaluated, evaluated

        # The trainer dies (kill -9 of the container's process, as an OOM kill or a crash): restart policy,
        # coordinator restart, resume from the last checkpoint. `docker kill` itself would not do: Docker
        # disables a container's restart policy when it is killed through the engine (a manual stop).
        stack.wait_trained(int(stack.checkpoints()[-1].name.removeprefix("rollout_")) + 4)
        killed_at = stack.trained()[-1]
        os.kill(int(stack.inspect("trainer", "{{.State.Pid}}")), signal.SIGKILL)
        wait_for(
            lambda: int(stack.inspect("trainer", "{{.RestartCount}}")) >= 1,
            what="the trainer's restart",
            timeout_s=120,
            every_s=0.5,
        )
        wait_for(
            lambda: "resumed from" in stack.logs("coordinator"),
            what="the coordinator's resume",
            timeout_s=600,
            every_s=1,
        )
        assert int(stack.inspect("coordinator", "{{.RestartCount}}")) >= 1
        stack.wait_trained(len(stack.trained()) + 3)
        print(
            f"[compose-test] trainer killed after step {killed_at}; resumed (coordinator restarts "
            f"{stack.inspect('coordinator', '{{.RestartCount}}')})"
        )

        # down (SIGTERM: the coordinator finishes its step and saves) then up: it resumes from the volumes.
        before_down = len(stack.trained())
        stack("down", timeout=300)
        assert stack.container("coordinator") == ""
        stack("up", "-d", timeout=900)
        wait_for(
            lambda: "resumed from" in stack.logs("coordinator"), what="the resume after up", timeout_s=600, every_s=1
        )
        assert len(stack.trained()) >= before_down

        waited = stack("wait", "coordinator", timeout=1200).stdout.strip().splitlines()[-1]  # its exit code
        assert waited.split()[-1] == "0", (waited, stack.logs("coordinator")[-3000:])

        trainer = json.loads((stack.checkpoints()[-1] / "tandem_state.json").read_text())
        state = json.loads(trainer["extra_state"]["coordinator"])
        stream = stream_key(RedisConfig().stream_prefix, run_config()["run_name"])
        assert_books_balance(trainer, state, num_rollout=NUM_ROLLOUT, leftovers=stack.redis_leftovers(stream))
        evals = [r["eval/reward_mean"] for r in stack.metrics() if "eval/reward_mean" in r]
        assert evals[-1] >= 0.8 and evals[-1] > evals[0] + 0.3, evals  # max(a, b) learned
        print(f"[compose-test] eval reward {evals[0]:.2f} -> {evals[-1]:.2f}; books balance over {NUM_ROLLOUT} steps")
    finally:
        stack("down", "-v", "--remove-orphans", check=False)
        shutil.rmtree(root, ignore_errors=True)

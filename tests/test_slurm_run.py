"""A real one-node Slurm on this machine (munged, slurmctld and slurmd on localhost, with a slurm.conf this test
writes), `sbatch deploy/slurm/tandem.sbatch` of the CPU demo: services/launcher/slurm.py starts Redis, trainer,
rollout and coordinator as job steps. Mid-run the job is requeued (`scontrol requeue`, what Slurm does on a
node failure with `--requeue`): it starts again and resumes from the checkpoints in its work directory. The run
finishes, learns, and its books balance.

Opt-in (`make slurm-test`): installs slurm-wlm and munge with apt when root, or skips in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from reliability_kit import aof_leftovers, assert_books_balance, wait_for
from tandem_runs import EXAMPLE

from services.buffer.stream import stream_key
from services.rpc.ports import free_port

REPO = Path(__file__).resolve().parents[1]
if os.environ.get("TANDEM_SLURM_TEST") != "1":
    pytest.skip("opt-in: `make slurm-test` runs a job on a one-node Slurm", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
NUM_ROLLOUT = 60
BATCH_SAMPLES = 16 * 8


def _installed() -> str | None:
    """None when slurmctld, slurmd, munged are there (installed here if needed), else why not."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch")):
        return None
    if os.geteuid() != 0:
        return "no slurm-wlm/munge and not root to install them"
    subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600)
    out = subprocess.run(
        ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )
    return None if out.returncode == 0 else f"apt-get install slurm-wlm munge failed: {out.stderr[-300:]}"


class OneNodeSlurm:
    """munged + slurmctld + slurmd on this host, all state under `root`."""

    def __init__(self, root: Path):
        self.root, self.host = root, socket.gethostname()
        self.procs: list[subprocess.Popen] = []
        for d in ("state", "spool", "munge", "log"):
            (root / d).mkdir(parents=True)
        cpus = os.cpu_count() or 1
        self.conf = root / "slurm.conf"
        self.conf.write_text(f"""ClusterName=tandemtest
SlurmctldHost={self.host}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root / "munge" / "munge.socket"}
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "log" / "slurmctld.log"}
SlurmdLogFile={root / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
SchedulerType=sched/builtin
KillWait=30
InactiveLimit=0
MinJobAge=600
NodeName={self.host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> OneNodeSlurm:
        socket_path = self.root / "munge" / "munge.socket"
        shutil.copy("/etc/munge/munge.key", self.root / "munge" / "munge.key")
        os.chmod(self.root / "munge" / "munge.key", 0o600)
        self._spawn(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={socket_path}",
                f"--key-file={self.root / 'munge' / 'munge.key'}",
                f"--pid-file={self.root / 'munge' / 'pid'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={self.root / 'munge' / 'seed'}",
            ]
        )
        wait_for(socket_path.exists, what="munged's socket", timeout_s=30)
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._spawn(["slurmd", "-D", "-f", str(self.conf), "-N", self.host])
        wait_for(
            lambda: "idle" in self.scontrol("show", "node", self.host).lower(),
            what="an idle node",
            timeout_s=120,
            every_s=1,
        )
        return self

    def _spawn(self, cmd: list[str]) -> None:
        name = Path(cmd[0]).name
        with open(self.root / "log" / f"{name}.out", "ab") as log:
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def scontrol(self, *args: str) -> str:
        return subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=60).stdout

    def job_state(self, job: str) -> tuple[str, int]:
        fields = dict(f.split("=", 1) for f in self.scontrol("show", "job", job).split() if "=" in f)
        return fields.get("JobState", "?"), int(fields.get("Restarts", "0"))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def demo_config(tmp: Path, model: Path) -> Path:
    config = yaml.safe_load(EXAMPLE.read_text())
    config["model"]["path"] = str(model)
    for key in ("train_path", "eval_path"):
        config["data"][key] = str((EXAMPLE.parent / config["data"][key]).resolve())
    config["rollout"]["rollout_batch_size"] = BATCH_SAMPLES // config["rollout"]["n_samples_per_prompt"]
    config["loop"].update(num_rollout=NUM_ROLLOUT, save_interval=5, eval_interval=20)
    path = tmp / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_sbatch_demo_finishes_learns_and_resumes_after_a_requeue(tmp_path, example_model):
    why = _installed()
    if why:
        pytest.skip(why)
    slurm = OneNodeSlurm(tmp_path / "slurm").start()
    workdir = tmp_path / "work"
    run_dir = workdir / "runs" / "digit_max"
    try:
        start = time.monotonic()
        env = {
            **slurm.env,
            "TANDEM_CONFIG": str(demo_config(tmp_path, example_model)),
            "TANDEM_WORKDIR": str(workdir),
            "TANDEM_PYTHON": sys.executable,
            "TANDEM_WEIGHTS": "gloo",
            "PYTHONPATH": str(REPO),
        }
        out = subprocess.run(
            [
                "sbatch",
                "--parsable",
                "--nodes=1",
                f"--chdir={tmp_path}",
                str(REPO / "deploy" / "slurm" / "tandem.sbatch"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        job = out.stdout.strip().split(";")[0]
        log = tmp_path / f"tandem-{job}.log"

        def trained() -> list[int]:
            path = run_dir / "metrics.jsonl"
            rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
            return [r["rollout_id"] for r in rows if "train/loss" in r]

        wait_for(lambda: trained(), what=f"the first step\n{_tail(log)}", timeout_s=600, every_s=1)
        print(f"\n[slurm-test] sbatch to the first trained step: {time.monotonic() - start:.0f} s")
        wait_for(
            lambda: len(list((workdir / "checkpoints" / "actor").glob("rollout_*"))) >= 2,
            what="two checkpoints",
            timeout_s=600,
            every_s=1,
        )
        slurm.scontrol("requeue", job)
        wait_for(lambda: slurm.job_state(job)[1] >= 1, what="the requeue", timeout_s=120, every_s=1)
        wait_for(
            lambda: slurm.job_state(job)[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
            what=f"the job's end\n{_tail(log)}",
            timeout_s=1200,
            every_s=2,
        )
        state, restarts = slurm.job_state(job)
        print(f"[slurm-test] job {job} {state} after {time.monotonic() - start:.0f} s, requeued {restarts}x")
        assert state == "COMPLETED", _tail(log)
        coordinator_log = (workdir / "logs" / "coordinator.log").read_text()
        assert "resumed from" in coordinator_log, coordinator_log[-3000:]

        checkpoints = sorted((workdir / "checkpoints" / "actor").glob("rollout_*"))
        trainer = json.loads((checkpoints[-1] / "tandem_state.json").read_text())
        state_ = json.loads(trainer["extra_state"]["coordinator"])
        assert_books_balance(
            trainer, state_, num_rollout=NUM_ROLLOUT, leftovers=_leftovers(workdir), batch_samples=BATCH_SAMPLES
        )
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
        assert evals[-1] > evals[0] + 0.3, evals
        print(f"[slurm-test] eval reward {evals[0]:.2f} -> {evals[-1]:.2f}")
    finally:
        slurm.stop()


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else f"(no {path})"


def _leftovers(workdir: Path) -> tuple[int, int]:
    """(stream length, pending in the actor group) from the job's Redis AOF, read by a fresh redis-server."""
    return aof_leftovers(
        workdir / "redis",
        stream=stream_key("tandem", "digit_max"),
        password=None,
        log_path=workdir / "redis-inspect.log",
    )

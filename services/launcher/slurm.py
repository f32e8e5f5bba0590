"""Tandem as one Slurm job: `deploy/slurm/tandem.sbatch` runs `python -m services.launcher.slurm CONFIG ...` in the
job's batch step, and this starts every service as a job step (`srun --overlap` on one node each):

- Redis (AOF in WORKDIR/redis) and the coordinator on the first node;
- the trainer on the first `--trainer-nodes` nodes: `tandem trainer` on one node (trainer.num_ranks ranks), else
  torchrun across them, rank 0 on the first node (it serves gRPC and joins the weight-sync group);
- one rollout replica on each of the next `--rollout-nodes` nodes (an allocation with fewer nodes places the
  rest round-robin again, ports stepping up per node, so a one-node job runs everything);
- the reward service, when the config has a `reward:` section, on the node after those (round-robin too: on a
  rollout's node it shares that node's GPUs, reward.memory_fraction).

Host names come from SLURM_JOB_NODELIST (`scontrol show hostnames`). Every service gets the wiring of
deploy/docker-compose.yml (`--set` addresses, ports, bind_host, weights.master_addr, checkpoint_dir), hosts
being node names. WORKDIR (a shared file system) holds the run directory, the checkpoints and Redis's AOF, so a
requeued job resumes: Slurm requeues it on node failure (`#SBATCH --requeue`), and this requeues it when the
coordinator fails with a retryable error (exit 1), at most --max-requeues times (SLURM_RESTART_COUNT).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from services.contracts.config import ConfigError
from services.contracts.config_loading import load_config
from services.contracts.exits import ExitCode

# The ports deploy/docker-compose.yml and the Helm chart use (tests/test_deploy_targets.py checks they agree).
COORDINATOR_PORT, TRAINER_PORT, ROLLOUT_PORT, REDIS_PORT, RENDEZVOUS_PORT = 50051, 50052, 50061, 6379, 29500
REWARD_PORT = 50071
REDIS_ARGS = ("--appendonly", "yes", "--appendfsync", "everysec")  # as the compose file's redis command


@dataclass(frozen=True)
class Layout:
    """Where each service runs: node names of the allocation."""

    head: str  # Redis and the coordinator
    trainer: tuple[str, ...]  # trainer ranks' nodes; rank 0 on the first
    rollout: tuple[tuple[str, int], ...]  # (node, port) of each rollout replica
    reward: str  # the reward service's node (when the config has one): the node after the rollouts'

    @classmethod
    def of(cls, nodes: list[str], *, trainer_nodes: int, rollout_nodes: int) -> Layout:
        if not nodes:
            raise ValueError("no nodes: SLURM_JOB_NODELIST is empty")
        if trainer_nodes < 1 or rollout_nodes < 1:
            raise ValueError(f"--trainer-nodes {trainer_nodes} and --rollout-nodes {rollout_nodes} must be 1 or more")
        trainer = tuple(nodes[i % len(nodes)] for i in range(trainer_nodes))
        rollout: list[tuple[str, int]] = []
        for i in range(rollout_nodes):
            node = nodes[(trainer_nodes + i) % len(nodes)]
            rollout.append((node, ROLLOUT_PORT + sum(n == node for n, _ in rollout)))
        reward = nodes[(trainer_nodes + rollout_nodes) % len(nodes)]
        return cls(head=nodes[0], trainer=trainer, rollout=tuple(rollout), reward=reward)


@dataclass(frozen=True)
class Step:
    name: str
    nodes: tuple[str, ...]
    argv: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    redis: Step
    services: tuple[Step, ...]  # trainer, the reward service (a config with a reward: section), rollout replicas
    coordinator: Step


def wiring(
    config: Path,
    *,
    run_dir: Path,
    checkpoint_dir: Path,
    layout: Layout,
    num_ranks: int,
    transport: str,
    tracing: str,
    auth_token: str,
) -> list[str]:
    """The compose file's x-wiring with this job's hosts and directories."""
    rollout = ", ".join(f"{{host: {node}, port: {port}}}" for node, port in layout.rollout)
    sets = [
        "services.bind_host=0.0.0.0",
        f"services.coordinator.host={layout.head}",
        f"services.coordinator.port={COORDINATOR_PORT}",
        f"services.trainer.host={layout.trainer[0]}",
        f"services.trainer.port={TRAINER_PORT}",
        f"services.rollout=[{rollout}]",
        f"services.reward.host={layout.reward}",
        f"services.reward.port={REWARD_PORT}",
        f"services.auth_token={auth_token}",
        f"redis.url=redis://{layout.head}:{REDIS_PORT}/0",
        f"weights.master_addr={layout.trainer[0]}",
        f"trainer.num_ranks={num_ranks}",
        f"trainer.checkpoint_dir={checkpoint_dir}",
        f"weights.transport={transport}",
        f"tracing.exporter={tracing}",
    ]
    return [str(config), "--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))]


def plan(args: argparse.Namespace, nodes: list[str], *, tandem: str, redis_server: str) -> Plan:
    layout = Layout.of(nodes, trainer_nodes=args.trainer_nodes, rollout_nodes=args.rollout_nodes)
    workdir = args.workdir.resolve()
    config = load_config(args.config, args.overrides)
    run_dir = workdir / "runs" / config.run_name
    gpus = args.gpus_per_node
    wired = wiring(
        args.config.resolve(),
        run_dir=run_dir,
        checkpoint_dir=workdir / "checkpoints",
        layout=layout,
        num_ranks=max(1, gpus) * len(layout.trainer),
        transport=args.weights,
        tracing=args.tracing,
        auth_token=os.environ.get("TANDEM_AUTH_TOKEN", ""),
    )
    wired += [a for o in args.overrides for a in ("--set", o)]
    if len(layout.trainer) == 1:
        trainer = (tandem, "trainer", "--role", "actor", *wired)
    else:  # one torchrun per node; SLURM_PROCID is the node's rank within the step
        trainer = (
            "bash",
            "-c",
            'exec "$0" -m torch.distributed.run --nnodes "$1" --node-rank "$SLURM_PROCID" '
            '--nproc-per-node "$2" --master-addr "$3" --master-port "$4" -m services.cli trainer --role actor '
            '"${@:5}"',
            sys.executable,
            str(len(layout.trainer)),
            str(max(1, gpus)),
            layout.trainer[0],
            str(RENDEZVOUS_PORT),
            *wired,
        )
    rollouts = tuple(
        Step(f"rollout-{i}", (node,), (tandem, "rollout", "--replica", str(i), *wired))
        for i, (node, _port) in enumerate(layout.rollout)
    )
    redis = (
        redis_server,
        *REDIS_ARGS,
        "--port",
        str(REDIS_PORT),
        "--bind",
        "0.0.0.0",
        "--protected-mode",
        "no",
        "--dir",
        str(workdir / "redis"),
    )
    reward = (Step("reward", (layout.reward,), (tandem, "reward", *wired)),) if config.reward is not None else ()
    return Plan(
        redis=Step("redis", (layout.head,), redis),
        services=(Step("trainer", tuple(dict.fromkeys(layout.trainer)), trainer), *reward, *rollouts),
        coordinator=Step("coordinator", (layout.head,), (tandem, "coordinator", *wired)),
    )


def srun(step: Step, *, log_dir: Path) -> subprocess.Popen:
    """One job step: one task per node, sharing the allocation's CPUs/GPUs with the other steps (--overlap)."""
    cmd = [
        "srun",
        "--overlap",
        f"--nodes={len(step.nodes)}",
        f"--ntasks={len(step.nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(step.nodes)}",
        f"--job-name={step.name}",
        "--kill-on-bad-exit=1",
        *step.argv,
    ]
    with open(log_dir / f"{step.name}.log", "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def job_nodes() -> list[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise SystemExit("tandem slurm: SLURM_JOB_NODELIST is not set: run this inside a Slurm job (sbatch)")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
    if out.returncode != 0:
        said = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"tandem slurm: `scontrol show hostnames {nodelist}` failed: {said}")
    return out.stdout.split()


def wait_redis(host: str, timeout_s: float) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            redis.Redis(host=host, port=REDIS_PORT, socket_timeout=2).ping()
            return
        except redis.RedisError as exc:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"tandem slurm: redis on {host}:{REDIS_PORT} did not answer in {timeout_s:g} s: {exc}"
                ) from None
            time.sleep(0.5)


def run(args: argparse.Namespace) -> int:
    tandem = shutil.which("tandem") or str(Path(sys.executable).with_name("tandem"))
    from services.launcher.redis_server import find_redis_server

    steps = plan(args, job_nodes(), tandem=tandem, redis_server=find_redis_server())
    config = load_config(args.config, args.overrides)
    log_dir = args.workdir.resolve() / "logs"
    for d in (log_dir, args.workdir.resolve() / "redis"):
        d.mkdir(parents=True, exist_ok=True)
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    print(
        f"tandem slurm: job {os.environ.get('SLURM_JOB_ID')} (requeued {restarts}x): redis + coordinator on "
        f"{steps.redis.nodes[0]}; " + "; ".join(f"{s.name} on {','.join(s.nodes)}" for s in steps.services),
        flush=True,
    )
    procs = [srun(steps.redis, log_dir=log_dir)]
    coordinator: subprocess.Popen | None = None
    stopped: list[int] = []

    def stop(sig: int, _frame: object) -> None:  # scancel, requeue, time limit: the coordinator saves, then the rest
        stopped.append(sig)
        if coordinator is not None:
            coordinator.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    try:
        wait_redis(steps.redis.nodes[0], config.loop.startup_timeout_s)
        procs += [srun(s, log_dir=log_dir) for s in steps.services]
        coordinator = srun(steps.coordinator, log_dir=log_dir)
        code = coordinator.wait()
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=config.services.timeouts.shutdown_s + 10)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"tandem slurm: the coordinator exited with {code}", flush=True)
    # Stopped by Slurm (scancel, its own requeue, the time limit): Slurm decides what comes next.
    if (
        not stopped
        and code not in (ExitCode.OK, ExitCode.BAD_INPUT, ExitCode.PERMANENT)
        and restarts < args.max_requeues
    ):
        job = os.environ["SLURM_JOB_ID"]
        print(
            f"tandem slurm: requeueing job {job} ({restarts + 1} of --max-requeues {args.max_requeues}); "
            "it resumes from the last checkpoint",
            flush=True,
        )
        subprocess.run(["scontrol", "requeue", job], check=False)
    return code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.launcher.slurm", description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path, help="run config (paths in it must be on a file system every node sees)")
    p.add_argument(
        "--workdir", type=Path, required=True, help="shared directory: runs/<run_name>, checkpoints, redis (AOF), logs"
    )
    p.add_argument("--trainer-nodes", type=int, default=1)
    p.add_argument("--rollout-nodes", type=int, default=1)
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0),
        help="trainer ranks per node (default SLURM_GPUS_ON_NODE; 0 = one CPU rank)",
    )
    p.add_argument("--weights", default="nccl", help="weights.transport (gloo on CPU)")
    p.add_argument("--tracing", default="none", help="tracing.exporter")
    p.add_argument("--max-requeues", type=int, default=3)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return run(build_parser().parse_args(argv))
    except (ValueError, ConfigError) as exc:  # a bad layout or run config: one line, not a traceback
        print(f"tandem slurm: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())

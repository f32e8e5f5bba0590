"""The `tandem` command: one explicit table of subcommands (`COMMANDS`), each its arguments and what it runs.

A command's module is imported only when it runs (the trainer pulls in DeepSpeed, the launcher the supervisor), so
`tandem ctl` and `tandem --help` stay light. The launcher starts services by these names (`tandem trainer ...`);
tests/test_registries.py keeps the table, the parser and those names in step.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from services.contracts.config import ConfigError, TandemConfig, TimeoutsConfig
from services.contracts.config_loading import load_config
from services.contracts.exits import ExitCode
from services.modelinit.families import BODIES
from services.modelinit.init_model import ARCHS, DTYPES, all_preset_names
from services.rpc.grpc_util import PortInUse


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---- the services: a run configuration, then the service --------------------------------------------------------


def _config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML run configuration")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set trainer.lr=3e-4 (repeatable)",
    )
    p.add_argument("--run-dir", type=Path, default=None, help="run directory (default runs/<run_name>)")


def _config_and_run_dir(args: argparse.Namespace) -> tuple[TandemConfig, Path]:
    config = load_config(args.config, args.overrides)
    return config, (args.run_dir or Path("runs") / config.run_name).resolve()


def _check_trackers(config: TandemConfig) -> None:
    from services.telemetry.tracker_registry import check_tracker_packages

    check_tracker_packages(config.tracing.trackers)


def _run_arguments(p: argparse.ArgumentParser) -> None:
    _config_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument(
        "--init-model",
        action="store_true",
        help="when model.path holds no model, build a random-init one there (preset model.init_preset, "
        "default tiny); without this flag a missing model is an error",
    )


def _run(args: argparse.Namespace) -> int:
    """Bad inputs fail before any service starts (ConfigError: one line, exit 2); a run that already finished says
    so and exits 0."""
    from services.launcher.preflight import already_finished, check_run_inputs

    config, run_dir = _config_and_run_dir(args)
    _check_trackers(config)
    finished = already_finished(config, run_dir=run_dir)
    if finished:
        print(f"tandem: {finished}", file=sys.stderr)
        return ExitCode.OK
    for warning in check_run_inputs(config, init_model=args.init_model):
        print(f"tandem: warning: {warning}", file=sys.stderr)
    from services.launcher.supervisor import run_local

    return run_local(config, run_dir=run_dir, progress=not args.no_progress)


def _coordinator_arguments(p: argparse.ArgumentParser) -> None:
    _config_arguments(p)
    p.add_argument(
        "--start-gate",
        action="store_true",
        help="after loading its code, wait for a line 'go' on stdin before starting (`tandem run` starts "
        "the coordinator beside the other services this way and lets it go once they are healthy)",
    )


def _coordinator(args: argparse.Namespace) -> int:
    """It checks its data itself (exit 3): the model may be in another container."""
    from services.coordinator.server import main as coordinator_main

    config, run_dir = _config_and_run_dir(args)
    _check_trackers(config)
    if args.start_gate and sys.stdin.readline().strip() != "go":
        return ExitCode.INTERRUPTED  # the supervisor gave up on this start (it stops this process too)
    return coordinator_main(config, run_dir=run_dir)


def _trainer_arguments(p: argparse.ArgumentParser) -> None:
    _config_arguments(p)
    p.add_argument("--role", choices=["actor", "critic"], default="actor")


def _trainer(args: argparse.Namespace) -> int:
    from services.trainer.server import main as trainer_main

    config, run_dir = _config_and_run_dir(args)
    return trainer_main(config, run_dir=run_dir, role=args.role)


def _rollout_arguments(p: argparse.ArgumentParser) -> None:
    _config_arguments(p)
    p.add_argument("--replica", type=int, default=0, help="index into services.rollout")


def _rollout(args: argparse.Namespace) -> int:
    from services.rollout.server import main as rollout_main

    config, run_dir = _config_and_run_dir(args)
    return rollout_main(config, run_dir=run_dir, replica=args.replica)


def _reward(args: argparse.Namespace) -> int:
    from services.reward.server import main as reward_main

    config, run_dir = _config_and_run_dir(args)
    return reward_main(config, run_dir=run_dir)


# ---- tools --------------------------------------------------------------------------------------------------


def _ctl_arguments(p: argparse.ArgumentParser) -> None:
    from services.coordinator.ctl import ACTIONS, DEFAULT_ADDR

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = (
        "Control a running coordinator. Which one: --addr; else --run-dir (its config.yaml names it); "
        f"else the `tandem run` running under ./runs/; else {DEFAULT_ADDR}."
    )
    p.epilog = "actions:\n" + "\n".join(f"  {name:<8} {text}" for name, text in ACTIONS.items())
    p.add_argument("--addr", default=None, help="coordinator HOST:PORT")
    p.add_argument("--run-dir", type=Path, default=None, help="a run directory of `tandem run` (RUN_DIR/config.yaml)")
    p.add_argument("--token", default=None, help="bearer token (services.auth_token; default: from --run-dir)")
    p.add_argument("--tls-ca", default=None, help="CA certificate for TLS (default: from --run-dir)")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for the reply (default: the run's services.timeouts.control_s, else "
        f"{TimeoutsConfig().control_s:g})",
    )
    p.add_argument("--endpoint", default=None, help="episodes/reward: the rollout's agent endpoint URL")
    p.add_argument("--max", type=int, default=1, help="episodes: how many to claim at most")
    p.add_argument("--replica", type=int, default=0, help="episodes/reward with --run-dir: which rollout replica")
    p.add_argument("--episode", default=None, help="reward: the episode id")
    p.add_argument("--reward", type=float, default=None, help="reward: its value")
    p.add_argument("action", choices=[*ACTIONS, *EPISODE_ACTIONS], metavar="ACTION", help=", ".join(ACTIONS))
    p.epilog += "\n" + "\n".join(f"  {name:<8} {text}" for name, text in EPISODE_ACTIONS.items())


EPISODE_ACTIONS = {
    "episodes": "claim open episodes of rollout.agent: external (JSON lines: episode_id, base_url, row)",
    "reward": "post an episode's reward (--episode ID --reward R), which ends it",
}


def _ctl(args: argparse.Namespace) -> int:
    from services.coordinator.ctl import find_coordinator, run_ctl

    if args.action in EPISODE_ACTIONS:
        return _ctl_episodes(args)
    target = find_coordinator(addr=args.addr, run_dir=args.run_dir, token=args.token, tls_ca=args.tls_ca)
    return run_ctl(target=target, action=args.action, timeout_s=args.timeout)


def _ctl_episodes(args: argparse.Namespace) -> int:
    from services.contracts.config import ConfigError
    from services.contracts.config_loading import load_config
    from services.rollout.agents.episodes_client import claim_episodes, find_endpoint, post_reward

    url = find_endpoint(endpoint=args.endpoint, run_dir=args.run_dir, replica=args.replica)
    token = args.token
    if token is None and args.run_dir is not None and (args.run_dir / "config.yaml").is_file():
        token = load_config(args.run_dir / "config.yaml").services.auth_token
    timeout_s = args.timeout or 30.0
    if args.action == "episodes":
        return claim_episodes(url, token=token, limit=args.max, timeout_s=timeout_s)
    if args.episode is None or args.reward is None:
        raise ConfigError("tandem ctl reward: give --episode ID and --reward VALUE")
    return post_reward(url, token=token, episode=args.episode, reward=args.reward, timeout_s=timeout_s)


def _init_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", type=Path)
    p.add_argument(
        "--preset",
        choices=all_preset_names(),
        default="tiny",
        help="tiny, small, q05, q15: toy bodies over a 22-token vocabulary; qwen2.5-0.5b, qwen2.5-1.5b, "
        "qwen3-0.6b, llama3.2-1b: those models' exact shapes, vocabularies and special tokens, with a "
        "byte-level BPE tokenizer trained here; classifier: a sequence classifier (a reward model: Qwen2.5's "
        "tokenizer and chat template over a tiny body, one score logit)",
    )
    p.add_argument(
        "--arch",
        choices=list(ARCHS),
        default=None,
        help="toy presets: default the preset's (qwen2 for q05/q15, else llama)",
    )
    p.add_argument(
        "--body",
        choices=list(BODIES),
        default=None,
        help="a real model's preset over a small body: its vocabulary, tokenizer, special ids, rope, tying "
        "and head size, with 2 layers of width 64 (CPU tests and demos)",
    )
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="weights as saved: default bfloat16 for a real model's full body, else float32",
    )
    p.add_argument("--seed", type=int, default=0)


def _init_model(args: argparse.Namespace) -> int:
    from services.modelinit.init_model import check_init_args, init_model, parameter_count

    spec = check_init_args(preset=args.preset, arch=args.arch, body=args.body, layers=args.layers, dtype=args.dtype)
    path = init_model(
        args.out_dir,
        preset=args.preset,
        arch=args.arch,
        seed=args.seed,
        body=args.body,
        layers=args.layers,
        dtype=args.dtype,
    )
    body = f" ({spec.body} body)" if spec.body else ""
    print(
        f"wrote random-init {args.preset}{body} {spec.arch} model ({spec.dtype}) and tokenizer to {path} "
        f"({parameter_count(path) / 1e9:.3f}B parameters)"
    )
    return ExitCode.OK


def _plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, default=None)


def _plot(args: argparse.Namespace) -> int:
    from services.coordinator.plot import plot_run

    try:
        paths = plot_run(args.run_dir, out=args.out)
    except (FileNotFoundError, ValueError) as exc:  # not a run dir, or no step finished yet
        print(f"tandem plot: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    for path in paths:
        print(f"wrote {path}")
    return ExitCode.OK


COMMANDS: Mapping[str, Command] = MappingProxyType(
    {
        c.name: c
        for c in (
            Command("run", "run all services and an embedded redis-server locally", _run_arguments, _run),
            Command("coordinator", "run the coordinator service alone", _coordinator_arguments, _coordinator),
            Command(
                "trainer",
                "run one trainer service (all ranks of it under torchrun/deepspeed)",
                _trainer_arguments,
                _trainer,
            ),
            Command("rollout", "run one rollout service replica", _rollout_arguments, _rollout),
            Command("reward", "run the reward service (the models of reward.models)", _config_arguments, _reward),
            Command("ctl", "control a running coordinator", _ctl_arguments, _ctl),
            Command(
                "init-model",
                "build a random-init HF model and tokenizer locally (no download)",
                _init_model_arguments,
                _init_model,
            ),
            Command("plot", "reward / throughput curves of a run as PNG", _plot_arguments, _plot),
        )
    }
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Asynchronous RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.arguments(sub.add_parser(command.name, help=command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except ConfigError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except PortInUse as exc:  # a service's fixed port (services.*.port) is taken
        print(f"tandem {args.command}: {exc}", file=sys.stderr, flush=True)
        return ExitCode.BAD_INPUT
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

"""The plug-in tables besides the weight transports' (test_weights_registry.py): the engines, the metric trackers,
the CLI's commands and the built-in environments. Each is one explicit table whose keys are what the config (or the
launcher) names, and importing it loads none of its plug-ins' modules."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

from services.cli import COMMANDS, build_parser
from services.contracts.config import PrometheusTrackerConfig, RolloutConfig, TrackerConfig
from services.contracts.rollout_config import RolloutSettings
from services.rollout.engines.engine_registry import ENGINES, engine_kind
from services.rollout.environment_registry import BUILTIN_ENVIRONMENTS, resolve_environment
from services.rollout.environments import Environment, EnvironmentSpecError
from services.telemetry.prometheus import PrometheusTracker
from services.telemetry.tracker_registry import TRACKERS, RunTarget
from services.telemetry.trackers import JsonlTracker

ROOT = Path(__file__).resolve().parents[1]

# What importing the tables loads of the modules their entries build from (printed as JSON).
_PROBE = """
import json, sys
import services.cli, services.rollout.engines.engine_registry, services.telemetry.tracker_registry
import services.rollout.environment_registry
plug_ins = ("services.rollout.engines.native.engine", "services.rollout.engines.sglang.engine",
            "services.telemetry.wandb_tracker", "services.telemetry.prometheus",
            "services.telemetry.tensorboard_tracker", "services.trainer.server",
            "services.rollout.server", "services.coordinator.server", "services.launcher.supervisor",
            "services.coordinator.ctl", "services.coordinator.plot", "services.rollout.math_feedback")
print(json.dumps(sorted(m for m in plug_ins if m in sys.modules)))
"""


def literal_choices(union: object, *, key: str) -> set[str]:
    """The values of `key` a config union of sections tagged by it allows (Annotated[A | B, discriminator])."""
    sections = typing.get_args(typing.get_args(union)[0])
    return {value for section in sections for value in typing.get_args(section.model_fields[key].annotation)}


def test_the_engine_table_lists_exactly_the_engines_the_config_accepts():
    assert set(ENGINES) == literal_choices(RolloutConfig, key="engine")
    assert all(kind.name == name for name, kind in ENGINES.items())


def test_an_unknown_engine_is_named_with_the_known_ones():
    try:
        engine_kind("vllm")
    except ValueError as exc:
        assert str(exc) == "unknown rollout engine 'vllm' (known: native, sglang)"
    else:
        raise AssertionError("no error")


def test_the_tracker_table_lists_exactly_the_trackers_the_config_accepts(tmp_path):
    assert set(TRACKERS) == literal_choices(TrackerConfig, key="type")
    assert all(kind.name == name for name, kind in TRACKERS.items())
    run = RunTarget(run_dir=tmp_path, run_name="r")
    assert type(TRACKERS["jsonl"].build(PrometheusTrackerConfig(), run)) is JsonlTracker
    prometheus = TRACKERS["prometheus"].build(PrometheusTrackerConfig(port=0), run)
    try:
        assert type(prometheus) is PrometheusTracker
    finally:
        prometheus.close()


def test_the_command_table_is_the_parser_and_holds_what_the_launcher_starts():
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(subcommands.choices) == list(COMMANDS)
    assert all(command.name == name for name, command in COMMANDS.items())
    launched = (ROOT / "services" / "launcher" / "supervisor.py").read_text()
    for service in ("coordinator", "trainer", "rollout"):  # `tandem <service> CONFIG ...`, started by the supervisor
        assert f'"{service}"' in launched and service in COMMANDS


def test_the_environment_table_is_what_the_config_and_the_docs_name_and_each_entry_resolves_by_name():
    """rollout.environment is a free string (a spec is a path): the table is the one list of names, which the
    resolver and its error read, and the config's description and docs/own-task.md must name the same ones."""
    names = sorted(BUILTIN_ENVIRONMENTS)
    assert all(entry.name == name for name, entry in BUILTIN_ENVIRONMENTS.items())
    described = RolloutSettings.model_fields["environment"].description
    listed = re.search(r"a built-in \(([^)]*)\)", described or "")
    assert listed is not None and listed.group(1).split(", ") == names
    section = (ROOT / "docs" / "own-task.md").read_text().split("### Built-in environments")[1].split("\n#")[0]
    assert re.findall(r"^- `(\w+)`", section, flags=re.MULTILINE) == names
    for name in names:
        plugin = resolve_environment(f" {name} ")
        assert plugin.spec == name and isinstance(plugin.make(), Environment)
    try:
        resolve_environment("math")
    except EnvironmentSpecError as exc:
        assert str(exc) == (
            f"environment 'math' is not a built-in ({', '.join(names)}) and not of the form module:Class or "
            "path/to/file.py:Class"
        )
    else:
        raise AssertionError("no error")


def test_importing_the_tables_loads_no_plug_in():
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []

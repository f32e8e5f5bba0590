"""The `tandem` command: every subcommand's help, and config mistakes refused before anything starts."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SUBCOMMANDS = ("run", "coordinator", "trainer", "rollout", "ctl", "init-model", "plot")


def tandem_cmd() -> list[str]:
    """The installed console script (next to this interpreter), else the module."""
    script = Path(sys.executable).with_name("tandem")
    if script.exists():
        return [str(script)]
    found = shutil.which("tandem")
    return [found] if found else [sys.executable, "-m", "services.cli"]


def tandem(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*tandem_cmd(), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
        env={**os.environ, "TANDEM_REDIS_SERVER": "/nonexistent/redis-server"},
    )


def test_top_level_help_lists_every_subcommand():
    result = tandem("--help")
    assert result.returncode == 0, result.stderr
    for cmd in SUBCOMMANDS:
        assert cmd in result.stdout


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
def test_subcommand_help(cmd):
    result = tandem(cmd, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: tandem {cmd}")
    if cmd in ("run", "coordinator", "trainer", "rollout"):
        assert "--set KEY=VALUE" in result.stdout and "config" in result.stdout


def test_no_subcommand_is_a_usage_error():
    result = tandem()
    assert result.returncode == 2 and "usage: tandem" in result.stderr


BAD_YAML = """\
model: {path: models/tiny}
data: {train_path: data/train.jsonl}
trainer:
  lrr: 0.001
"""


def test_run_with_a_bad_config_exits_2_before_starting_anything(tmp_path):
    (tmp_path / "bad.yaml").write_text(BAD_YAML)
    result = tandem("run", "bad.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "tandem: invalid configuration in bad.yaml:\n  trainer.lrr: unknown key (did you mean 'lr'?)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # no run dir, no redis data


@pytest.mark.parametrize(
    "args, words",
    [
        (["--set", "trainer.lr=-1"], "trainer.lr: Input should be greater than 0"),
        (["--set", "trainer.lr"], "--set 'trainer.lr': expected KEY=VALUE"),
        (
            ["--set", "loop.mode=async", "--set", "algorithm.use_rollout_logprobs=false"],
            "no off-policy correction is on",
        ),
    ],
)
def test_bad_overrides_exit_2(tmp_path, args, words):
    (tmp_path / "ok.yaml").write_text("model: {path: m}\ndata: {train_path: d.jsonl}\n")
    for cmd in ("run", "trainer"):
        result = tandem(cmd, "ok.yaml", *args, cwd=tmp_path)
        assert result.returncode == 2 and words in result.stderr and result.stderr.startswith("tandem: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.yaml"]


def test_missing_config_file_exits_2(tmp_path):
    result = tandem("coordinator", "nope.yaml", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr == "tandem: config file nope.yaml does not exist\n"


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_a_tracker_whose_package_is_missing_exits_2_before_starting_anything(tmp_path):
    (tmp_path / "ok.yaml").write_text("model: {path: m}\ndata: {train_path: d.jsonl}\n")
    for cmd in ("run", "coordinator"):
        result = tandem(cmd, "ok.yaml", "--set", "tracing.trackers=[jsonl, tensorboard]", cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert result.stderr == (
            "tandem: tracing.trackers: tensorboard needs the `tensorboard` package, which is "
            "not installed (pip install tensorboard), or drop tensorboard from tracing.trackers\n"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.yaml"]


def test_plot_of_a_directory_without_metrics_says_so(tmp_path):
    for run_dir, words in ((tmp_path / "absent", "metrics.jsonl does not exist"), (tmp_path, "holds no metrics yet")):
        if run_dir == tmp_path:
            (tmp_path / "metrics.jsonl").write_text("")
        result = tandem("plot", str(run_dir))
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.startswith("tandem plot: ") and words in result.stderr


def test_a_gated_coordinator_waits_for_go_and_leaves_quietly_when_the_gate_closes(tmp_path):
    """`tandem run` starts the coordinator beside the other services behind a start gate. Without "go" (the
    supervisor gave up on the start) it ends at once: no log, no failure record, no port bound."""
    config = tmp_path / "c.yaml"
    config.write_text("model: {path: m}\ndata: {train_path: t.jsonl}\nservices: {coordinator: {port: 1}}\n")
    proc = subprocess.Popen(
        [*tandem_cmd(), "coordinator", str(config), "--run-dir", str(tmp_path / "run"), "--start-gate"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=3)  # held at the gate, not failing on its missing data or the privileged port
    out, err = proc.communicate("stop\n", timeout=60)
    assert proc.returncode == 130 and out == "" and err == ""
    assert not (tmp_path / "run" / "logs").exists()

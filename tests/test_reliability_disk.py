"""A full disk during a checkpoint Save, on a real small filesystem: a tmpfs mounted in a user and mount
namespace of the trainer's own (`unshare --user --map-root-user --mount`, no root needed), the trainer a real
process saving through DeepSpeed. The test reaches the tmpfs through /proc/<trainer pid>/root."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from stopping import stop_under_load
from tandem_runs import EXAMPLE, REPO

from services.contracts.config_loading import load_config, write_resolved_config
from services.contracts.gen.tandem.v1 import trainer_pb2
from services.coordinator.clients import make_clients
from services.launcher.supervisor import resolve_for_local_run

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(300)]

_MOUNT = 'mount -t tmpfs -o size=16m tandem-test-ckpt "$0" && exec "$@"'


def _namespaces_work() -> bool:
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _namespaces_work(), reason="needs unshare with user namespaces (to mount a small tmpfs)")
def test_a_full_disk_during_save_names_the_path_and_keeps_the_last_good_checkpoint(tmp_path, redis_server):
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    ckpt.mkdir()
    run_dir.mkdir()
    config = load_config(EXAMPLE, [f"trainer.checkpoint_dir={ckpt}", "trainer.export_hf_on_save=true"])
    config = resolve_for_local_run(config, redis_url=redis_server.url)
    write_resolved_config(config, run_dir)
    trainer_cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "trainer",
        str(run_dir / "config.yaml"),
        "--run-dir",
        str(run_dir),
        "--role",
        "actor",
    ]
    with open(tmp_path / "trainer.log", "ab") as log:
        proc = subprocess.Popen(
            ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", _MOUNT, str(ckpt), *trainer_cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    trainer, _, rollouts = make_clients(config)
    try:
        trainer.wait_healthy(180)
        seen = Path(f"/proc/{proc.pid}/root{ckpt}")  # the trainer's view: the tmpfs
        good = trainer.stub.Save(trainer_pb2.SaveRequest(rollout_id=0), timeout=120)
        assert (seen / "actor" / "rollout_00000000" / "COMPLETE.json").is_file()
        filler = _fill(seen, leave_bytes=256 << 10)

        with pytest.raises(grpc.RpcError) as info:
            trainer.stub.Save(trainer_pb2.SaveRequest(rollout_id=1), timeout=120)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        details = info.value.details()
        assert f"no space left on {ckpt / 'actor'}: checkpoint rollout_00000001 was not written" in details
        assert f"the last good checkpoint {good.path} is kept" in details
        assert "inline_container" not in details
        found = re.search(r"\((\d+) bytes free after removing its partial files\)", details)
        assert found is not None, details
        freed = int(found.group(1))
        assert freed >= 256 << 10  # the partial checkpoint's space was given back at once
        assert sorted(p.name for p in (seen / "actor").iterdir()) == ["rollout_00000000"]  # partial files gone

        loaded = trainer.stub.Load(trainer_pb2.LoadRequest(), timeout=120)  # the good one still loads
        assert loaded.loaded and loaded.path == good.path and loaded.rollout_id == 0
        filler.unlink()  # space again: the same Save now succeeds
        again = trainer.stub.Save(trainer_pb2.SaveRequest(rollout_id=1), timeout=120)
        assert (seen / "actor" / "rollout_00000001" / "COMPLETE.json").is_file() and again.hf_path
    finally:
        trainer.close()
        for client in rollouts:
            client.close()
        # after a failed save, a busy machine, and the SIGTERM taken by another thread: still within the budget
        stop_under_load(proc, budget_s=config.services.timeouts.shutdown_s)
        log.close()
    assert proc.returncode == 0 and "trainer stopping (SIGTERM)" in (tmp_path / "trainer.log").read_text()


def _fill(directory: Path, *, leave_bytes: int) -> Path:
    """A file that takes all but `leave_bytes` of the filesystem's free space."""
    stat = os.statvfs(directory)
    filler = directory / "filler"
    with open(filler, "wb") as f:
        f.write(bytes(max(0, stat.f_bavail * stat.f_frsize - leave_bytes)))
    return filler


@pytest.mark.slow
@pytest.mark.skipif(not _namespaces_work(), reason="needs unshare with user namespaces (to mount a small tmpfs)")
def test_a_full_disk_during_a_save_in_tandem_run_ends_in_one_block_keeping_the_last_good_checkpoint(tmp_path):
    """The whole `tandem run` in a namespace of its own with the 16 MiB tmpfs as trainer.checkpoint_dir. Saves come
    only from the sentinel: one good checkpoint, then the tmpfs is filled, then the next save hits the full disk."""
    ckpt, run_dir, sentinel = tmp_path / "ckpt", tmp_path / "run", tmp_path / "save-now"
    ckpt.mkdir()
    run_dir.mkdir()
    args = [sys.executable, "-m", "services.cli", "run", str(EXAMPLE), "--run-dir", str(run_dir), "--no-progress"]
    for item in (
        f"trainer.checkpoint_dir={ckpt}",
        f"loop.save_trigger_sentinel={sentinel}",
        "loop.num_rollout=1000",
        "loop.eval_interval=null",
        "trainer.export_hf_on_save=false",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=2",
    ):
        args += ["--set", item]
    printed = tmp_path / "printed.txt"
    with open(printed, "wb") as out:
        proc = subprocess.Popen(
            ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", _MOUNT, str(ckpt), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
    try:
        seen = Path(f"/proc/{proc.pid}/root{ckpt}") / "actor"  # the run's view: the tmpfs
        _wait(lambda: (run_dir / "metrics.jsonl").is_file(), proc, "a first step")
        sentinel.touch()
        _wait(lambda: any(seen.glob("rollout_*/COMPLETE.json")), proc, "the first checkpoint")
        [good] = [p.name for p in seen.iterdir()]
        _fill(seen, leave_bytes=256 << 10)
        sentinel.touch()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    text = printed.read_text(errors="replace")
    assert code == 3, text
    ending = text.rstrip("\n").splitlines()[-6:]
    assert ending[0] == "tandem run failed: trainer answered Save with RESOURCE_EXHAUSTED", text
    assert re.fullmatch(
        rf"  what went wrong: no space left on {ckpt / 'actor'}: checkpoint rollout_\d+ was not "
        rf"written \(\d+ bytes free after removing its partial files\); the last good checkpoint "
        rf"{ckpt / 'actor' / good} is kept",
        ending[1],
    ), ending[1]
    assert ending[2:] == [
        f"  kept:            {ckpt / 'actor' / good}",
        f"  what to do:      free space on {ckpt / 'actor'} (or point trainer.checkpoint_dir at a larger disk; "
        f"trainer.keep_last_checkpoints bounds how many are kept); then run the same command again: it resumes from "
        f"{ckpt / 'actor' / good}",
        f"  full traceback:  {run_dir / 'logs' / 'trainer.log'}",
        "  exit code 3: a restart would only repeat it, so nothing was restarted",
    ]
    assert "Traceback (most recent call last)" not in text
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "Traceback (most recent call last)" in trainer_log and "NoSpaceLeft: no space left on" in trainer_log


def _wait(done: Callable[[], bool], proc: subprocess.Popen, what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert proc.poll() is None, f"tandem run exited with {proc.returncode} before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.1)

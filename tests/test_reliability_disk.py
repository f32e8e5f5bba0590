"""A full disk during a checkpoint Save, on a real small filesystem: a tmpfs mounted in a user and mount
namespace of the trainer's own (`unshare --user --map-root-user --mount`, no root needed), the trainer a real
process saving through DeepSpeed. The test reaches the tmpfs through /proc/<trainer pid>/root."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from tandem_runs import EXAMPLE, REPO

from services.contracts.config import load_config, write_resolved_config
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
    log = open(tmp_path / "trainer.log", "ab")
    trainer_cmd = [sys.executable, "-m", "services.cli", "trainer", str(run_dir / "config.yaml"), "--run-dir",
                   str(run_dir), "--role", "actor"]
    proc = subprocess.Popen(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", _MOUNT, str(ckpt),
                             *trainer_cmd], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    trainer, _, rollouts = make_clients(config)
    try:
        trainer.wait_healthy(180)
        seen = Path(f"/proc/{proc.pid}/root{ckpt}")   # the trainer's view: the tmpfs
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
        freed = int(re.search(r"\((\d+) bytes free after removing its partial files\)", details).group(1))
        assert freed >= 256 << 10   # the partial checkpoint's space was given back at once
        assert sorted(p.name for p in (seen / "actor").iterdir()) == ["rollout_00000000"]   # partial files gone

        loaded = trainer.stub.Load(trainer_pb2.LoadRequest(), timeout=120)   # the good one still loads
        assert loaded.loaded and loaded.path == good.path and loaded.rollout_id == 0
        filler.unlink()                                   # space again: the same Save now succeeds
        again = trainer.stub.Save(trainer_pb2.SaveRequest(rollout_id=1), timeout=120)
        assert (seen / "actor" / "rollout_00000001" / "COMPLETE.json").is_file() and again.hf_path
    finally:
        trainer.close()
        for client in rollouts:
            client.close()
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def _fill(directory: Path, *, leave_bytes: int) -> Path:
    """A file that takes all but `leave_bytes` of the filesystem's free space."""
    stat = os.statvfs(directory)
    filler = directory / "filler"
    with open(filler, "wb") as f:
        f.write(bytes(max(0, stat.f_bavail * stat.f_frsize - leave_bytes)))
    return filler

"""2 ranks under torchrun give the 1-rank result (ZeRO 0 (the flat AdamW), 1 and 2; ZeRO-3 over gRPC in
test_trainer_grpc.py).

One launch of tests/trainer_ranks.py trains both stages; rank 0 drives TrainerService in-process and the
other rank executes the relayed commands, the same path the gRPC server uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest_trainer import TrainerHarness, peaked_model_dir, tiny_model_dir  # noqa: F401
from trainer_ranks import DISTILL_KEYS, KEYS, batches, stage_config, train_stage

from services.rpc.ports import free_port

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[1]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_two_ranks_match_one_rank_under_zero_0_1_and_2(tiny_model_dir, tmp_path, redis_server):  # noqa: F811
    compare_ranks(tiny_model_dir, tmp_path, redis_server.url, stages=(0, 1, 2))


def test_two_ranks_match_one_rank_with_a_distillation_teacher(
    tiny_model_dir,  # noqa: F811
    peaked_model_dir,  # noqa: F811
    tmp_path,
    redis_server,
):
    """Each rank scores the teacher and the student on its own tokens; the sums over ranks are the advantages."""
    compare_ranks(tiny_model_dir, tmp_path, redis_server.url, stages=(0,), teacher=peaked_model_dir)


def compare_ranks(
    model_dir: Path, tmp_path: Path, redis_url: str, *, stages: tuple[int, ...], teacher: Path | None = None
) -> None:
    torch.set_num_threads(1)
    keys = KEYS if teacher is None else DISTILL_KEYS
    expected = {}
    for stage in stages:
        h = TrainerHarness(
            stage_config(model_dir, tmp_path / "one", redis_url, stage, "one", teacher), run_dir=tmp_path / "one"
        )
        try:
            expected[stage] = train_stage(h, batches(model_dir, 2), keys)
        finally:
            h.close()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(REPO / "tests" / "trainer_ranks.py"),
            str(model_dir),
            str(tmp_path / "two"),
            redis_url,
            "--prefix",
            "two",
            "--stages",
            *map(str, stages),
            *([] if teacher is None else ["--teacher", str(teacher)]),
        ],
        cwd=REPO,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    got = {int(k): v for k, v in json.loads(line.removeprefix("RESULT ")).items()}
    for stage in stages:
        for step, (a, b) in enumerate(zip(got[stage]["steps"], expected[stage]["steps"], strict=True)):
            for key in keys:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (stage, step, key)
        for name, values in expected[stage]["weights"].items():
            torch.testing.assert_close(
                torch.tensor(got[stage]["weights"][name]), torch.tensor(values), rtol=1e-3, atol=1e-4
            )

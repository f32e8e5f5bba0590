"""`tandem run` refuses, before anything starts and one line each, what the sglang engine cannot honour."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from services.contracts.config import ConfigError
from services.contracts.config_loading import load_config
from services.launcher.preflight import check_engine

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "digit_max_sglang_gpu.yaml"


def test_the_sglang_example_passes_and_each_refusal_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    check_engine(load_config(EXAMPLE))
    cases = {
        "weights.check_weight_update_equal=true": "weights.check_weight_update_equal: not supported with rollout.engine"
        " sglang",
        "rollout.sglang.urls=[http://10.0.0.7:30000]": "weights.transport: cuda_ipc needs SGLang on the trainer's host",
        "trainer.device=cpu": "weights.transport: cuda_ipc needs the trainer on a GPU",
        "rollout.sglang.launch_args=[--rl-on-policy-target,fsdp]": "--rl-on-policy-target is refused: it makes SGLang "
        "report bf16 log-probs",
        "rollout.sglang.launch_args=[--enable-deterministic-inference]": "--enable-deterministic-inference is refused",
        "rollout.sglang.launch_args=[--enable-custom-logit-processor]": "--enable-custom-logit-processor is refused",
    }
    for override, line in cases.items():
        with pytest.raises(ConfigError) as info:
            check_engine(load_config(EXAMPLE, [override]))
        assert str(info.value).count("\n") == 0 and line in str(info.value), override
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(ConfigError, match="SGLANG_RETURN_ORIGINAL_LOGPROB=1 in the environment is refused"):
        check_engine(load_config(EXAMPLE))
    with pytest.raises(ConfigError) as info:  # several problems: one line each
        check_engine(load_config(EXAMPLE, ["weights.check_weight_update_equal=true", "trainer.device=cpu"]))
    assert len(str(info.value).splitlines()) == 3
    native = yaml.safe_load(EXAMPLE.read_text())
    native["rollout"] = {**{k: v for k, v in native["rollout"].items() if k != "sglang"}, "engine": "native"}
    (tmp_path / "native.yaml").write_text(yaml.safe_dump(native))  # rollout.sglang is not a key of engine native
    check_engine(load_config(tmp_path / "native.yaml", ["weights.check_weight_update_equal=true"]))


def test_in_flight_updates_with_sglang_need_what_its_pause_modes_can_do():
    """keep (pause in_place) works with any SGLang 0.5.x; recompute (retract) only without the radix cache; and
    keep_old_actor cannot tell in-flight tokens (SGLang reports no per-token version)."""
    inflight = ["loop.mode=async"]
    check_engine(load_config(EXAMPLE, [*inflight, "rollout.inflight_update=keep"]))
    with pytest.raises(ConfigError) as info:
        check_engine(load_config(EXAMPLE, [*inflight, "rollout.inflight_update=recompute"]))
    assert str(info.value).count("\n") == 0
    assert str(info.value).startswith("rollout.inflight_update: recompute needs SGLang without its radix cache")
    check_engine(
        load_config(
            EXAMPLE,
            [*inflight, "rollout.inflight_update=recompute", "rollout.sglang.launch_args=[--disable-radix-cache]"],
        )
    )
    with pytest.raises(ConfigError, match=r"algorithm\.keep_old_actor scores each token under the snapshot"):
        load_config(
            EXAMPLE,
            [
                *inflight,
                "rollout.inflight_update=keep",
                "algorithm.use_rollout_logprobs=false",
                "algorithm.keep_old_actor=true",
            ],
        )


def test_tandem_run_stops_in_seconds_not_after_sglang_started(tmp_path: Path):
    start = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "run",
            str(EXAMPLE),
            "--run-dir",
            str(tmp_path / "r"),
            "--set",
            "weights.check_weight_update_equal=true",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "weights.check_weight_update_equal: not supported with rollout.engine sglang" in out.stderr
    assert time.monotonic() - start < 60 and not (tmp_path / "r" / "logs").exists()

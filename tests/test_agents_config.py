"""The config keys of agents (services/contracts/agents_config.py): each wrong combination refused naming its keys,
and plug-in paths relative to the YAML like every other plug-in's."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.contracts.config import ConfigError
from services.contracts.config_loading import config_from_dict, load_config

BASE = {"run_name": "x", "model": {"path": "m"}, "data": {"train_path": "a.jsonl"}}


@pytest.mark.parametrize(
    ("rollout", "loop", "message"),
    [
        (
            {"agent": "a:b"},
            {},
            "rollout.agent: a:b talks to the rollout service through its OpenAI-compatible endpoint",
        ),
        (
            {"agent": "a:b", "environment": "c:D", "openai_api": {"enabled": True}},
            {},
            r"rollout.agent \(a:b\) and rollout.environment \(c:D\) both say how an episode is played",
        ),
        (
            {"agent": "external", "agent_timeout_s": 700, "openai_api": {"enabled": True}},
            {},
            r"rollout.agent_timeout_s \(700\) must be below loop.step_timeout_s \(600\)",
        ),
        ({"openai_api": {"enabled": True, "port": 70000}}, {}, "rollout.openai_api.port"),
    ],
)
def test_a_wrong_agent_configuration_is_refused_naming_its_keys(rollout, loop, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({**BASE, "rollout": rollout, "loop": loop})


def test_the_endpoint_is_off_by_default_and_plug_in_files_are_relative_to_the_yaml():
    assert not config_from_dict(BASE).rollout.openai_api.enabled
    config = load_config(Path(__file__).resolve().parents[1] / "examples/agent_tools.yaml")
    examples = Path(__file__).resolve().parents[1] / "examples"
    assert config.rollout.agent == f"{examples / 'agent_tools/agent.py'}:solve"
    assert config.rollout.openai_api.tool_parser == f"{examples / 'agent_tools/tool_call.py'}:parse"


def test_ctl_finds_the_endpoint_a_replica_wrote_to_its_run_directory(tmp_path: Path):
    from services.rollout.agents.episodes_client import find_endpoint, write_endpoint_file

    write_endpoint_file(tmp_path, 1, "http://127.0.0.1:5555")
    assert find_endpoint(endpoint=None, run_dir=tmp_path, replica=1) == "http://127.0.0.1:5555"
    assert find_endpoint(endpoint="http://127.0.0.1:7/", run_dir=None) == "http://127.0.0.1:7"
    with pytest.raises(ConfigError, match=r"no endpoint file .*rollout-0\.json .*is rollout\.openai_api\.enabled set"):
        find_endpoint(endpoint=None, run_dir=tmp_path, replica=0)

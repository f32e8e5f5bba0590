"""Run configuration: YAML files, --set overrides, the resolved config of a run dir, and clear errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from services.contracts.config import ConfigError, TandemConfig
from services.contracts.config_loading import (
    apply_overrides,
    config_from_dict,
    dump_config,
    load_config,
    parse_override,
    write_resolved_config,
)

FULL_YAML = """\
run_name: copy-task
model:
  path: models/tiny
  dtype: float32
data:
  train_path: data/train.jsonl
  eval_path: data/eval.jsonl
  num_epochs: 2
rollout:
  rollout_batch_size: 16
  n_samples_per_prompt: 4
  sampling: {temperature: 0.8, top_p: 0.95, max_new_tokens: 8, stop_token_ids: [2]}
trainer:
  lr: 3.0e-4
  zero_stage: 2
  betas: [0.9, 0.95]
algorithm:
  advantage_estimator: grpo
  eps_clip: 0.2
  use_rollout_logprobs: false
  use_tis: true
loop:
  mode: async
  num_rollout: 20
  save_interval: 5
weights:
  transport: gloo
  bucket_mb: 16
redis:
  max_buffered_batches: 2
tracing:
  exporter: file
services:
  rollout:
    - {port: 0}
    - {host: 127.0.0.1, port: 50071}
"""


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def minimal(**sections) -> dict:
    data = {"model": {"path": "/m"}, "data": {"train_path": "/d.jsonl"}}
    data.update(sections)
    return data


def error_of(fn, *args, **kw) -> str:
    with pytest.raises(ConfigError) as err:
        fn(*args, **kw)
    return str(err.value)


def problem_lines(message: str) -> list[str]:
    return [line.strip() for line in message.splitlines()[1:] if line.strip()]


# ---- valid files ------------------------------------------------------------------------------------------


def test_yaml_file_loads_with_paths_relative_to_the_file(tmp_path):
    cfg = load_config(write(tmp_path, FULL_YAML))
    assert cfg.run_name == "copy-task"
    assert cfg.model.path == str(tmp_path / "models" / "tiny")
    assert cfg.data.train_path == str(tmp_path / "data" / "train.jsonl")
    assert cfg.rollout.sampling.stop_token_ids == (2,) and cfg.rollout.sampling.temperature == 0.8
    assert cfg.trainer.lr == 3e-4 and cfg.trainer.betas == (0.9, 0.95) and cfg.trainer.zero_stage == 2
    assert [a.target for a in cfg.services.rollout] == ["127.0.0.1:0", "127.0.0.1:50071"]
    assert cfg.algorithm.uses_critic is False
    assert cfg.redis.max_buffered_batches == 2
    assert cfg.trainer.precision == "fp32"  # untouched keys keep their defaults


def test_resolved_config_written_to_a_run_dir_reloads_identically(tmp_path):
    cfg = load_config(write(tmp_path, FULL_YAML), ["trainer.lr=1e-3", "loop.offload_train=true"])
    out = write_resolved_config(cfg, tmp_path / "runs" / "r1")
    assert out == tmp_path / "runs" / "r1" / "config.yaml"
    again = load_config(out)
    assert again == cfg
    assert dump_config(again) == out.read_text()
    # The resolved file is complete: every section is spelled out.
    text = out.read_text()
    assert all(f"\n{section}:" in text for section in TandemConfig.model_fields if section != "run_name")


def test_minimal_config_and_empty_sections(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            """\
        model: {path: /m}
        data: {train_path: /d.jsonl}
        rollout:
        trainer:
        """,
        )
    )
    assert cfg.rollout == TandemConfig.model_fields["rollout"].default
    assert cfg.loop.mode == "async" and cfg.algorithm.use_rollout_logprobs is True


def test_config_is_frozen():
    cfg = config_from_dict(minimal())
    with pytest.raises(Exception):  # noqa: B017 - pydantic's ValidationError for frozen instances
        cfg.trainer.lr = 1.0  # type: ignore[misc]
    assert cfg.with_model_path("/other").model.path == "/other" and cfg.model.path == "/m"


# ---- --set overrides ---------------------------------------------------------------------------------------


def test_overrides_parse_numbers_booleans_lists_and_nested_sections(tmp_path):
    cfg = load_config(
        write(tmp_path, FULL_YAML),
        [
            "trainer.lr=3e-4",  # YAML 1.1 reads this as a string; pydantic parses it
            "trainer.warmup_steps=10",
            "loop.offload_train=true",
            "rollout.sampling.stop_token_ids=[1, 2, 3]",
            "trainer.betas=[0.8, 0.9]",
            "services.rollout=[{port: 6000}, {port: 6001}, {host: 10.0.0.2, port: 6002}]",
            "tracing.trackers=[jsonl, tensorboard]",
            "weights.check_weight_update_equal=yes",
            "trainer.total_steps=null",
            "run_name=2024",  # a string field: kept as the string
            "data.prompt_key=question=text",  # only the first '=' splits
            "redis.max_buffered_batches=3",
            "redis.max_buffered_batches=5",  # the last one wins
        ],
    )
    assert cfg.trainer.lr == pytest.approx(3e-4) and cfg.trainer.warmup_steps == 10
    assert cfg.loop.offload_train is True and cfg.weights.check_weight_update_equal is True
    assert cfg.rollout.sampling.stop_token_ids == (1, 2, 3) and cfg.trainer.betas == (0.8, 0.9)
    assert [a.target for a in cfg.services.rollout] == ["127.0.0.1:6000", "127.0.0.1:6001", "10.0.0.2:6002"]
    assert cfg.tracing.tracker_names() == ("jsonl", "tensorboard")
    assert cfg.trainer.total_steps is None and cfg.run_name == "2024"
    assert cfg.data.prompt_key == "question=text" and cfg.redis.max_buffered_batches == 5
    assert cfg.rollout.sampling.temperature == 0.8  # siblings of an overridden key are kept


def test_override_creates_missing_sections():
    data = apply_overrides(
        {"model": {"path": "/m"}, "data": {"train_path": "/d"}, "rollout": None},
        ["algorithm.advantage_estimator=gae", "rollout.sampling.top_k=5"],
    )
    cfg = config_from_dict(data)
    assert cfg.algorithm.uses_critic is True and cfg.rollout.sampling.top_k == 5
    assert parse_override("a.b.c=[1, {x: 2}]") == (["a", "b", "c"], [1, {"x": 2}])
    assert parse_override("a=") == (["a"], "")


# ---- mistakes: one clear message naming the key -------------------------------------------------------------------


@pytest.mark.parametrize(
    "sections, key, words",
    [
        ({"trainer": {"lrr": 1e-3}}, "trainer.lrr", "unknown key (did you mean 'lr'?)"),
        ({"trainr": {"lr": 1e-3}}, "trainr", "unknown key (did you mean 'trainer'?)"),
        ({"rollout": {"sampling": {"temprature": 1.0}}}, "rollout.sampling.temprature", "did you mean 'temperature'?"),
        ({"services": {"rollout": [{"prot": 1}]}}, "services.rollout.0.prot", "did you mean 'port'?"),
        ({"redis": {"zzz": 1}}, "redis.zzz", "unknown key (known keys: "),
        ({"trainer": {"num_ranks": "two"}}, "trainer.num_ranks", "valid integer"),
        ({"loop": {"offload_train": "sometimes"}}, "loop.offload_train", "valid boolean"),
        ({"rollout": {"sampling": {"stop_token_ids": 5}}}, "rollout.sampling.stop_token_ids", "valid tuple"),
        ({"rollout": {"sampling": {"stop": ["####", ""]}}}, "rollout.sampling.stop", "[1] is empty: an empty stop"),
        ({"rollout": {"eval_sampling": {"stop": ["a", "a"]}}}, "rollout.eval_sampling.stop", "names a string twice"),
        ({"rollout": {"sampling": {"stop": [str(i) for i in range(17)]}}}, "rollout.sampling.stop", "at most 16"),
        ({"rollout": {"sampling": {"stop": "####"}}}, "rollout.sampling.stop", "valid tuple"),
        ({"model": {"path": "/m", "init_body": "tiny"}}, "model", "init_body applies to a real model's init_preset"),
        ({"loop": {"mode": "asynch"}}, "loop.mode", "'async', 'sync', 'fully_async' or 'streaming' (got 'asynch')"),
        ({"trainer": "fast"}, "trainer", "valid dictionary"),
        ({"trainer": {"lr": 0}}, "trainer.lr", "greater than 0 (got 0)"),
        ({"rollout": {"sampling": {"top_p": 1.5}}}, "rollout.sampling.top_p", "less than or equal to 1"),
        ({"services": {"coordinator": {"port": 70000}}}, "services.coordinator.port", "less than or equal to 65535"),
        ({"redis": {"chunk_mb": 1024}}, "redis.chunk_mb", "less than or equal to 256"),
        ({"trainer": {"zero_stage": 4}}, "trainer.zero_stage", "Input should be 0, 1, 2 or 3"),
        ({"trainer": {"gradient_checkpointing": True}}, "trainer", "renamed activation_checkpointing"),
        ({"services": {"rollout": []}}, "services.rollout", "must list at least one rollout address"),
        ({"services": {"tls_cert": "/c.pem"}}, "services", "tls_cert and services.tls_key must be given together"),
        # a key of another variant than the chosen one is refused by name
        # (the variant key chooses: engine, transport, type)
        (
            {"rollout": {"engine": "sglang", "continuous_batching": True}},
            "rollout.continuous_batching",
            "a key of rollout.engine native, not sglang",
        ),
        ({"rollout": {"sglang": {"urls": []}}}, "rollout.sglang", "a key of rollout.engine sglang, not native"),
        ({"weights": {"disk_dir": "/w"}}, "weights.disk_dir", "a key of weights.transport disk, not gloo"),
        (
            {"weights": {"transport": "nccl", "disk_dir": "/w"}},
            "weights.disk_dir",
            "a key of weights.transport disk, not nccl",
        ),
        ({"weights": {"transport": "nccl", "bucket_mbb": 3}}, "weights.bucket_mbb", "did you mean 'bucket_mb'?"),
        (
            {"weights": {"transport": "rdma"}},
            "weights.transport",
            "Input should be 'gloo', 'nccl', 'cuda_ipc' or 'disk' (got 'rdma')",
        ),
        ({"rollout": {"engine": "vllm"}}, "rollout.engine", "Input should be 'native' or 'sglang' (got 'vllm')"),
        (
            {"tracing": {"trackers": ["jsonl", "wandbb"]}},
            "tracing.trackers.1.type",
            "Input should be 'jsonl', 'tensorboard', 'wandb' or 'prometheus' (got 'wandbb')",
        ),
        ({"tracing": {"trackers": [{"project": "p"}]}}, "tracing.trackers.0.type", "required key is missing"),
        (
            {"tracing": {"trackers": [{"type": "prometheus", "project": "p"}]}},
            "tracing.trackers.0.project",
            "a key of tracing.trackers.0.type wandb, not prometheus",
        ),
        (
            {"tracing": {"wandb_project": "p"}},
            "tracing",
            "wandb_project is now a key of its tracker: trackers: [jsonl, {type: wandb, project: NAME}]",
        ),
    ],
)
def test_each_mistake_gives_one_message_naming_the_key(sections, key, words):
    message = error_of(config_from_dict, minimal(**sections), "run.yaml")
    assert message.startswith("invalid configuration in run.yaml:")
    [line] = problem_lines(message)
    assert line.startswith(f"{key}: ")
    assert words in line


def test_missing_required_section_and_key():
    [line] = problem_lines(error_of(config_from_dict, {"data": {"train_path": "/d"}}))
    assert line == "model: required section is missing"
    [line] = problem_lines(error_of(config_from_dict, {"model": {"dtype": "float32"}, "data": {"train_path": "/d"}}))
    assert line == "model.path: required key is missing"


def test_several_mistakes_are_all_listed():
    lines = problem_lines(error_of(config_from_dict, minimal(trainer={"lr": -1, "zero_stage": 9})))
    assert sorted(line.split(":")[0] for line in lines) == ["trainer.lr", "trainer.zero_stage"]


@pytest.mark.parametrize("mode", ["async", "fully_async"])
def test_async_without_off_policy_correction_is_refused_with_the_fix(mode):
    [line] = problem_lines(
        error_of(config_from_dict, minimal(loop={"mode": mode}, algorithm={"use_rollout_logprobs": False}))
    )
    assert line.startswith(f"loop.mode: {mode} trains on samples of an older policy")
    for fix in (
        "algorithm.use_rollout_logprobs: true",
        "algorithm.use_tis: true",
        "algorithm.keep_old_actor: true",
        "loop.mode: sync",
    ):
        assert fix in line


def test_a_critic_is_no_off_policy_correction():
    """As miles: PPO in an asynchronous mode needs a correction too (the critic does not change the ratio)."""
    [line] = problem_lines(
        error_of(
            config_from_dict,
            minimal(loop={"mode": "async"}, algorithm={"use_rollout_logprobs": False, "advantage_estimator": "gae"}),
        )
    )
    assert "no off-policy correction is on (a critic is none)" in line
    ppo = config_from_dict(minimal(loop={"mode": "async"}, algorithm={"advantage_estimator": "gae"}))
    assert ppo.algorithm.uses_critic and ppo.algorithm.use_rollout_logprobs


@pytest.mark.parametrize(
    "algorithm, words",
    [
        ({"use_tis": True}, "rollout_correction.is: token (or use_tis: true) needs use_rollout_logprobs: false"),
        ({"keep_old_actor": True}, "keep_old_actor: true needs use_rollout_logprobs: false"),
        ({"tis_mode": "mask"}, "tis_mode: mask applies to TIS's weights: it needs use_tis: true"),
        ({"whiten_advantages": True}, "whiten_advantages applies to advantage_estimator: gae"),
        (
            {"advantage_estimator": "reinforce_pp", "whiten_advantages": True},
            "whiten_advantages applies to advantage_estimator: gae "
            "(advantage_estimator reinforce_pp normalises by itself",
        ),
        (
            {"advantage_estimator": "rloo", "normalize_advantage_std": False},
            "normalize_advantage_std: false (Dr.GRPO) applies to advantage_estimator: grpo",
        ),
        ({"advantage_estimator": "rloo", "gamma": 0.99}, "gamma applies to advantage_estimator: gae or reinforce_pp"),
        ({"advantage_estimator": "reinforce_pp", "lambd": 0.95}, "lambd is GAE's lambda"),
        ({"advantage_estimator": "rloo", "num_critic_only_steps": 2}, "num_critic_only_steps needs a critic"),
    ],
)
def test_contradicting_algorithm_choices_are_refused(algorithm, words):
    [line] = problem_lines(error_of(config_from_dict, minimal(algorithm=algorithm)))
    assert line.startswith(f"algorithm: {words}")


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_a_group_baseline_needs_two_samples_per_prompt(estimator):
    [line] = problem_lines(
        error_of(
            config_from_dict, minimal(rollout={"n_samples_per_prompt": 1}, algorithm={"advantage_estimator": estimator})
        )
    )
    assert line.startswith(
        f"rollout.n_samples_per_prompt: 1 gives every sample advantage 0 with "
        f"algorithm.advantage_estimator: {estimator}"
    )
    solo = config_from_dict(
        minimal(rollout={"n_samples_per_prompt": 1}, algorithm={"advantage_estimator": "reinforce_pp", "gamma": 0.99})
    )
    assert solo.algorithm.gamma == 0.99 and solo.algorithm.policy_loss == "ppo"


@pytest.mark.parametrize(
    "safe",
    [
        {"use_tis": True},
        {"keep_old_actor": True},
        {"keep_old_actor": True, "use_tis": True, "advantage_estimator": "gae", "whiten_advantages": True},
    ],
)
def test_async_with_a_correction_or_sync_mode_is_accepted(safe):
    cfg = config_from_dict(minimal(loop={"mode": "async"}, algorithm={"use_rollout_logprobs": False, **safe}))
    assert cfg.loop.mode == "async"
    sync = config_from_dict(minimal(loop={"mode": "sync"}, algorithm={"use_rollout_logprobs": False}))
    assert sync.loop.mode == "sync"


@pytest.mark.parametrize(
    "item, words",
    [
        ("trainer.lr", "--set 'trainer.lr': expected KEY=VALUE"),
        ("=3", "--set '=3': expected KEY=VALUE"),
        ("trainer..lr=1", "'trainer..lr' is not a dotted key"),
        ("trainer. lr=1", "'trainer. lr' is not a dotted key"),
        ("trainer.lr=[1", "--set trainer.lr: value '[1' is not valid YAML"),
        ("trainer.lr.x=1", "--set trainer.lr.x: trainer.lr is not a section"),
    ],
)
def test_bad_set_syntax_is_refused(tmp_path, item, words):
    message = error_of(load_config, write(tmp_path, FULL_YAML), [item])
    assert words in message and len(message.splitlines()) == 1


def test_set_with_a_bad_value_names_the_key(tmp_path):
    [line] = problem_lines(error_of(load_config, write(tmp_path, FULL_YAML), ["trainer.zero_stage=5"]))
    assert line.startswith("trainer.zero_stage: ")


def test_invalid_yaml_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "model:\n  path: /m\n data: [\n")
    message = error_of(load_config, path)
    assert message.startswith(f"config file {path} is not valid YAML") and "line 3" in message


@pytest.mark.parametrize("text", ["- model\n- data\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    message = error_of(load_config, write(tmp_path, text))
    assert "the top level must be a mapping of sections" in message and str(tmp_path) in message
    assert "top level must be a mapping" in error_of(config_from_dict, ["model"])


def test_missing_file(tmp_path):
    assert error_of(load_config, tmp_path / "nope.yaml") == f"config file {tmp_path / 'nope.yaml'} does not exist"


def test_empty_file_reports_the_missing_sections(tmp_path):
    lines = problem_lines(error_of(load_config, write(tmp_path, "")))
    assert lines == ["model: required section is missing", "data: required section is missing"]


@pytest.mark.parametrize("mode", ["async", "fully_async"])
def test_offload_rollout_outside_sync_mode_is_refused(mode):
    [line] = problem_lines(error_of(config_from_dict, minimal(loop={"mode": mode, "offload_rollout": True})))
    assert line.startswith(f"loop.offload_rollout needs loop.mode: sync (in {mode} mode")
    assert config_from_dict(minimal(loop={"mode": "sync", "offload_rollout": True})).loop.offload_rollout


@pytest.mark.parametrize("inflight", ["keep", "recompute"])
def test_inflight_update_needs_generation_that_overlaps_the_sync(inflight):
    [line] = problem_lines(
        error_of(config_from_dict, minimal(loop={"mode": "sync"}, rollout={"inflight_update": inflight}))
    )
    assert line.startswith(f"rollout.inflight_update: {inflight} needs loop.mode async or fully_async")
    assert (
        config_from_dict(
            minimal(loop={"mode": "fully_async"}, rollout={"inflight_update": inflight})
        ).rollout.inflight_update
        == inflight
    )


@pytest.mark.parametrize(
    "sections, words",
    [
        (
            {"loop": {"mode": "streaming"}},
            "loop.mode: streaming writes one buffer entry per group: redis.max_buffered_batches (4) must be at least "
            "loop.groups_in_flight (64, 2 × rollout.rollout_batch_size)",
        ),
        (
            {"loop": {"mode": "streaming", "groups_in_flight": 8}, "redis": {"max_buffered_batches": 64}},
            "loop.groups_in_flight (8) must be at least rollout.rollout_batch_size (32)",
        ),
        (
            {"loop": {"mode": "async", "groups_in_flight": 64}},
            "loop.groups_in_flight applies to loop.mode: streaming, not async",
        ),
        (
            {
                "loop": {"mode": "streaming", "groups_in_flight": 32},
                "redis": {"max_buffered_batches": 32},
                "rollout": {"dynamic_sampling": {"enabled": True}},
            },
            "rollout.dynamic_sampling.enabled needs loop.mode async or sync (in streaming several generations",
        ),
    ],
)
def test_streaming_keys_that_cannot_work_are_refused(sections, words):
    [line] = problem_lines(error_of(config_from_dict, minimal(**sections)))
    assert words in line


def test_a_streaming_config_with_room_for_its_groups_loads():
    config = config_from_dict(
        minimal(
            loop={"mode": "streaming"},
            redis={"max_buffered_batches": 64},
            rollout={"continuous_batching": True, "inflight_update": "keep"},
        )
    )
    assert config.rollout.engine == "native"
    assert (config.loop.mode, config.rollout.continuous_batching) == ("streaming", True)


def test_scoring_chunk_tokens_is_auto_by_default_or_a_number_of_tokens_and_says_so_when_neither():
    assert config_from_dict(minimal()).trainer.scoring_chunk_tokens == "auto"
    assert config_from_dict(minimal(trainer={"scoring_chunk_tokens": 512})).trainer.scoring_chunk_tokens == 512
    for bad in ("big", 0, True):
        message = error_of(config_from_dict, minimal(trainer={"scoring_chunk_tokens": bad}))
        assert problem_lines(message) == [
            f"trainer.scoring_chunk_tokens: expected auto or a number of tokens >= 1, got {bad!r}"
        ]

"""The run facts every service shares: one definition each (services/contracts/runfacts.py, checkpoints.py)."""

from __future__ import annotations

from services.contracts import checkpoints, runfacts
from services.contracts.config_loading import config_from_dict


def _config(**loop):
    return config_from_dict(
        {
            "model": {"path": "m"},
            "data": {"train_path": "t.jsonl", "num_epochs": 3},
            "rollout": {"rollout_batch_size": 4},
            "loop": loop,
        }
    )


def test_num_rollout_is_the_configured_value():
    assert runfacts.num_rollout(_config(num_rollout=7), dataset_size=100) == 7


def test_num_rollout_defaults_to_whole_batches_per_epoch_times_epochs():
    assert runfacts.num_rollout(_config(), dataset_size=10) == 2 * 3  # 10 // 4 = 2 batches, tail of 2 dropped


def test_a_run_is_finished_once_its_last_rollout_was_trained():
    assert runfacts.is_finished(next_rollout_id=5, num_rollout=5)
    assert not runfacts.is_finished(next_rollout_id=4, num_rollout=5)


def test_latest_checkpoint_is_the_newest_complete_one_of_the_role(tmp_path):
    root = tmp_path / "checkpoints" / "actor"
    for rollout_id, complete in ((1, True), (2, True), (3, False)):
        d = checkpoints.checkpoint_dir(root, rollout_id)
        d.mkdir(parents=True)
        if complete:
            (d / checkpoints.COMPLETE).write_text("{}")
    assert checkpoints.latest_checkpoint(_config(), run_dir=tmp_path) == checkpoints.checkpoint_dir(root, 2)
    assert checkpoints.latest_checkpoint(_config(), run_dir=tmp_path, role="critic") is None

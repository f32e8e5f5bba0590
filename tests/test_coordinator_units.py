"""Coordinator pieces that need no services: data cursor, run state, checksum comparison, metric merging."""

import json

import pytest

from services.contracts.config import DataConfig
from services.coordinator.control import Control
from services.coordinator.data import DataCursor, DataSource, PromptRecord, load_prompts
from services.coordinator.pool import split_evenly
from services.coordinator.state import GeneratedBatch, RunState, StreamGroup
from services.coordinator.stepmetrics import prefixed, weighted_mean
from services.coordinator.sync import WeightSyncFailed, compare_checksums

DATA = DataConfig(train_path="unused")


def _records(n):
    return [PromptRecord(text=f"p{i}", label=str(i)) for i in range(n)]


def test_epochs_cover_every_prompt_once_and_shuffle_differs_per_epoch():
    source = DataSource(_records(10), batch_size=5, shuffle=True, seed=3, num_epochs=2)
    epochs: list[list[str]] = [[], []]
    ends = []
    for i in range(4):
        batch = source.next_batch()
        epochs[i // 2] += [p.text for p in batch.prompts]
        ends.append(batch.epoch_end)
    assert sorted(epochs[0]) == sorted(epochs[1]) == sorted(f"p{i}" for i in range(10))
    assert epochs[0] != epochs[1]
    assert ends == [False, True, False, True]


def test_cursor_resume_yields_the_same_prompts_and_group_ids():
    a = DataSource(_records(12), batch_size=4, shuffle=True, seed=7, num_epochs=3)
    for _ in range(4):
        a.next_batch()
    saved = DataCursor.from_dict(json.loads(json.dumps(a.cursor.to_dict())))
    expected = [a.next_batch() for _ in range(3)]
    b = DataSource(_records(12), batch_size=4, shuffle=True, seed=7, num_epochs=3)
    b.cursor = saved
    got = [b.next_batch() for _ in range(3)]
    assert [x.prompts for x in got] == [x.prompts for x in expected]
    assert [x.group_ids for x in got] == [x.group_ids for x in expected]
    assert got[0].group_ids == (16, 17, 18, 19)


def test_batch_larger_than_dataset_is_refused():
    with pytest.raises(ValueError, match="rollout_batch_size"):
        DataSource(_records(3), batch_size=4, shuffle=False, seed=0, num_epochs=1)


def test_load_prompts_reports_bad_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1 2 =", "label": "3", "level": 2}\n\nnot json\n')
    with pytest.raises(ValueError, match=r"d.jsonl:3: not valid JSON"):
        load_prompts(str(path), DATA)
    path.write_text('{"prompt": "1 2 =", "label": "3", "level": 2}\n')
    [rec] = load_prompts(str(path), DATA)
    assert rec == PromptRecord(text="1 2 =", label="3", metadata={"level": "2"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"), DATA)
    path.write_text('{"prompt": "1 2 =", "max_new_tokens": 12}\n{"prompt": "3 4 =", "max_new_tokens": "many"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: max_new_tokens must be a whole number >= 1, got 'many'"):
        load_prompts(str(path), DATA)


def test_a_streaming_group_is_found_again_by_its_place_in_the_data_order():
    source = DataSource(_records(12), batch_size=4, shuffle=True, seed=7, num_epochs=3)
    batches = [source.next_batch() for _ in range(5)]  # the fourth and fifth are of epoch 1
    last = batches[-1]
    first = last.cursor_after.offset - len(last.prompts)
    assert [source.record_at(last.cursor_after.epoch, first + k) for k in range(4)] == list(last.prompts)


def test_run_state_round_trips_through_json():
    state = RunState(
        next_rollout_id=5,
        weight_version=4,
        cursor=DataCursor(epoch=1, offset=8, consumed=40),
        pending=(
            GeneratedBatch(
                rollout_id=5,
                entry_ids=("1-0", "2-0"),
                cursor_before=DataCursor(1, 8, 40),
                cursor_after=DataCursor(1, 16, 48),
            ),
        ),
        samples_generated=320,
        samples_trained=300,
        samples_dropped_stale=20,
        history=("a", "b"),
        groups=(
            StreamGroup(group_id=40, epoch=1, offset=8, entry_id="3-0", weight_version=4),
            StreamGroup(group_id=41, epoch=1, offset=9),
        ),
    )
    assert RunState.from_json(state.to_json()) == state


def test_checksum_comparison_names_the_differing_tensors():
    compare_checksums({"a": "1", "b": "2"}, {"a": "1", "b": "2"}, replica="r0")
    with pytest.raises(WeightSyncFailed, match=r"r0: 1 tensors differ \(b\), 1 missing \(c\)"):
        compare_checksums({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "X"}, replica="r0")


def test_metric_helpers():
    assert prefixed("train", {"loss": 1, "perf/x": 2}) == {"train/loss": 1.0, "perf/x": 2.0}
    merged = weighted_mean([{"r": 1.0}, {"r": 0.0, "s": 2.0}], [3, 1])
    assert merged == {"r": 0.75, "s": 0.5}
    assert [len(r) for r in split_evenly(10, 3)] == [4, 3, 3]
    assert [len(r) for r in split_evenly(2, 3)] == [1, 1]


def test_run_state_of_a_checkpoint_written_before_samples_critic_only_still_loads():
    """Checkpoints of earlier runs carry the JSON as it was written then (no samples_critic_only, no weights_pushed)."""
    text = (
        '{"next_rollout_id": 7, "weight_version": 6, "cursor": {"epoch": 1, "offset": 4, "consumed": 28}, '
        '"pending": [{"rollout_id": 7, "entry_ids": ["1-0"], "cursor_before": {"epoch": 1, "offset": 4, '
        '"consumed": 28}, "cursor_after": {"epoch": 1, "offset": 8, "consumed": 32}}], "samples_generated": 56, '
        '"samples_trained": 50, "samples_dropped_stale": 6, "history": ["/c/rollout_00000006"]}'
    )
    state = RunState.from_json(text)
    assert (state.next_rollout_id, state.weight_version, state.samples_trained) == (7, 6, 50)
    assert state.samples_critic_only == 0 and state.weights_pushed
    assert state.pending[0].cursor_after == DataCursor(epoch=1, offset=8, consumed=32)
    assert RunState.from_json(state.to_json()) == state


def test_a_save_is_requested_by_ctl_or_by_the_sentinel_file_once_each(tmp_path):
    control, sentinel = Control(), tmp_path / "save.now"
    control.request_save()
    sentinel.touch()
    assert [control.take_save_request(sentinel=str(sentinel)) for _ in range(3)] == [True, True, False]
    assert not sentinel.exists()


@pytest.mark.parametrize(("mode", "workers"), [("async", 3), ("streaming", 4)])
def test_the_builder_wires_the_coordinators_parts_from_the_config(tmp_path, mode, workers):
    """build_coordinator: one client per configured service (gRPC channels connect lazily: nothing listens here), no
    buffer without redis.url, generation threads for one call per replica plus the trainer's (streaming: the groups
    in flight); the loop takes them as they are."""
    from services.contracts.config_loading import config_from_dict
    from services.coordinator.builder import build_coordinator
    from services.coordinator.loop import Coordinator

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} =", "label": str(i)}) + "\n" for i in range(8)))
    config = config_from_dict(
        {
            "run_name": "builder",
            "model": {"path": str(tmp_path)},
            "data": {"train_path": str(data)},
            "rollout": {"rollout_batch_size": 2},
            "loop": {"mode": mode, "groups_in_flight": 4} if mode == "streaming" else {"mode": mode},
            "services": {"trainer": {"port": 1}, "rollout": [{"port": 2}, {"port": 3}]},
            "tracing": {"trackers": []},
        }
    )
    parts = build_coordinator(config, run_dir=tmp_path)
    try:
        assert parts.buffer is None and parts.critic is None
        assert [type(t).__name__ for t in parts.trackers] == ["JsonlTracker"]  # metrics.jsonl: always written
        assert parts.pool.size == 2 and parts.data.size == 8
        assert parts.generations._max_workers == workers  # type: ignore[attr-defined]
        coordinator = Coordinator(parts)
        assert (coordinator.trainer, coordinator.pool, coordinator.num_rollout) == (parts.trainer, parts.pool, 4)
    finally:
        parts.generations.shutdown()
        parts.evals.shutdown()

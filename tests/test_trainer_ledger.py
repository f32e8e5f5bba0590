"""TrainLedger, the trainer's exactly-once bookkeeping, without DeepSpeed: replay, entry filtering, bounds, and the
state that travels in checkpoints (through JSON, as tandem_state.json holds it)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from services.contracts.trainer_calls import TrainResult
from services.trainer.ledger import TrainLedger


def _reply(rollout_id: int, step: int, entry_ids: list[str], samples: int = 4) -> TrainResult:
    return TrainResult(
        rollout_id=rollout_id,
        step=step,
        entry_ids=tuple(entry_ids),
        samples_trained=samples,
        metrics={"loss": 0.5 - 0.1 * step},
        time_s=0.25,
        samples_dropped_stale=0,
        samples_filtered=0,
    )


def test_a_recorded_rollout_replays_its_response():
    ledger = TrainLedger()
    assert not ledger.is_recorded(0)
    ledger.record(0, _reply(0, 1, ["1-0", "2-0"]))
    assert ledger.is_recorded(0) and (ledger.step, ledger.last_rollout_id, ledger.samples_trained) == (1, 0, 4)
    again = ledger.replay(0)
    assert again.replayed and not ledger.results[0].replayed  # the record itself is unchanged
    assert replace(again, replayed=False) == ledger.results[0]


def test_trained_entries_are_split_off_and_named_by_their_rollout():
    ledger = TrainLedger()
    ledger.record(3, _reply(3, 1, ["a", "b"]))
    ledger.record(5, _reply(5, 2, ["c"]))
    assert ledger.split(["x", "a", "y", "c"]) == (["x", "y"], ["a", "c"])
    assert ledger.rollouts_of(["c", "a", "b"]) == [3, 5]
    assert ledger.is_trained("b") and not ledger.is_trained("x")


def test_an_empty_step_keeps_the_step_count_and_rollout_ids_only_grow():
    ledger = TrainLedger()
    ledger.record(4, _reply(4, 1, ["a"]))
    ledger.record(2, _reply(2, 1, ["b"], samples=0))  # every sample stale: no optimizer step
    assert (ledger.step, ledger.last_rollout_id, ledger.samples_trained) == (1, 4, 4)


def test_records_are_bounded_oldest_first():
    ledger = TrainLedger(max_results=2, max_entries=3)
    for rollout_id in range(4):
        ledger.record(rollout_id, _reply(rollout_id, rollout_id + 1, [f"{rollout_id}-a", f"{rollout_id}-b"]))
    assert list(ledger.results) == [2, 3]
    assert list(ledger.trained_entries) == ["2-b", "3-a", "3-b"]
    assert not ledger.is_recorded(0) and ledger.samples_trained == 16


def test_state_round_trips_through_json():
    ledger = TrainLedger()
    ledger.record(0, _reply(0, 1, ["1-0"]))
    ledger.record(1, _reply(1, 2, ["2-0", "3-0"]))
    ledger.weight_version = 2
    state = json.loads(json.dumps(ledger.state_dict()))
    assert {"step", "rollout_id", "weight_version", "samples_trained", "trained_entries", "results"} == set(state)
    restored = TrainLedger()
    restored.load_state_dict(state)
    assert (restored.step, restored.last_rollout_id, restored.weight_version, restored.samples_trained) == (2, 1, 2, 8)
    assert restored.trained_entries == ledger.trained_entries
    assert restored.results == ledger.results
    assert list(restored.trained_entries) == ["1-0", "2-0", "3-0"]  # order kept: the bound drops the oldest
    assert restored.replay(1).metrics["loss"] == ledger.replay(1).metrics["loss"]


def test_a_checkpoint_written_when_results_were_protobuf_json_still_loads():
    """Checkpoints before TrainResult held google.protobuf.json_format's form: camelCase keys, 64-bit ints as
    strings, zero values left out."""
    state = {
        "step": 3,
        "rollout_id": 2,
        "weight_version": 2,
        "samples_trained": 8,
        "trained_entries": [["1-0", 2]],
        "results": {
            "2": {
                "rolloutId": "2",
                "step": "3",
                "metrics": {"loss": 0.25, "kl": "NaN"},
                "entryIds": ["1-0"],
                "samplesTrained": "8",
                "timeS": 0.5,
            }
        },
    }
    ledger = TrainLedger()
    ledger.load_state_dict(state)
    result = ledger.results[2]
    assert (
        result.rollout_id,
        result.step,
        result.entry_ids,
        result.samples_trained,
        result.samples_dropped_stale,
        result.time_s,
        result.metrics["loss"],
    ) == (2, 3, ("1-0",), 8, 0, 0.5, 0.25)
    assert math.isnan(result.metrics["kl"])

"""What the trainer has done, kept on rank 0 and in every checkpoint: the exactly-once bookkeeping of Train.

Train reads the named entries, trains one step, `record`s rollout_id → response and the entry ids, and only then
acknowledges the entries. A retried Train of a recorded rollout id gets the recorded response back (`replay`);
entries already trained under another rollout id are skipped (`split`). Both records are bounded: the oldest go.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import replace

from services.contracts.trainer_calls import TrainResult
from services.contracts.untyped import JsonObject

MAX_RECORDED_RESULTS = 1024  # replayable Train responses kept (and checkpointed)
MAX_RECORDED_ENTRIES = 100_000  # trained entry ids remembered to refuse a second delivery


class TrainLedger:
    def __init__(self, *, max_results: int = MAX_RECORDED_RESULTS, max_entries: int = MAX_RECORDED_ENTRIES):
        self.max_results, self.max_entries = max_results, max_entries
        self.step = 0  # optimizer steps taken
        self.last_rollout_id = -1  # the newest rollout trained
        self.weight_version = 0  # the version the last PublishWeights sent
        self.samples_trained = 0
        self.results: OrderedDict[int, TrainResult] = OrderedDict()
        self.trained_entries: OrderedDict[str, int] = OrderedDict()  # entry id -> the rollout that trained it

    def is_recorded(self, rollout_id: int) -> bool:
        return rollout_id in self.results

    def replay(self, rollout_id: int) -> TrainResult:
        """The recorded result, marked replayed."""
        return replace(self.results[rollout_id], replayed=True)

    def split(self, entry_ids: Iterable[str]) -> tuple[list[str], list[str]]:
        """(entries not trained yet, entries already trained), each in the given order."""
        ids = list(entry_ids)
        return [e for e in ids if e not in self.trained_entries], [e for e in ids if e in self.trained_entries]

    def is_trained(self, entry_id: str) -> bool:
        return entry_id in self.trained_entries

    def rollouts_of(self, entry_ids: Iterable[str]) -> list[int]:
        """The rollouts that trained these (known) entries, sorted, once each."""
        return sorted({self.trained_entries[e] for e in entry_ids})

    def record(self, rollout_id: int, reply: TrainResult) -> None:
        """After the step: its response and entries, forgetting the oldest beyond the bounds."""
        self.results[rollout_id] = reply
        while len(self.results) > self.max_results:
            self.results.popitem(last=False)
        for entry_id in reply.entry_ids:
            self.trained_entries[entry_id] = rollout_id
        while len(self.trained_entries) > self.max_entries:
            self.trained_entries.popitem(last=False)
        self.step = reply.step
        self.last_rollout_id = max(self.last_rollout_id, rollout_id)
        self.samples_trained += reply.samples_trained

    # ---- checkpoint state (the keys of tandem_state.json) ----------------------------------------------

    def state_dict(self) -> JsonObject:
        return {
            "step": self.step,
            "rollout_id": self.last_rollout_id,
            "weight_version": self.weight_version,
            "samples_trained": self.samples_trained,
            "trained_entries": list(self.trained_entries.items()),
            "results": {str(k): v.to_json() for k, v in self.results.items()},
        }

    def load_state_dict(self, state: JsonObject) -> None:
        self.step, self.last_rollout_id = int(state["step"]), int(state["rollout_id"])
        self.weight_version, self.samples_trained = int(state["weight_version"]), int(state["samples_trained"])
        self.trained_entries = OrderedDict((e, int(r)) for e, r in state["trained_entries"])
        self.results = OrderedDict((int(k), TrainResult.from_json(v)) for k, v in state["results"].items())
